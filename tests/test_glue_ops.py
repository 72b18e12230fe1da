"""torch.ops.k26.mla_glue on CPU: its reference is the composition MLA ran before (the q_a / kv_a RMSNorm
modules, Rope on k_pe, mla_write_cache), bitwise; schema and fake agree (opcheck); bad inputs are named;
MLA with the stacked q_a / kv_a matrix (`fuse_`) computes what it computed before.
torch.ops.k26.mla_glue_linear (the glue and the q_b projection in one launch) is the glue op then the linear
op, bitwise."""

import pytest
import torch

import k26.ops  # noqa: F401  (registers the ops)
from k26.config import ModelConfig
from k26.model import AttnBatch, KimiK2
from k26.model.layers import RMSNorm
from k26.model.rope import Rope
from k26.tiny import DEFAULT_SIZES, text_config

Q, R, P = (DEFAULT_SIZES[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim"))


def rand(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def inputs(B=2, N=3, seed=0, L=20):
    g = torch.Generator().manual_seed(seed)
    rope_cfg = ModelConfig.from_dict(TINY).rope
    return {
        "q_a": rand(B, N, Q, seed=seed + 1),
        "kv_a": rand(B, N, R + P, seed=seed + 2),
        "q_norm_weight": rand(Q, seed=seed + 3),
        "kv_norm_weight": rand(R, seed=seed + 4),
        "positions": torch.randint(0, 5000, (B, N), generator=g),
        "inv_freq": Rope(rope_cfg, P).inv_freq,
        "eps": 1e-6,
        "cache": rand(B + 1, L, R + P, seed=seed + 5),
        "rows": torch.randperm(B + 1, generator=g)[:B],
        "prefix_lens": torch.randint(0, L - N, (B,), generator=g),
    }


TINY = text_config(DEFAULT_SIZES, 384, "none")


def test_reference_is_the_module_composition():
    a = inputs()
    cache = a["cache"].clone()
    q = torch.ops.k26.mla_glue(**a)
    qn, kvn = RMSNorm(Q, 1e-6, torch.bfloat16), RMSNorm(R, 1e-6, torch.bfloat16)
    qn.weight.data, kvn.weight.data = a["q_norm_weight"], a["kv_norm_weight"]
    rope = Rope(ModelConfig.from_dict(TINY).rope, P)
    latent = torch.cat([kvn(a["kv_a"][..., :R]), rope(a["kv_a"][..., R:], a["positions"])], dim=-1)
    torch.ops.k26.mla_write_cache(cache, latent, a["rows"], a["prefix_lens"])
    assert torch.equal(q, qn(a["q_a"]))
    assert torch.equal(a["cache"], cache)
    assert not torch.equal(cache, inputs()["cache"])  # the write happened


def test_rope_rotates_interleaved_pairs():
    x, pos = rand(5, P, seed=9, dtype=torch.float32), torch.arange(5)
    rope = Rope(ModelConfig.from_dict(TINY).rope, P)
    ang = pos[:, None].float() * rope.inv_freq
    want = torch.view_as_real(
        torch.view_as_complex(x.unflatten(-1, (-1, 2))) * torch.polar(torch.ones_like(ang), ang)
    )
    assert torch.allclose(rope(x, pos), want.flatten(-2), atol=1e-5)


def test_strided_views_give_the_same_result():
    a = inputs(seed=3)
    stacked = torch.cat([a["q_a"], a["kv_a"]], dim=-1)
    b = dict(a, cache=a["cache"].clone(), q_a=stacked[..., :Q], kv_a=stacked[..., Q:])
    assert torch.equal(torch.ops.k26.mla_glue(**a), torch.ops.k26.mla_glue(**b))
    assert torch.equal(a["cache"], b["cache"])


def test_mla_glue_opcheck():
    a = inputs(seed=4)
    args = tuple(a.values())
    torch.library.opcheck(torch.ops.k26.mla_glue.default, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize(
    "change, name",
    [
        ({"kv_norm_weight": torch.ones(R + 1, dtype=torch.bfloat16)}, "kv_a"),
        ({"q_norm_weight": torch.ones(Q + 8, dtype=torch.bfloat16)}, "q_norm_weight"),
        ({"positions": torch.zeros(2, 3, dtype=torch.int32)}, "positions"),
        ({"rows": torch.zeros(3, dtype=torch.long)}, "rows"),
        ({"cache": torch.zeros(3, 20, R + P + 8, dtype=torch.bfloat16)}, "cache"),
        ({"inv_freq": torch.ones(P // 2, dtype=torch.float64)}, "inv_freq"),
        ({"kv_a": torch.zeros(2, 3, R + P)}, "kv_a"),
    ],
)
def test_bad_input_is_named(change, name):
    with pytest.raises(ValueError, match=f"k26.mla_glue: {name}"):
        torch.ops.k26.mla_glue(**(inputs() | change))


def test_glue_linear_is_the_glue_then_the_projection():
    a = inputs(seed=6)
    w = rand(40, Q, seed=7)
    cache = a["cache"].clone()
    y = torch.ops.k26.mla_glue_linear(**a, weight=w)
    want = torch.ops.k26.linear(torch.ops.k26.mla_glue(**(a | {"cache": cache})), w)
    assert torch.equal(y, want) and torch.equal(a["cache"], cache)
    assert not torch.equal(cache, inputs(seed=6)["cache"])  # the write happened


def test_mla_glue_linear_opcheck():
    args = (*inputs(seed=8).values(), rand(24, Q, seed=9))
    torch.library.opcheck(
        torch.ops.k26.mla_glue_linear.default, args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize(
    "weight, name",
    [(torch.ones(8, Q + 8, dtype=torch.bfloat16), "weight"), (torch.ones(8, Q), "weight dtype")],
)
def test_glue_linear_bad_weight_is_named(weight, name):
    with pytest.raises(ValueError, match=f"k26.mla_glue: {name}"):
        torch.ops.k26.mla_glue_linear(**inputs(), weight=weight)


def test_glue_linear_front_door_hands_the_kernel_its_arguments(monkeypatch):
    """The CUDA implementation's launch arguments, against a stand-in library (no GPU here): the pointers,
    strides and sizes in the C export's order at one token, and no launch at two (the two ops)."""
    from types import SimpleNamespace

    from k26.ops import glue_cuda

    calls = []

    class Lib:
        k26_mla_glue_linear_max_tokens = staticmethod(lambda: 16)
        k26_mla_glue_linear_row_bytes = staticmethod(lambda q: (q + 32) * 2)
        k26_mla_glue_linear_max_smem = staticmethod(lambda: 88 * 1024)

        def k26_mla_glue_linear(self, *args):
            calls.append(args)
            return 0

    monkeypatch.setattr(glue_cuda, "_lib", Lib)
    monkeypatch.setattr(glue_cuda, "_unsupported", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=7))
    a, w = inputs(B=1, N=1, seed=11), rand(24, Q, seed=12)
    out = glue_cuda.glue_linear_cuda(**a, weight=w)
    (args,) = calls
    want_ptrs = [a[k].data_ptr() for k in ("q_a", "kv_a", "q_norm_weight", "kv_norm_weight", "positions")]
    want_ptrs += [a[k].data_ptr() for k in ("inv_freq", "rows", "prefix_lens", "cache")]
    assert list(args[:11]) == [*want_ptrs, w.data_ptr(), out.data_ptr()]
    c = a["cache"]
    assert args[11:22] == (Q, R + P, c.stride(0), c.stride(1), Q, 1, 1, Q, R, P, 24)
    assert args[22] == pytest.approx(1e-6) and args[23] in (0, 1) and args[24] == 7
    assert tuple(out.shape) == (1, 1, 24)
    glue_cuda.glue_linear_cuda(**inputs(B=1, N=2, seed=13), weight=w)  # two tokens: the two ops
    assert len(calls) == 1


def random_tiny(dtype: torch.dtype, seed: int) -> tuple[ModelConfig, KimiK2]:
    """The tiny config's model with N(0, 0.3) weights, the global RNG seeded first (later draws follow)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_dict(TINY)
    model = KimiK2(cfg, dtype).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return cfg, model


def test_fused_mla_matches_unfused():
    cfg, model = random_tiny(torch.float32, 0)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    batch = AttnBatch.causal(torch.tensor([3, 7]), 5)
    caches = [torch.randn(cfg.num_hidden_layers, 2, 16, cfg.latent_dim) for _ in range(2)]
    caches[1].copy_(caches[0])
    with torch.no_grad():
        h0, _ = model(ids, batch, caches[0])
        attn = model.layers[0].self_attn
        q_w = attn.q_a_proj.weight.clone()
        model.fuse_dense_()
        assert attn.q_a_proj.weight.data_ptr() == attn.qkv_a.data_ptr() and torch.equal(
            attn.q_a_proj.weight, q_w
        )
        h1, _ = model(ids, batch, caches[1])
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)  # one matmul instead of two: rounding only
    torch.testing.assert_close(caches[1], caches[0], rtol=1e-5, atol=1e-5)


def test_glue_op_in_the_model_is_bitwise_the_composition():
    """The model's forward on two copies of a random cache, with the glue op and with the module composition
    (MLA.glue off), is the same bits: hidden states and caches."""
    cfg, model = random_tiny(torch.bfloat16, 1)
    ids = torch.randint(0, cfg.vocab_size, (2, 4))
    batch = AttnBatch.causal(torch.tensor([2, 5]), 4)
    caches = [torch.randn(cfg.num_hidden_layers, 2, 12, cfg.latent_dim).bfloat16() for _ in range(2)]
    caches[1].copy_(caches[0])
    with torch.no_grad():
        h0, _ = model(ids, batch, caches[0])
        for layer in model.layers:
            layer.self_attn.glue = False
        h1, _ = model(ids, batch, caches[1])
    assert torch.equal(h0, h1) and torch.equal(caches[0], caches[1])


def _op_calls(model, ids, batch, cache, op: str = "k26::linear") -> int:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids, batch, cache)
    return sum(e.count for e in prof.key_averages() if e.key == op)


def test_fuse_dense_sends_each_residual_add_and_norm_through_one_op():
    """`fuse_dense_` turns on `RMSNorm.use_kernel` for the norms after a residual add: each layer's two
    (residual add, norm) pairs become one `k26::add_rmsnorm` call (2 per layer, counted), and the output is
    unchanged (on the CPU the op is the reference itself); the MLA's own norms and layer 0's input norm (no
    add before it) are not among them."""
    cfg, model = random_tiny(torch.bfloat16, 3)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    batch = AttnBatch.causal(torch.tensor([3, 7]), 5)
    cache = torch.randn(cfg.num_hidden_layers, 2, 16, cfg.latent_dim).bfloat16()
    with torch.no_grad():
        h0, _ = model(ids, batch, cache.clone())
        assert _op_calls(model, ids, batch, cache.clone(), "k26::add_rmsnorm") == 0
        model.fuse_dense_()
        assert all(n.use_kernel for n in model.residual_norms())
        assert not model.layers[0].self_attn.q_a_layernorm.use_kernel
        assert not model.layers[0].input_layernorm.use_kernel
        for layer in model.layers:  # the projections as before: only the norms differ
            layer.self_attn.kernel_max_m = layer.self_attn.short_k_max_m = 0
        h1, _ = model(ids, batch, cache.clone())
    assert torch.equal(h0, h1)
    assert _op_calls(model, ids, batch, cache.clone(), "k26::add_rmsnorm") == 2 * cfg.num_hidden_layers


def test_prefill_above_64_rows_leaves_the_small_m_kernel():
    """Decode / verify batches up to 512 rows take the batch-invariant kernel (a verify step must reproduce
    decode's bits); a prefill, which no forward reproduces, takes it only up to 64 rows."""
    cfg, model = random_tiny(torch.bfloat16, 2)
    model.fuse_dense_()
    cache = torch.zeros(cfg.num_hidden_layers, 2, 128, cfg.latent_dim).bfloat16()
    for B, N, prefill, kernel in (
        (2, 20, False, True),
        (2, 20, True, True),
        (1, 80, False, True),
        (1, 80, True, False),
        (1, 64, True, True),  # the edge: 64 rows of prefill still in the kernel, 65 not
        (1, 65, True, False),
    ):
        ids = torch.randint(0, cfg.vocab_size, (B, N))
        batch = AttnBatch.causal(torch.zeros(B, dtype=torch.long), N, prefill=prefill)
        assert (_op_calls(model, ids, batch, cache) > 0) == kernel, (B, N, prefill)


def test_fused_model_runs_glue_and_q_b_as_one_op():
    """After `fuse_dense_` each layer's glue and q_b projection are one `k26::mla_glue_linear` call (counted),
    with the same bits as the module composition (MLA.glue off)."""
    cfg, model = random_tiny(torch.bfloat16, 4)
    model.fuse_dense_()
    ids = torch.randint(0, cfg.vocab_size, (2, 3))
    batch = AttnBatch.causal(torch.tensor([1, 4]), 3)
    cache = torch.randn(cfg.num_hidden_layers, 2, 12, cfg.latent_dim).bfloat16()
    caches = [cache.clone(), cache.clone()]
    with torch.no_grad():
        assert _op_calls(model, ids, batch, cache.clone(), "k26::mla_glue_linear") == cfg.num_hidden_layers
        h0, _ = model(ids, batch, caches[0])
        for layer in model.layers:
            layer.self_attn.glue = False
        h1, _ = model(ids, batch, caches[1])
    assert torch.equal(h0, h1) and torch.equal(caches[0], caches[1])


def test_fused_mla_runs_o_proj_in_the_small_m_kernel():
    """After `fuse_dense_`, decode / verify rows run o_proj through `k26::linear` as well as the stacked q_a /
    kv_a (q_b goes with the glue, W_UK / W_UV through `k26::linear_grouped`): a verify step then reproduces
    decode's MLA projections bit for bit. With `short_k_max_m` at 0 o_proj is the module's cuBLAS again (one
    call a layer fewer), and the output the same (on the CPU the op is the reference). (A dense layer's MLP
    adds one call, its down projection: its gate / up runs as `k26::linear_swiglu`.)"""
    cfg, model = random_tiny(torch.bfloat16, 5)
    model.fuse_dense_()
    ids = torch.randint(0, cfg.vocab_size, (2, 3))
    batch = AttnBatch.causal(torch.tensor([2, 5]), 3)
    cache = torch.randn(cfg.num_hidden_layers, 2, 12, cfg.latent_dim).bfloat16()
    L, dense = cfg.num_hidden_layers, sum(layer.dense for layer in model.layers)
    with torch.no_grad():
        assert _op_calls(model, ids, batch, cache.clone()) == 2 * L + dense
        h0, _ = model(ids, batch, cache.clone())
        for layer in model.layers:
            layer.self_attn.short_k_max_m = 0
        assert _op_calls(model, ids, batch, cache.clone()) == L + dense
        h1, _ = model(ids, batch, cache.clone())
    torch.testing.assert_close(h0.float(), h1.float(), rtol=2e-2, atol=2e-2)


def test_fuse_dense_runs_the_dense_mlp_gate_up_as_one_swiglu_call():
    """After `fuse_dense_` each dense layer's MLP (the tiny config's layer 0) runs gate / up with SiLU·up as
    one `k26::linear_swiglu` call up to layers.KERNEL_MAX_ROWS rows (more: cuBLAS), `fuse_mlp_(False)` puts
    it back on cuBLAS, and the output is the unfused model's (on the CPU the op is the reference)."""
    cfg, model = random_tiny(torch.bfloat16, 6)
    ids = torch.randint(0, cfg.vocab_size, (2, 3))
    batch = AttnBatch.causal(torch.tensor([2, 5]), 3)
    cache = torch.randn(cfg.num_hidden_layers, 2, 12, cfg.latent_dim).bfloat16()
    dense = sum(layer.dense for layer in model.layers)
    assert dense >= 1
    with torch.no_grad():
        h0, _ = model(ids, batch, cache.clone())
        model.fuse_dense_()
        assert _op_calls(model, ids, batch, cache.clone(), "k26::linear_swiglu") == dense
        h1, _ = model(ids, batch, cache.clone())
        long_ids = torch.randint(0, cfg.vocab_size, (2, 9))  # 18 rows > layers.KERNEL_MAX_ROWS: cuBLAS
        long_cache = torch.randn(cfg.num_hidden_layers, 2, 16, cfg.latent_dim).bfloat16()
        long_batch = AttnBatch.causal(torch.tensor([2, 5]), 9)
        assert _op_calls(model, long_ids, long_batch, long_cache, "k26::linear_swiglu") == 0
        model.fuse_mlp_(kernel=False)
        assert _op_calls(model, ids, batch, cache.clone(), "k26::linear_swiglu") == 0
    torch.testing.assert_close(h1.float(), h0.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("field, value", [("rows", -1), ("prefix_lens", -2), ("prefix_lens", 18)])
def test_the_cuda_door_refuses_a_span_outside_the_cache_before_its_reference_fallback(field, value):
    """A float32 model's glue runs the reference from the CUDA door: a negative row or prefix (which the
    reference wraps onto another sequence's slots) or a span past the row is refused there too, the cache
    untouched."""
    from k26.ops.glue_cuda import cuda_mla_glue

    a = {
        k: v.float() if k in ("q_a", "kv_a", "q_norm_weight", "kv_norm_weight", "cache") else v
        for k, v in inputs().items()
    }
    a[field] = torch.full_like(a[field], value)
    before = a["cache"].clone()
    with pytest.raises(ValueError, match="k26.mla_glue: prefix_lens"):
        cuda_mla_glue(**a)
    assert torch.equal(a["cache"], before)
