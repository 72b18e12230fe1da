"""`torch.ops.k26.drafter_attention` on CPU: its reference is the drafter's former composition (gather the
live context rows, concatenate the block, GQA softmax), it reads a cache view in place, slots past a
sequence's context never matter, schema and fake agree (opcheck), and bad inputs are named."""

import pytest
import torch

from k26.ops import reference


def case(B=2, S=8, Hq=8, Hkv=2, hd=64, T=40, lens=(0, 33), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ck = torch.randn(B + 2, T, Hkv, hd, generator=g).to(dtype)
    cv = torch.randn(B + 2, T, Hkv, hd, generator=g).to(dtype)
    q = torch.randn(B, S, Hq, hd, generator=g).to(dtype)
    kb = torch.randn(B, S, Hkv, hd, generator=g).to(dtype)
    vb = torch.randn(B, S, Hkv, hd, generator=g).to(dtype)
    rows = torch.randperm(B + 2, generator=g)[:B]
    return q, ck, cv, kb, vb, rows, torch.tensor(lens)


def former(q, ck, cv, kb, vb, rows, lens, scale):
    """The drafter's attention before the op (DrafterAttention.forward of 2026-12-01), written out."""
    B, S, Hq, _ = q.shape
    keys = int(lens.max())
    vis = torch.arange(keys)[None, :] < lens[:, None]
    k = torch.cat([ck[rows, :keys], kb], 1)
    v = torch.cat([cv[rows, :keys], vb], 1)
    rep = Hq // ck.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    visible = torch.cat([vis, vis.new_ones(B, S)], dim=1)[:, None]
    s = torch.einsum("bshd,blhd->bhsl", q.float(), k.float()) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhsl,blhd->bshd", torch.softmax(s, dim=-1).to(v.dtype), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_the_former_composition(dtype):
    args = case(dtype=dtype, lens=(17, 40))
    got = torch.ops.k26.drafter_attention(*args, 0.125)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), former(*args, 0.125).float(), atol=tol)


def test_slots_past_the_context_never_matter():
    q, ck, cv, kb, vb, rows, lens = case(lens=(5, 21))
    want = torch.ops.k26.drafter_attention(q, ck, cv, kb, vb, rows, lens, 0.125)
    for b, r in enumerate(rows.tolist()):
        ck[r, lens[b] :] = float("nan")
        cv[r, lens[b] :] = float("nan")
    got = torch.ops.k26.drafter_attention(q, ck, cv, kb, vb, rows, lens, 0.125)
    assert torch.equal(got, want)


def test_context_longer_than_the_cache_is_clamped_and_a_view_is_read_in_place():
    q, ck, cv, kb, vb, rows, _ = case(T=40)
    view_k, view_v = ck[:, :30], cv[:, :30]
    got = torch.ops.k26.drafter_attention(q, view_k, view_v, kb, vb, rows, torch.tensor([30, 99]), 0.125)
    want = reference.drafter_attention(
        q, view_k.contiguous(), view_v.contiguous(), kb, vb, rows, torch.tensor([30, 30]), 0.125
    )
    assert torch.equal(got, want)


def test_empty_context_attends_the_block_only():
    q, ck, cv, kb, vb, rows, _ = case(lens=(0, 0))
    got = torch.ops.k26.drafter_attention(q, ck, cv, kb, vb, rows, torch.tensor([0, 0]), 0.125)
    want = reference.gqa_attention(q, kb, vb, torch.ones(2, 1, 8, dtype=torch.bool), 0.125)
    assert torch.allclose(got, want, atol=1e-6)  # same terms; the masked slots change the summation order


def test_drafter_attention_opcheck():
    op = torch.ops.k26.drafter_attention.default
    torch.library.opcheck(op, (*case(), 0.125), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda a: a.__setitem__(0, a[0][..., :3]), "q"),
        (lambda a: a.__setitem__(1, torch.zeros(4, 40, 4, 64)), "not a multiple"),
        (lambda a: a.__setitem__(2, a[2][:, :5]), "cache_v"),
        (lambda a: a.__setitem__(3, a[3][:, :2]), "k_blk"),
        (lambda a: a.__setitem__(4, a[4].double()), "v_blk"),
        (lambda a: a.__setitem__(5, a[5][:1]), "rows"),
        (lambda a: a.__setitem__(6, a[6].float()), "int32 or int64"),
        (lambda a: a.__setitem__(5, a[5].bool()), "int32 or int64"),
        # a row outside the cache: IndexError, or (negative) another row read, on the CPU path before
        (lambda a: a.__setitem__(5, torch.full_like(a[5], a[1].shape[0])), "a row is outside the cache"),
        (lambda a: a.__setitem__(5, torch.full_like(a[5], -1)), "a row is outside the cache"),
        (lambda a: [a.__setitem__(i, a[i].long()) for i in range(5)], "q must be floating point"),
    ],
)
def test_bad_inputs_are_named(edit, match):
    args = list(case(Hq=6, Hkv=2))
    edit(args)
    with pytest.raises(ValueError, match=match):
        torch.ops.k26.drafter_attention(*args, 0.125)


def test_block_kv_views_into_a_stacked_projection_are_read_in_place():
    """The front door hands the kernel a view of the stacked qkv output as it is (its token stride), and
    copies only what the kernel cannot read (heads not packed, an odd offset)."""
    from k26.ops.drafter_attn_cuda import _block_tokens

    qkv = torch.zeros(2, 8, (8 + 2) * 64)
    v = qkv[..., 9 * 64 :].view(2, 8, 1, 64)
    same, ld = _block_tokens(v)
    assert same.data_ptr() == v.data_ptr() and ld == 10 * 64
    packed = torch.zeros(2, 8, 2, 64)
    assert _block_tokens(packed)[1] == 128
    odd = torch.zeros(2 * 8 * 2 * 64 + 1)[1:].view(2, 8, 2, 64)
    copy, ld = _block_tokens(odd)
    assert copy.data_ptr() % 16 == 0 and ld == 128 and torch.equal(copy, odd)
    heads_apart = torch.zeros(2, 2, 8, 64).transpose(1, 2)
    copy, ld = _block_tokens(heads_apart)
    assert copy.is_contiguous() and ld == 128


def test_the_fakes_refuse_what_the_ops_refuse():
    """A meta tensor among CPU inputs dispatches to the op's fake, which checked nothing: an argument on
    another device passed (and a wrong shape, under torch.compile). drafter_attention, linear, mla_glue."""
    import test_glue_ops

    args = list(case())
    args[5] = args[5].to("meta")
    with pytest.raises(ValueError, match="drafter_attention: rows is on meta"):
        torch.ops.k26.drafter_attention(*args, 0.125)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="k26.linear: weight is on meta"):
        torch.ops.k26.linear(x, w.to("meta"))
    with pytest.raises(ValueError, match="k26.linear_grouped: x ends in"):
        torch.ops.k26.linear_grouped(torch.randn(3, 2, 8).to("meta"), torch.randn(2, 4, 7).to("meta"))
    g = test_glue_ops.inputs()
    g["rows"] = g["rows"][:1].to("meta")
    with pytest.raises(ValueError, match="k26.mla_glue: rows must be"):
        torch.ops.k26.mla_glue(**g)


@pytest.mark.parametrize("past_the_end", [False, True])
def test_the_cuda_door_refuses_a_row_outside_the_cache_before_its_reference_fallback(past_the_end):
    """A float32 drafter runs the reference from the CUDA door: a row outside the cache is refused there
    too (the reference read row R - 1 for row -1)."""
    from k26.ops.drafter_attn_cuda import cuda_drafter_attention

    args = [t.float() if t.is_floating_point() else t for t in case(Hq=6, Hkv=2)]
    args[5] = torch.full_like(args[5], args[1].shape[0] if past_the_end else -1)
    with pytest.raises(ValueError, match="a row is outside the cache"):
        cuda_drafter_attention(*args, 0.125)
