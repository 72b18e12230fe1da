"""`compile_static` serves more bucket shapes than dynamo's default limit (a hard failure under fullgraph),
and `CompiledLayers` — each decoder layer compiled on its own (CPU inductor) — equals the eager forward with
one compiled graph per shape for all layers of a kind (profiling/bench_compile.py measures the time)."""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch.utils._python_dispatch import TorchDispatchMode

from k26.config import ModelConfig
from k26.model import AttnBatch, CompiledLayers, KimiK2
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
    fwd = CompiledLayers(model)
    # Used where the model is (spec/step.py reads target.lm_head and calls target.logits): its attributes.
    assert fwd.lm_head is model.lm_head and fwd.cfg is model.cfg
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
            torch.testing.assert_close(fwd.logits(got), model.logits(want), rtol=1e-5, atol=1e-5)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - before == 2  # one per shape, not per layer


def test_compile_static_serves_more_buckets_than_dynamo_s_default_limit():
    """A fullgraph body compiled once per bucket shape: torch alone fails hard at the ninth shape
    (FailOnRecompileLimitHit); compile_static serves twelve, and leaves the process default untouched."""
    from k26.compiling import compile_static

    def plain_body(x):
        return (x * 2).sum()

    def static_body(x):  # its own code object: dynamo keeps its compiled versions per code object
        return (x * 2).sum()

    plain, static = torch.compile(plain_body, fullgraph=True, dynamic=False), compile_static(static_body)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for n in range(1, 13):
            plain(torch.ones(n))
    assert [float(static(torch.ones(n))) for n in range(1, 13)] == [2.0 * n for n in range(1, 13)]
    assert torch._dynamo.config.recompile_limit == 8


def tiny_drafter_and_block(seed: int):
    """A 2-layer fp32 DFlash drafter with random weights (seeded), a 2-row cache, a block of 4 queries and
    their ragged context lengths: (drafter, (x, pos, cache_k, cache_v, rows, lens))."""
    from k26.drafter_config import DrafterConfig
    from k26.model.drafter import DFlashDrafter

    raw = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "vocab_size": 300,
        "max_position_embeddings": 512,
        "rope_theta": 50000.0,
        "block_size": 4,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 299},
    }
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw), torch.float32).eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.2)
    ck, cv = torch.randn(2, 3, 40, 2, 16), torch.randn(2, 3, 40, 2, 16)
    x, pos = torch.randn(2, 4, 64), torch.tensor([[11, 12, 13, 14], [30, 31, 32, 33]])
    return drafter, (x, pos, ck, cv, torch.tensor([2, 0]), torch.tensor([11, 30]))


def test_compiled_drafter_and_fused_norms_equal_the_eager_forward():
    """`CompiledDrafter` (the block forward under torch.compile, CPU inductor) equals the eager forward on
    random weights and ragged contexts, and `fuse_` (q / k / v and gate / up stacked, residual adds + norms
    as one op) changes no value beyond fp32 summation order, in the forward and the context K/V; the
    drafter's other attributes are its own."""
    from k26.model.drafter import CompiledDrafter

    drafter, (x, pos, ck, cv, rows, lens) = tiny_drafter_and_block(0)
    with torch.no_grad():
        want = drafter(x, pos, ck, cv, rows, lens, static=True)
        fwd = CompiledDrafter(drafter)
        assert fwd.cfg is drafter.cfg
        torch.testing.assert_close(fwd(x, pos, ck, cv, rows, lens, static=True), want, rtol=1e-5, atol=1e-5)
        # the context append, compiled: the same cache writes (slot 39 is past a clamp, row 2 the trash row)
        feat, cpos = torch.randn(2, 3, 128), torch.tensor([[5, 6, 7], [38, 39, 45]])
        valid = torch.tensor([[True, True, False], [True, True, True]])
        caches = [(ck.clone(), cv.clone()) for _ in range(2)]
        drafter.append_context(*caches[0], feat, cpos, rows, valid_BC=valid)
        fwd.append_context(*caches[1], feat, cpos, rows, valid_BC=valid)
        for a, b in zip(caches[0], caches[1], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        feat = torch.randn(2, 5, 128)
        kv_want = drafter.context_kv(feat, pos[:, :1] + torch.arange(5))
        drafter.fuse_()
        assert all(n.use_kernel for n in drafter.residual_norms())
        assert drafter.layers[0].self_attn.qkv is not None and drafter.layers[0].mlp.gate_up is not None
        got = drafter(x, pos, ck, cv, rows, lens, static=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        kv_got = drafter.context_kv(feat, pos[:, :1] + torch.arange(5))
        for got_t, want_t in zip(kv_got, kv_want, strict=True):  # (k, v), every layer stacked
            torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=1e-5)


def test_compiled_acceptance_equals_eager():
    """`accept_paths_compiled` (the captured steps' acceptance walk under torch.compile) returns exactly
    the eager paths, counts, bonus and emitted tokens on random trees with random target choices (some
    rows finished)."""
    from k26.spec.accept import accept_paths, accept_paths_compiled
    from k26.spec.tree import build_ddtree

    g = torch.Generator().manual_seed(3)
    lp = torch.log_softmax(torch.randn(4, 7, 12, generator=g) * 3, -1)
    tree = build_ddtree(lp, 15)
    alive = torch.tensor([True, True, False, True])
    for _ in range(3):
        # choices drawn from each node's children's tokens most of the time, so paths go deep
        pick = torch.randint(0, tree.num_nodes, (4, tree.num_nodes), generator=g)
        choice = torch.where(torch.rand(4, tree.num_nodes, generator=g) < 0.8, tree.tokens.gather(1, pick), 0)
        want = accept_paths(tree, choice, alive)
        got = accept_paths_compiled()(tree, choice, alive)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_forward_checks_its_cache_spans_once_not_per_layer(monkeypatch, mode):
    """Each layer's cache ops (MLA glue, attention) check the batch's spans, a device sync on CUDA each: the
    forward checks them once for all its layers (also under inference mode, the engine's: its tensors keep
    no version). A span past the cache is still refused, naming the forward; an op alone still checks."""
    from k26.ops import reference

    layers = 4
    sizes = DEFAULT_SIZES | {"num_hidden_layers": layers, "first_k_dense_replace": layers}
    cfg = ModelConfig.from_dict(text_config(sizes, 384, "none"))
    model = KimiK2(cfg, torch.float32).eval()
    cache = torch.randn(layers, 3, 32, cfg.latent_dim)
    calls = []
    real = reference.spans_bad
    monkeypatch.setattr(reference, "spans_bad", lambda *a: calls.append(a) or real(*a))
    with mode():
        model(torch.randint(0, 300, (2, 4)), AttnBatch.causal(torch.tensor([5, 9]), 4), cache)
        assert len(calls) == 1
        with pytest.raises(ValueError, match="KimiK2.forward: prefix_lens \\+ 4 exceeds the cache length 32"):
            model(torch.randint(0, 300, (2, 4)), AttnBatch.causal(torch.tensor([5, 29]), 4), cache)
    rows, prefix = torch.tensor([0, 1]), torch.tensor([5, 29])
    with pytest.raises(ValueError, match="mla_write_cache"):
        torch.ops.k26.mla_write_cache(cache[0], torch.randn(2, 4, cfg.latent_dim), rows, prefix)


def context_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Target features [2, 5, 128] of two sequences' context rows and their positions (10 rows)."""
    return torch.randn(2, 5, 128), torch.tensor([[3, 4, 5, 6, 7], [20, 21, 22, 23, 24]])


def assert_block_and_kv_close(got, want) -> None:
    """(block forward, context (k, v)) pairs equal within fp32 summation order."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for got_t, want_t in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=1e-5)


class LinearCalls(TorchDispatchMode):
    """Records the weight shape of every small-M kernel call under it (`torch.ops.k26.linear` and
    `linear_swiglu`, in call order), the SwiGLU ones also in `swiglu`."""

    def __init__(self):
        super().__init__()
        self.weights: list[tuple[int, ...]] = []
        self.swiglu: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.k26.linear.default, torch.ops.k26.linear_swiglu.default):
            self.weights.append(tuple(args[1].shape))
        if func is torch.ops.k26.linear_swiglu.default:
            self.swiglu.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


def test_drafter_fuse_stacks_for_the_small_m_kernel_too():
    """With the drafter's projections in the small-M kernel (`use_linear_kernel`), `fuse_` still stacks q / k
    / v and gate / up, and each stack is one small-M kernel call: a block forward runs 4 a layer (q/k/v,
    o_proj, gate/up with SiLU·up as `linear_swiglu`, down), the context K/V fc + one K/V call a layer; the
    values equal the unfused cuBLAS-path forward."""
    from k26.model.layers import use_linear_kernel

    drafter, (x, pos, ck, cv, rows, lens) = tiny_drafter_and_block(1)
    feat, cpos = context_rows()
    with torch.no_grad():
        want, kv_want = drafter(x, pos, ck, cv, rows, lens, static=True), drafter.context_kv(feat, cpos)
        assert use_linear_kernel(drafter) > 0
        drafter.fuse_()
        attn, mlp = drafter.layers[0].self_attn, drafter.layers[0].mlp
        assert attn.qkv is not None and mlp.gate_up is not None
        with LinearCalls() as calls:
            got = drafter(x, pos, ck, cv, rows, lens, static=True)
        layer = [tuple(attn.qkv.shape), tuple(attn.o_proj.weight.shape), tuple(mlp.gate_up.shape)]
        assert calls.weights == (layer + [tuple(mlp.down_proj.weight.shape)]) * 2
        assert calls.swiglu == [tuple(mlp.gate_up.shape)] * 2  # gate / up with SiLU·up: one call
        with LinearCalls() as calls:
            kv_got = drafter.context_kv(feat, cpos)
        kv_rows = attn.qkv.shape[0] - attn.q_proj.weight.shape[0]
        assert calls.weights == [tuple(drafter.fc.weight.shape)] + [(kv_rows, 64)] * 2
    assert_block_and_kv_close((got, kv_got), (want, kv_want))


def test_drafter_projections_above_the_row_bound_stay_on_cublas():
    """`use_linear_kernel(max_rows=)` (the drafter's `use_linear_kernel_` passes a prefill's crossover): an
    input of at most that many rows runs the small-M kernel, one of more (a prompt's context K/V) F.linear,
    stacks included; the values equal the cuBLAS-path forward's either way."""
    from k26.model.layers import KERNEL_MAX_ROWS, use_linear_kernel

    drafter, (x, pos, ck, cv, rows, lens) = tiny_drafter_and_block(2)  # a block of 2 x 4 = 8 rows
    feat, cpos = context_rows()  # 10 rows
    with torch.no_grad():
        want, kv_want = drafter(x, pos, ck, cv, rows, lens, static=True), drafter.context_kv(feat, cpos)
        drafter.fuse_()
        use_linear_kernel(drafter, max_rows=8)
        with LinearCalls() as calls:
            got = drafter(x, pos, ck, cv, rows, lens, static=True)
        assert len(calls.weights) == 4 * len(drafter.layers)  # q/k/v, o_proj, gate/up, down: the kernel
        with LinearCalls() as calls:
            kv_got = drafter.context_kv(feat, cpos)
        assert calls.weights == []  # 10 rows > 8: cuBLAS
        assert drafter.use_linear_kernel_() > 0 and drafter.fc.kernel_max_rows == KERNEL_MAX_ROWS
    assert_block_and_kv_close((got, kv_got), (want, kv_want))
