"""`torch.ops.k26.mla_tree_attention_uv` on the CPU: its schema and fake (opcheck), its reference as each
head's W_UV applied to the attention's output, its input checks, and when the CUDA front door merges in W_UV's
kernel (the kernel itself: tests/test_attention_uv_gpu.py)."""

import pytest
import torch

from k26.ops import attention_uv_cuda, causal_words, reference


def uv_inputs(rotary=False):
    """Three heads of 40-wide keys (the last 4 rotary when `rotary`), 32-wide values, W_UV [3, 8, 32]."""
    g = torch.Generator().manual_seed(1)
    B, N, H, C, L = 2, 5, 3, 40, 16
    cache = torch.randn(4, L, C, generator=g)
    q = torch.randn(B, N, H, C, generator=g)
    w_uv = torch.randn(H, 8, 32, generator=g)
    prefix = torch.tensor([6, 3])
    head = (cache, torch.tensor([2, 0]), prefix, causal_words(B, N, "cpu"), 0.3, w_uv)
    if not rotary:
        return (q, *head)
    positions = prefix[:, None] + torch.arange(N)
    return (q[..., :-4], *head, False, q[..., -4:], positions, torch.rand(2, generator=g))


@pytest.mark.parametrize("rotary", [False, True], ids=["whole_query", "rotary_query"])
def test_attention_uv_opcheck(rotary):
    torch.library.opcheck(
        torch.ops.k26.mla_tree_attention_uv.default,
        uv_inputs(rotary),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("rotary", [False, True], ids=["whole_query", "rotary_query"])
def test_each_heads_w_uv_applies_to_the_attention_output(rotary):
    args = uv_inputs(rotary)
    q, cache, rows, prefix, words, scale, w_uv, *rot = args
    y = torch.ops.k26.mla_tree_attention_uv(*args)
    o, _ = torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, scale, w_uv.shape[2], *rot)
    B, N, H, V = y.shape
    assert (B, N, H, V) == (2, 5, 3, 8)
    for b in range(B):
        for n in range(N):
            for h in range(H):
                assert torch.allclose(y[b, n, h], w_uv[h] @ o[b, n, h], rtol=1e-5, atol=1e-5)
    assert y.abs().sum() > 0


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {6: a[6][0]}, r"mla_tree_attention_uv: w_uv must be \[H, V, latent\]"),
        (lambda a: {6: a[6][:2]}, "mla_tree_attention_uv: w_uv has 2 heads, q 3"),
        (lambda a: {6: a[6].double()}, "mla_tree_attention_uv: w_uv dtype torch.float64 differs"),
        (lambda a: {6: torch.randn(3, 8, 41)}, r"_uv: w_uv's latent width 41 must lie in \(0, 40\]"),
        (lambda a: {6: a[6].to("meta")}, "mla_tree_attention_uv: w_uv is on meta, q on cpu"),
        (lambda a: {3: a[3][:1]}, r"mla_tree_attention_uv: rows and prefix_lens must be \[B=2\]"),
    ],
    ids=["two_dims", "heads", "dtype", "latent_width", "device", "prefix"],
)
def test_bad_inputs_are_named(change, match):
    args = list(uv_inputs())
    for i, v in change(args).items():
        args[i] = v
    with pytest.raises(ValueError, match=match):
        torch.ops.k26.mla_tree_attention_uv(*args)


def test_w_uvs_kernel_merges_only_one_row_tile_a_sequence_and_small_batches():
    w, why = torch.zeros(8, 128, 512), attention_uv_cuda._merge_unsupported
    decode = attention_uv_cuda.DECODE  # the default library's bounds
    assert why(w, 1, 1, 8, decode) is None  # TP8 decode
    assert why(w, 1, 2, 8, decode) is None  # 16 rows: still one tile
    assert why(torch.zeros(16, 128, 512), 1, 1, 16, decode) is None  # TP4 decode
    assert why(w, 8, 1, 8, decode) is None  # 64 rows a batch
    assert "3 x 8 query rows a sequence" in why(w, 1, 3, 8, decode)
    assert "1 x 64 query rows" in why(torch.zeros(64, 128, 512), 1, 1, 64, decode)
    assert "9 x 1 x 8 query rows a batch" in why(w, 9, 1, 8, decode)
    assert "100 value rows" in why(torch.zeros(8, 100, 512), 1, 1, 8, decode)


def test_a_verify_deferring_library_merges_up_to_the_tp8_verify_tree():
    w, why = torch.zeros(8, 128, 512), attention_uv_cuda._merge_unsupported
    verify = attention_uv_cuda.VERIFY  # a library built with -DK26_ATTN_DEFER_VERIFY
    assert why(w, 1, 1, 8, verify) is None
    assert why(w, 1, 3, 8, verify) is None  # two 16-row tiles
    assert why(w, 1, 16, 8, verify) is None  # the TP8 verify tree: four 32-row tiles
    assert why(w, 16, 1, 8, verify) is None  # 128 rows a batch
    assert "17 x 8 query rows a sequence" in why(w, 1, 17, 8, verify)
    assert "1 x 256 query rows" in why(torch.zeros(256, 128, 512), 1, 1, 256, verify)
    assert "17 x 1 x 8 query rows a batch" in why(w, 17, 1, 8, verify)
    # W_UV's blocks take 32 value rows up to 32 query rows a batch, 128 beyond: 96 fits only the first
    assert why(torch.zeros(8, 96, 512), 4, 1, 8, verify) is None
    assert "96 value rows" in why(torch.zeros(8, 96, 512), 1, 16, 8, verify)


def test_reference_is_the_attention_then_the_value_projection():
    """The reference composes the two references (the specification the kernel pair is held to)."""
    q, cache, rows, prefix, words, scale, w_uv = uv_inputs()
    o, _ = reference.mla_tree_attention(q, cache, rows, prefix, words, scale, 32)
    want = torch.stack([o[:, :, h] @ w_uv[h].T for h in range(3)], dim=2)
    got = reference.mla_tree_attention_uv(q, cache, rows, prefix, words, scale, w_uv)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
