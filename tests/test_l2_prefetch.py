"""`torch.ops.k26.l2_prefetch` (a hint: changes no value, counts its launches in a ticket) and the model's
prefetch plans: the compiled layers keep every prefetch call (torch.compile drops an op with no output
unless it mutates something: the ticket) and compute what the eager model computes without prefetching."""

import pytest
import torch

from k26.config import ModelConfig
from k26.model import AttnBatch, CompiledLayers, KimiK2
from k26.model.model import L2_PLANS
from k26.ops import prefetch_cuda
from k26.tiny import DEFAULT_SIZES, text_config


def test_prefetch_op_counts_its_calls_and_checks_its_arguments():
    ticket, w = torch.zeros(1, dtype=torch.int32), torch.randn(8, 8)
    torch.ops.k26.l2_prefetch(ticket, [w, w[:, 2:]])
    torch.ops.k26.l2_prefetch(ticket, [])
    assert int(ticket) == 2
    with pytest.raises(ValueError, match="ticket must be one int32"):
        torch.ops.k26.l2_prefetch(torch.zeros(2, dtype=torch.int32), [w])
    with pytest.raises(ValueError, match="at most 16 tensors"):
        torch.ops.k26.l2_prefetch(ticket, [w] * 17)


def test_span_covers_a_strided_view_rounded_out_to_16_bytes():
    base = torch.zeros(4, 64, dtype=torch.bfloat16)
    view = base[1:3, 3:10]  # rows 1..2, columns 3..9
    begin, nbytes = prefetch_cuda.span(view)
    first, last = base.data_ptr() + (64 + 3) * 2, base.data_ptr() + (2 * 64 + 9) * 2 + 2
    assert begin % 16 == 0 and nbytes % 16 == 0
    assert begin <= first < last <= begin + nbytes < last + 16 + (first - begin) + 16
    assert prefetch_cuda.span(base[:0])[1] == 0


def _tiny(layers: int) -> KimiK2:
    sizes = DEFAULT_SIZES | {"num_hidden_layers": layers, "first_k_dense_replace": layers}
    cfg = ModelConfig.from_dict(text_config(sizes, 384, "none"))
    torch.manual_seed(0)
    model = KimiK2(cfg, torch.float32).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    return model


def test_compiled_layers_keep_every_prefetch_and_compute_the_same():
    layers = 3
    model = _tiny(layers)
    model.fuse_dense_()
    cache = torch.randn(layers, 2, 32, model.cfg.latent_dim)
    ids, batch = torch.randint(0, 300, (2, 1)), AttnBatch.causal(torch.tensor([5, 7]), 1)
    with torch.no_grad():
        want, _ = model(ids, batch, cache.clone())
        model.plan_l2_prefetch_("moe+next")
        torch._dynamo.reset()
        got, _ = CompiledLayers(model)(ids, batch, cache.clone())
        got2, _ = CompiledLayers(model)(ids, batch, cache.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2, want, rtol=1e-5, atol=1e-5)
    # Dense layers: one prefetch a forward each (before the attention; "next" is issued inside the MoE).
    assert [int(layer.l2_ticket) for layer in model.layers] == [2] * layers


def test_plan_names_are_checked():
    model = _tiny(1)
    with pytest.raises(ValueError, match="l2 prefetch plan must be one of"):
        model.plan_l2_prefetch_("everything")
    assert L2_PLANS[0] == "off"
