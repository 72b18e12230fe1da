"""The fused INT4 MoE kernel's weight layout and the load-time repack into it (csrc/moe_w4a16.cu).

Per expert, 16-row tiles x 64-wide k chunks x 32 lanes x 4 int32 words, each lane's 16 bytes being exactly
its mma A fragments for four k-steps; scales one bf16 per (row, group of 32) as 16 words per chunk, word
2g + group holding rows g and g+8 (lane (g, t) reads word 2g + t // 2: no scale byte read twice from
memory). gate/up share tiles: rows 0..7 gate, rows 8..15 up of the same 8 features, so silu(gate)·up
happens in the GEMM's registers. `unrepack` inverts it (the op's reference reads the repacked weights).
"""

from __future__ import annotations

import torch

# Lane (g, t), word j, pair i, half h -> row in tile and k in chunk (csrc/moe_w4a16.cu header).
_g, _t, _j, _i, _h = torch.meshgrid(*(torch.arange(n) for n in (8, 4, 4, 4, 2)), indexing="ij")
_ROW = _g + 8 * (_i % 2)
_K = 16 * _t + 4 * _j + 2 * (_i // 2) + _h
_SHIFT = (4 * (torch.arange(4)[:, None] + 4 * torch.arange(2)[None, :])).long()  # [i, h]


def w13_row_order(inter: int) -> torch.Tensor:
    """Row r of the stacked [gate; up] matrix that tile row (rt, r16) holds."""
    rt = torch.arange(inter // 8)[:, None]
    r = torch.arange(16)[None, :]
    return torch.where(r < 8, 8 * rt + r, inter + 8 * rt + r - 8).flatten()


def _scale_pairs(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Tile rows g and g+8 of the scales, [E, RT, 8, K/32] each -> [E, RT, K/64, 16, 2] bf16: word 2g + group
    of a chunk holds (row g, row g+8) of that group."""
    E, RT, _, K32 = lo.shape

    def words(s):  # [E, RT, 8, KC, 2 groups] -> [E, RT, KC, g, group]
        return s.unflatten(3, (K32 // 2, 2)).permute(0, 1, 3, 2, 4)

    return torch.stack([words(lo), words(hi)], dim=-1).reshape(E, RT, K32 // 2, 16, 2).to(torch.bfloat16)


def repack_scales(scale: torch.Tensor, row_order: torch.Tensor | None = None) -> torch.Tensor:
    """[E, R, K/32] -> [E, R/16, K/64, 16, 2]: word 2g + group of a chunk holds rows (g, g+8) of that
    group (lane (g, t) reads word 2g + t // 2)."""
    E, R, K32 = scale.shape
    if row_order is not None:
        scale = scale[:, row_order.to(scale.device)]
    sg = scale.view(E, R // 16, 2, 8, K32)
    return _scale_pairs(sg[:, :, 0], sg[:, :, 1])


# int32 elements of one expert chunk in `_repack_words`: bounds the temporaries (a few times this, int32).
_CHUNK_ELEMS = 1 << 24


def _repack_words(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Tile rows g and g+8 of the packed words, int32 [E, RT, 8, K/8] each -> [E, RT, K/64, 32, 4] int32.

    The repack only moves nibbles (the uint4b8 codes are kept as stored), so it works on the int32 words:
    word (g, t, j) of a chunk takes the 16-bit half j % 2 of source word 2t + j // 2 of rows g and g+8,
    nibbles 0..3 of row g going to nibbles 0, 4, 2, 6 and those of row g+8 to 1, 5, 3, 7 (pair i, half h
    at nibble i + 4h; csrc/moe_w4a16.cu). A few elementwise ops per expert chunk, on the weights' device.
    """
    E, RT, _, K8 = lo.shape
    KC = K8 // 8
    out = torch.empty(E, RT, KC, 8, 4, 4, dtype=torch.int32, device=lo.device)  # [.., g, t, j]
    step = max(1, _CHUNK_ELEMS // max(1, RT * 8 * K8))

    def spread(rows: torch.Tensor, half: int) -> torch.Tensor:  # nibbles 0..3 of a half -> 0, 16, 8, 24
        x = rows.unflatten(-1, (KC, 4, 2))  # [e, RT, g, KC, t, j // 2]
        x = x >> 16 if half else x
        return (x & 0x0F0F) | ((x & 0xF0F0) << 12)

    for e0 in range(0, E, step):
        sl = slice(e0, min(E, e0 + step))
        for half in range(2):
            w = spread(lo[sl], half) | (spread(hi[sl], half) << 4)  # int32 wraps the top nibble into the sign
            out[sl, ..., half::2] = w.permute(0, 1, 3, 2, 4, 5)
    return out.view(E, RT, KC, 32, 4)


def repack(packed: torch.Tensor, scale: torch.Tensor, row_order: torch.Tensor | None = None):
    """compressed-tensors [E, R, K/8] int32 + [E, R, K/32] bf16 -> kernel layout (words, scale pairs)."""
    E, R, K8 = packed.shape
    K = K8 * 8
    if R % 16 or K % 64:
        raise ValueError(f"repack: rows {R} must be a multiple of 16 and K {K} of 64")
    if packed.dtype != torch.int32:
        raise TypeError(f"repack: expected int32 words, got {packed.dtype}")
    if row_order is not None:
        packed = packed[:, row_order.to(packed.device)]
    pw = packed.view(E, R // 16, 2, 8, K8)
    return _repack_words(pw[:, :, 0], pw[:, :, 1]), repack_scales(scale, row_order)


def unrepack(words: torch.Tensor, pairs: torch.Tensor, row_order: torch.Tensor | None = None):
    """Inverse of `repack`: int8 codes [E, R, K] and bf16 scales [E, R, K/32]."""
    E, RT, KC = words.shape[:3]
    dev = words.device
    nib = (words.view(E, RT, KC, 8, 4, 4)[..., None, None].long() >> _SHIFT.to(dev)) & 0xF
    tiles = torch.empty(E, RT, KC, 16, 64, dtype=torch.int64, device=dev)
    tiles[..., _ROW.to(dev), _K.to(dev)] = nib
    q = (tiles.permute(0, 1, 3, 2, 4).reshape(E, RT * 16, KC * 64) - 8).to(torch.int8)
    p = pairs.view(E, RT, KC, 8, 2, 2)  # [.., g, group, (row g, row g + 8)]
    s = torch.cat([p[..., 0], p[..., 1]], dim=3)  # [E, RT, KC, 16 rows, 2 groups]
    s = s.permute(0, 1, 3, 2, 4).reshape(E, RT * 16, KC * 2)
    if row_order is not None:
        inv = torch.argsort(row_order.to(dev))
        q, s = q[:, inv], s[:, inv]
    return q, s


def repack_experts(gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale):
    """The layer's experts in the kernel layout; w13 tiles hold 8 gate rows then the same 8 up rows
    (`w13_row_order`), read straight from gate and up without concatenating them."""
    E, inter, K8 = gate_packed.shape
    if inter % 8:
        raise ValueError(f"repack_experts: intermediate size {inter} must be a multiple of 8")
    if K8 % 8:
        raise ValueError(f"repack_experts: hidden size {K8 * 8} must be a multiple of 64")
    w13 = _repack_words(gate_packed.view(E, inter // 8, 8, K8), up_packed.view(E, inter // 8, 8, K8))
    K32 = gate_scale.shape[-1]
    s13 = _scale_pairs(gate_scale.reshape(E, inter // 8, 8, K32), up_scale.reshape(E, inter // 8, 8, K32))
    w2, s2 = repack(down_packed, down_scale)
    return w13, s13, w2, s2
