"""`compile_layers`: the model body with each decoder layer compiled on its own (CPU inductor) equals the
eager forward, and layers of one kind share one compiled graph per shape, so the compile does not grow
with the depth (profiling/bench_compile.py measures the time)."""

import torch
import torch._dynamo.utils as dynamo_utils

from k26.config import ModelConfig
from k26.model import AttnBatch, KimiK2, compile_layers
from k26.tiny import DEFAULT_SIZES, text_config


def test_layers_compiled_once_per_shape_equal_the_eager_forward():
    # Every layer dense: the reference MoE loops over the experts it routed to (not traceable on the CPU;
    # on CUDA the fused kernels replace it).
    layers = 6
    sizes = DEFAULT_SIZES | {"num_hidden_layers": layers, "first_k_dense_replace": layers}
    cfg = ModelConfig.from_dict(text_config(sizes, 384, "none"))
    torch.manual_seed(0)
    model = KimiK2(cfg, torch.float32).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    fwd = compile_layers(model)
    cache = torch.randn(layers, 3, 32, cfg.latent_dim)
    torch._dynamo.reset()
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for B, N in ((2, 1), (3, 4), (2, 1)):  # two shapes, the first again
            ids = torch.randint(0, 300, (B, N))
            batch = AttnBatch.causal(torch.tensor([5, 7, 9][:B]), N)
            want, aux_want = model(ids, batch, cache, aux_layers=(1, 4))
            got, aux_got = fwd(ids, batch, cache, aux_layers=(1, 4))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(aux_got, aux_want, rtol=1e-5, atol=1e-5)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - before == 2  # one per shape, not per layer
