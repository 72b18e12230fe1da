"""The vectorized int4 repack is bit-identical to the per-expert loop it replaced, on fresh random words."""

import pytest
import torch

from k26.ops import moe_layout
from k26.ops.int4 import pack_int4, unpack_int4
from k26.ops.moe_layout import (
    _K,
    _ROW,
    _SHIFT,
    repack,
    repack_experts,
    repack_scales,
    unrepack,
    w13_row_order,
)


def loop_repack(packed, scale, row_order=None):
    """The original repack (one expert at a time, int64 temporaries), kept here as the oracle."""
    E, R, K8 = packed.shape
    K = K8 * 8
    words = []
    for e in range(E):
        u = unpack_int4(packed[e]).to(torch.int64) + 8
        if row_order is not None:
            u = u[row_order]
        tiles = u.view(R // 16, 16, K // 64, 64).permute(0, 2, 1, 3)
        w = (tiles[..., _ROW, _K] << _SHIFT).sum((-1, -2))
        w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
        words.append(w.reshape(R // 16, K // 64, 32, 4))
    return torch.stack(words), repack_scales(scale, row_order)


def random_words(*shape, seed):
    """Every bit pattern, the sign bit included (a high nibble >= 8 makes the word negative)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)


def random_scales(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) + 0.01).to(torch.bfloat16)


@pytest.mark.parametrize("E,R,K", [(3, 32, 128), (5, 48, 64), (2, 16, 256)])
def test_repack_bit_identical_to_loop(E, R, K):
    p, s = random_words(E, R, K // 8, seed=E), random_scales(E, R, K // 32, seed=R)
    got, want = repack(p, s), loop_repack(p, s)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_repack_with_row_order_bit_identical_to_loop():
    p, s = random_words(4, 64, 16, seed=1), random_scales(4, 64, 4, seed=2)
    order = w13_row_order(32)
    got, want = repack(p, s, order), loop_repack(p, s, order)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_repack_experts_bit_identical_to_concatenated_loop(monkeypatch):
    monkeypatch.setattr(moe_layout, "_CHUNK_ELEMS", 700)  # several expert chunks, the last one short
    E, D, inter = 7, 128, 64
    gp, up = random_words(E, inter, D // 8, seed=3), random_words(E, inter, D // 8, seed=4)
    gs, us = random_scales(E, inter, D // 32, seed=5), random_scales(E, inter, D // 32, seed=6)
    dp, ds = random_words(E, D, inter // 8, seed=7), random_scales(E, D, inter // 32, seed=8)
    got = repack_experts(gp, gs, up, us, dp, ds)
    w13, s13 = loop_repack(torch.cat([gp, up], 1), torch.cat([gs, us], 1), w13_row_order(inter))
    w2, s2 = loop_repack(dp, ds)
    for a, b in zip(got, (w13, s13, w2, s2), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_repack_round_trips_every_bit_pattern():
    p, s = random_words(3, 32, 16, seed=9), random_scales(3, 32, 4, seed=10)
    q, s2 = unrepack(*repack(p, s))
    assert torch.equal(pack_int4(q), p)
    assert torch.equal(s2, s)


def test_repack_names_bad_shapes():
    with pytest.raises(ValueError, match="rows 24 must be a multiple of 16"):
        repack(random_words(1, 24, 8, seed=0), random_scales(1, 24, 2, seed=0))
    with pytest.raises(TypeError, match="expected int32 words"):
        repack(torch.zeros(1, 16, 8, dtype=torch.int64), random_scales(1, 16, 2, seed=0))


@pytest.mark.gpu
def test_repack_on_gpu_equals_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    E, D, inter = 6, 256, 64
    ex = [
        random_words(E, inter, D // 8, seed=11),
        random_scales(E, inter, D // 32, seed=12),
        random_words(E, inter, D // 8, seed=13),
        random_scales(E, inter, D // 32, seed=14),
        random_words(E, D, inter // 8, seed=15),
        random_scales(E, D, inter // 32, seed=16),
    ]
    cpu = repack_experts(*ex)
    gpu = repack_experts(*(t.cuda() for t in ex))
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b.cpu())
