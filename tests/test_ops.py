"""Every torch.ops.k26 op has a schema, a fake and a reference that agree (torch.library.opcheck)."""

from pathlib import Path

import pytest
import torch
from oracles import random_int4_experts

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops import OPS, causal_words, reference, reference_tree


def test_ops_lists_every_registered_op():
    """OPS is the list the fake check below walks: every op the package registers is in it."""
    import k26.engine  # noqa: F401  (everything the LLM imports: the model, dist, the decoder)

    registered = {
        n.removeprefix("k26::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("k26::")
    }
    assert registered == set(OPS)


def test_every_op_is_registered_with_a_fake():
    for name in OPS:
        op = getattr(torch.ops.k26, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta") or torch.library.get_kernel(
            op, "Meta"
        ), name


def moe_inputs(T=5, E=4, D=64, inter=64, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return (x, *random_int4_experts(E, D, inter, g, min_scale=0.0), ids, w)


def test_moe_opcheck():
    torch.library.opcheck(
        torch.ops.k26.moe_w4a16.default, moe_inputs(), test_utils=("test_schema", "test_faketensor")
    )


def test_add_rmsnorm_opcheck():
    g = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(3, 64, generator=g).bfloat16() for _ in range(2))
    torch.library.opcheck(torch.ops.k26.add_rmsnorm.default, (x, residual, torch.rand(64).bfloat16(), 1e-6))


def test_moe_reference_is_per_token_sum():
    args = moe_inputs(T=3)
    x, ids, w = args[0], args[7], args[8]
    out = torch.ops.k26.moe_w4a16(*args)
    from k26.ops import dequantize_int4

    for t in range(3):
        acc = torch.zeros(64)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            wg, wu, wd = (dequantize_int4(args[i][e], args[i + 1][e], torch.float32) for i in (1, 3, 5))
            acc += w[t, k] * (wd @ (torch.nn.functional.silu(wg @ x[t]) * (wu @ x[t])))
        assert torch.allclose(out[t], acc, rtol=1e-4, atol=1e-4)


def attention_inputs(B=2, N=5, H=3, C=40, v=32, L=16):
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(4, L, C, generator=g)
    q = torch.randn(B, N, H, C, generator=g)
    return q, cache, torch.tensor([2, 0]), torch.tensor([6, 3]), causal_words(B, N, "cpu"), 0.3, v


def rotary_inputs():
    """attention_inputs() with the query split: its first C - 4 dims and a 4-dim rotary part before RoPE."""
    q, cache, rows, prefix, words, scale, v = attention_inputs()
    g = torch.Generator().manual_seed(7)
    positions = prefix[:, None] + torch.arange(q.shape[1])
    inv_freq = torch.rand(2, generator=g)
    return (q[..., :-4], cache, rows, prefix, words, scale, v, False, q[..., -4:], positions, inv_freq)


@pytest.mark.parametrize("inputs", [attention_inputs, rotary_inputs], ids=["whole_query", "rotary_query"])
def test_attention_opcheck(inputs):
    torch.library.opcheck(
        torch.ops.k26.mla_tree_attention.default, inputs(), test_utils=("test_schema", "test_faketensor")
    )


def test_rope_rotates_interleaved_pairs_by_position_times_frequency():
    g = torch.Generator().manual_seed(3)
    x, pos, freq = (
        torch.randn(2, 3, 8, generator=g),
        torch.randint(0, 5000, (2, 3), generator=g),
        torch.rand(4),
    )
    # Independently: pairs (2i, 2i + 1) as complex numbers times e^{i · angle}, the angle pos · freq_i in fp32
    # as specified (at pos ~ 5000 its rounding alone moves the result by ~1e-4).
    angle = (pos[..., None].float() * freq).double()
    turn = torch.polar(torch.ones(2, 3, 4, dtype=torch.float64), angle)
    want = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (4, 2)).contiguous()) * turn)
    assert torch.allclose(reference.rope(x, pos, freq).double(), want.flatten(-2), atol=1e-4)


def test_rotary_query_attends_as_its_rotated_concatenation():
    q, cache, rows, prefix, words, scale, v, static, q_pe, positions, inv_freq = rotary_inputs()
    whole = torch.cat([q, reference.rope(q_pe, positions[:, :, None], inv_freq)], dim=-1)
    got = torch.ops.k26.mla_tree_attention(
        q, cache, rows, prefix, words, scale, v, static, q_pe, positions, inv_freq
    )
    want = torch.ops.k26.mla_tree_attention(whole, cache, rows, prefix, words, scale, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(whole[..., -4:], q_pe)  # the rotation did something


def test_attention_front_door_names_why_it_runs_the_reference():
    from k26.ops.attention_cuda import _unsupported

    bf = torch.zeros(1, 1, 8, 512, dtype=torch.bfloat16)
    assert _unsupported(bf.float(), 576, 512, None) == "dtype torch.float32"
    assert "key width 64" in _unsupported(bf[..., :64], 64, 32, None)
    assert "rotary query of 448 + 128" in _unsupported(bf[..., :448], 576, 512, bf[..., :128])
    assert _unsupported(bf, 576, 512, bf[..., :64]) is None
    # more new tokens than the kernel holds: the reference (as the CPU op and the fake), not a ValueError
    assert "257 new tokens a sequence" in _unsupported(bf.expand(1, 257, 8, 512), 576, 512, None)


def test_write_cache_opcheck():
    cache = torch.randn(3, 12, 8)
    args = (cache, torch.randn(2, 4, 8), torch.tensor([2, 0]), torch.tensor([3, 8]))
    torch.library.opcheck(
        torch.ops.k26.mla_write_cache.default, args, test_utils=("test_schema", "test_faketensor")
    )
    torch.ops.k26.mla_write_cache(*args)
    assert torch.equal(cache[2, 3:7], args[1][0]) and torch.equal(cache[0, 8:12], args[1][1])


def test_attention_lse_and_visibility():
    q, cache, rows, prefix, words, scale, v = attention_inputs()
    out, lse = torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, scale, v)
    # (causal words) query n of sequence b sees its cache row's slots [0, prefix + n]: every one by hand, the
    # longest row's last query included
    for b in range(q.shape[0]):
        for n in range(q.shape[1]):
            keys = cache[rows[b], : int(prefix[b]) + n + 1]
            s = (q[b, n] @ keys.T) * scale
            assert torch.allclose(lse[b, n], torch.logsumexp(s, -1), atol=1e-5), (b, n)
            assert torch.allclose(out[b, n], torch.softmax(s, -1) @ keys[:, :v], atol=1e-5), (b, n)


def test_attention_refuses_overflowing_cache():
    # sequence 0: prefix 6 + 5 new tokens = 11 slots: a row of 10 is one too short, one of 11 holds it
    q, cache, rows, prefix, words, scale, v = attention_inputs(L=10)
    with pytest.raises(ValueError, match="exceeds the cache length"):
        reference.mla_tree_attention(q, cache, rows, prefix, words, scale, v)
    q, cache, rows, prefix, words, scale, v = attention_inputs(L=11)
    reference.mla_tree_attention(q, cache, rows, prefix, words, scale, v)


@pytest.mark.parametrize("bad", ["row past the cache", "negative row", "negative prefix"])
def test_cache_ops_refuse_rows_and_prefixes_outside_the_cache(bad):
    """The references raised IndexError for a row past the cache and wrapped a negative row or prefix
    around (writing another row); the CUDA glue kernel writes there unchecked: a ValueError, every op."""
    import test_glue_ops

    q, cache, rows, prefix, words, scale, v = attention_inputs()
    g = test_glue_ops.inputs()
    R = g["cache"].shape[0]
    if bad == "row past the cache":
        rows, g["rows"] = torch.full_like(rows, cache.shape[0]), torch.full_like(g["rows"], R)
    elif bad == "negative row":
        rows, g["rows"] = torch.full_like(rows, -1), torch.full_like(g["rows"], -1)
    else:
        prefix, g["prefix_lens"] = torch.full_like(prefix, -2), torch.full_like(g["prefix_lens"], -2)
    with pytest.raises(ValueError, match="mla_tree_attention: prefix_lens .* or a row is outside"):
        torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, scale, v)
    with pytest.raises(ValueError, match="k26.mla_glue: prefix_lens .* or a row is outside"):
        torch.ops.k26.mla_glue(**g)
    latent = torch.randn(*g["kv_a"].shape[:2], g["cache"].shape[2])
    with pytest.raises(ValueError, match="mla_write_cache: prefix_lens .* or a row is outside"):
        torch.ops.k26.mla_write_cache(g["cache"], latent, g["rows"], g["prefix_lens"])


@pytest.mark.parametrize("v_dim", [0, 41])
def test_a_value_width_beyond_the_keys_is_refused_by_the_op_and_its_fake(v_dim):
    """v_dim 41 on 40-wide keys: the reference gave 40 values, the fake promised 41 (0: none at all)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, cache, rows, prefix, words, scale, _ = attention_inputs()
    with pytest.raises(ValueError, match=f"v_dim={v_dim} must lie in \\(0, 40\\]"):
        torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, scale, v_dim)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=f"v_dim={v_dim}"):
        fq, fc, fr, fp, fw = (mode.from_tensor(t) for t in (q, cache, rows, prefix, words))
        torch.ops.k26.mla_tree_attention(fq, fc, fr, fp, fw, scale, v_dim)


def test_the_attention_reference_path_runs_the_cuda_paths_shape_checks():
    """On the CPU wrong mask words or a narrower cache were errors from inside torch (the checks ran only
    before the kernel)."""
    q, cache, rows, prefix, words, scale, v = attention_inputs()
    with pytest.raises(ValueError, match="mask_words must be int64"):
        torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words[..., :0], scale, v)
    with pytest.raises(ValueError, match="cache must be \\[rows, max_len, 40\\]"):
        torch.ops.k26.mla_tree_attention(q, cache[..., :30], rows, prefix, words, scale, v)


# -- DDTree builder ---------------------------------------------------------------------------------
def tree_inputs(B=2, L=4, V=50, budget=12, seed=2):
    lp = torch.log_softmax(torch.randn(B, L, V, generator=torch.Generator().manual_seed(seed)) * 2, -1)
    return (*lp.topk(min(budget, V), dim=-1), budget)


@pytest.mark.parametrize("shape", [(2, 4, 50, 12), (1, 1, 7, 3), (3, 6, 5, 40)])
def test_ddtree_opcheck(shape):
    """Schema, fake (output shapes / dtypes for compile and capture) and reference agree; (3, 6, 5, 40)
    has fewer prefixes than the budget, so the outputs carry padding."""
    B, L, V, budget = shape
    torch.library.opcheck(
        torch.ops.k26.ddtree_build.default,
        tree_inputs(B, L, V, budget),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_ddtree_fake_has_the_reference_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    lp, tok, budget = tree_inputs(B=3, L=5, V=90, budget=70)  # 71 nodes: two ancestor words per node
    real = torch.ops.k26.ddtree_build(lp, tok, budget)
    with FakeTensorMode() as mode:
        fake = torch.ops.k26.ddtree_build(mode.from_tensor(lp), mode.from_tensor(tok), budget)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    assert real[4].shape == (3, 71, 2)


@pytest.mark.parametrize(
    "args, needle",
    [
        (lambda lp, tok: (lp, tok, 0), "budget=0"),
        (lambda lp, tok: (lp[0], tok[0], 4), "lp must be floating"),
        (lambda lp, tok: (lp.long(), tok, 4), "lp must be floating"),
        (lambda lp, tok: (lp, tok[:, :2], 4), "tok must be integer"),
        (lambda lp, tok: (lp, tok.float(), 4), "tok must be integer"),
        (lambda lp, tok: (lp, tok.to("meta"), 4), "tok is on meta"),
        (lambda lp, tok: (lp[:, :0], tok[:, :0], 4), "lp needs at least one depth"),
    ],
)
def test_ddtree_front_door_names_the_argument(args, needle):
    lp, tok, _ = tree_inputs()
    with pytest.raises(ValueError, match=f"ddtree_build: {needle}"):
        torch.ops.k26.ddtree_build(*args(lp, tok))


@pytest.mark.parametrize(
    "budget, K, width", [(1, 1, 1), (12, 12, 12), (31, 8, 31), (255, 255, 200), (40, 5, 3)]
)
def test_ddtree_admissible_children_made_on_the_device_match_the_rule(budget, K, width):
    """The reference's candidate children, made from tensors (graph-safe), are exactly the (i, j) with
    (i+1)(j+1) <= budget, i < width, j < K, parent-major."""
    pi, pj = reference_tree._admissible(budget, K, width, "cpu")
    want = [(i, j) for i in range(min(budget, width)) for j in range(K) if (i + 1) * (j + 1) <= budget]
    assert list(zip(pi.tolist(), pj.tolist())) == want


def test_kernel_variant_defines_key_the_library_and_refuse_other_flags(monkeypatch):
    from k26.ops import build

    monkeypatch.delenv("K26_OPS_DEFINES", raising=False)
    base = build.library_path()
    monkeypatch.setenv("K26_OPS_DEFINES", "-DK26_ATTN_BF16_PARTIALS -DK26_ATTN_WIDE_ROWS=256")
    assert build.defines() == ["-DK26_ATTN_BF16_PARTIALS", "-DK26_ATTN_WIDE_ROWS=256"]
    assert build.library_path() != base  # a variant never loads where the default library is expected
    monkeypatch.setenv("K26_OPS_DEFINES", "-DK26_X -O0")
    with pytest.raises(build.BuildError, match="-O0"):
        build.defines()
    monkeypatch.setenv("K26_OPS_DEFINES", "")
    assert build.library_path() == base


def test_a_read_only_install_builds_its_library_in_the_users_cache(monkeypatch, tmp_path):
    """A wheel in a read-only site-packages caches the library under the user's cache directory; a writable
    package keeps it beside the sources; K26_OPS_BUILD wins over both."""
    from k26.ops import build

    monkeypatch.delenv("K26_OPS_BUILD", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pkg = tmp_path / "site-packages" / "k26" / "ops"
    pkg.mkdir(parents=True)
    assert build.default_build_dir(pkg) == pkg / "_build"
    monkeypatch.setattr(build.os, "access", lambda path, mode: False)  # (root may write anywhere)
    assert build.default_build_dir(pkg) == tmp_path / "cache" / "k26" / "ops"
    monkeypatch.setenv("K26_OPS_BUILD", str(tmp_path / "mine"))
    assert build.default_build_dir(pkg) == tmp_path / "mine"


def test_a_read_only_install_loads_the_library_built_beside_its_sources(monkeypatch, tmp_path):
    """(A diff review: a read-only install whose library was built when installed rebuilt it per user in
    ~/.cache, needing nvcc and minutes.)"""
    from k26.ops import build

    monkeypatch.delenv("K26_OPS_LIB", raising=False)
    monkeypatch.setattr(build, "BUILD_DIR", tmp_path / "cache")  # (the user's cache: nothing built there)
    shipped = Path(build.__file__).parent / "_build" / build.library_path().name
    made = not shipped.exists()
    shipped.parent.mkdir(exist_ok=True)
    shipped.touch()
    loaded = []
    monkeypatch.setattr(build.ctypes, "CDLL", lambda path: loaded.append(path))
    monkeypatch.setattr(build, "build", lambda **kw: pytest.fail("rebuilt"))
    build.library.cache_clear()
    try:
        build.library()
    finally:
        build.library.cache_clear()
        if made:
            shipped.unlink()
    assert loaded == [str(shipped)]


def test_a_checked_forward_lets_its_ops_skip_only_the_same_unchanged_spans(monkeypatch):
    """Inside `spans_checked` an op's check of the same tensors is skipped (no second device sync); other
    tensors, a tensor written in place, another span length or a cache of other rows are checked again."""
    cache, rows, prefix = torch.zeros(3, 16, 8), torch.tensor([0, 1]), torch.tensor([2, 3])
    calls = []
    real = reference.spans_bad
    monkeypatch.setattr(reference, "spans_bad", lambda *a: calls.append(a) or real(*a))
    with reference.spans_checked("forward", cache, rows, prefix, 4):
        reference.check_cache_span("op", cache, rows, prefix, 4)
        assert len(calls) == 1  # the forward's own check only
        reference.check_cache_span("op", cache, rows, prefix, 5)
        reference.check_cache_span("op", torch.zeros(4, 16, 8), rows, prefix, 4)
        assert len(calls) == 3
        with pytest.raises(ValueError, match="op: prefix_lens"):
            reference.check_cache_span("op", cache, rows, torch.tensor([2, 13]), 4)
        prefix[1] = 13  # in place: the checked key no longer holds
        with pytest.raises(ValueError, match="op: prefix_lens"):
            reference.check_cache_span("op", cache, rows, prefix, 4)
    prefix[1] = 3
    reference.check_cache_span("op", cache, rows, prefix, 4)  # after the block: checked again
    assert len(calls) == 6


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda a: a.__setitem__(7, torch.full_like(a[7], -1)), "topk_ids holds -1, outside"),
        (lambda a: a.__setitem__(7, torch.full_like(a[7], 4)), "topk_ids holds 4, outside"),
        (lambda a: a.__setitem__(7, a[7][:3]), "topk_ids must be integer"),
        (lambda a: a.__setitem__(8, a[8][:, :1]), "topk_weights must be float"),
        (lambda a: a.__setitem__(0, a[0][:, :32]), "gate_packed holds D=64, x has D=32"),
        (lambda a: a.__setitem__(3, a[3][:3]), "up_packed must be"),
        (lambda a: a.__setitem__(6, a[6][..., :1].expand(*a[6].shape[:2], 3)), "down_scale must be"),
    ],
)
def test_moe_w4a16_names_a_bad_argument_before_any_work(edit, needle):
    """The reference-only op checked nothing: expert id -1 ran expert E - 1, an id of E was an IndexError
    from inside torch, a short ids tensor broadcast."""
    args = list(moe_inputs())
    edit(args)
    with pytest.raises(ValueError, match=f"moe_w4a16: {needle}"):
        torch.ops.k26.moe_w4a16(*args)


@pytest.mark.parametrize(
    "latent, rows, needle",
    [
        ((1, 4, 8), [2, 0], r"latent must be \[B=2, N, 8\]"),  # was broadcast over both rows
        ((2, 4, 1), [2, 0], r"latent must be \[B=2, N, 8\]"),  # was broadcast over the width
        ((2, 4, 7), [2, 0], r"latent must be \[B=2, N, 8\]"),  # was a RuntimeError from torch
        ((2, 4, 8), [[2], [0]], "rows must be integer"),
    ],
)
def test_write_cache_names_a_latent_or_rows_of_the_wrong_shape(latent, rows, needle):
    cache = torch.zeros(3, 12, 8)
    with pytest.raises(ValueError, match=f"mla_write_cache: {needle}"):
        torch.ops.k26.mla_write_cache(cache, torch.randn(*latent), torch.tensor(rows), torch.tensor([3, 8]))
    assert not cache.any()


@pytest.mark.parametrize(
    "shapes, needle",
    [
        (((3, 8), (1, 8), (8,)), r"residual \[1, 8\] must have x's shape"),  # was broadcast over the rows
        (((3, 8), (3, 8), (7,)), r"weight must be \[8\]"),  # was a RuntimeError from inside torch
        (((4,), (4,), (1, 4)), r"weight must be \[4\]"),  # its fake said [4] where the op gave [1, 4]
    ],
)
def test_add_rmsnorm_and_its_fake_name_a_bad_shape(shapes, needle):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, residual, weight = (torch.randn(*s).bfloat16() for s in shapes)
    with pytest.raises(ValueError, match=f"k26.add_rmsnorm: {needle}"):
        torch.ops.k26.add_rmsnorm(x, residual, weight, 1e-6)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=f"k26.add_rmsnorm: {needle}"):
        torch.ops.k26.add_rmsnorm(*(mode.from_tensor(t) for t in (x, residual, weight)), 1e-6)


def test_attention_of_an_empty_batch_is_empty_unless_static_too():
    """The reference's live length took max() of no lengths (a RuntimeError) where the fake and the kernel
    return empty outputs."""
    q, cache, rows, prefix, words, scale, v = attention_inputs()
    for static in (False, True):
        out, lse = torch.ops.k26.mla_tree_attention(
            q[:0], cache, rows[:0], prefix[:0], words[:0], scale, v, static
        )
        assert out.shape == (0, *q.shape[1:3], v) and lse.shape == (0, *q.shape[1:3])
