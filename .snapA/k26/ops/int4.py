"""The compressed-tensors `pack-quantized` int4 format, in plain torch.

Codes q in [-8, 7] are stored offset by 8 (GPTQ's uint4b8), eight per int32 along the input dim,
element 8j+k in bits 4k..4k+3 (LSB first). One scale per 32 consecutive input columns, symmetric.
"""

from __future__ import annotations

import torch

PACK = 8  # int4 values per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int codes [..., in] in [-8, 7] -> int32 words [..., in/8]."""
    if q.shape[-1] % PACK:
        raise ValueError(f"pack_int4: last dim {q.shape[-1]} is not a multiple of {PACK}")
    u = (q.to(torch.int32) + 8).reshape(*q.shape[:-1], -1, PACK)
    # Sum of disjoint bit fields == OR; int32 wraps the top nibble into the sign bit as intended.
    return (u << _SHIFTS.to(u.device)).sum(-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., in/8] -> int8 codes [..., in] in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_int4: expected int32 words, got {packed.dtype}")
    nib = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF
    return (nib - 8).to(torch.int8).reshape(*packed.shape[:-1], -1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W[o, i] = q[o, i] * s[o, i // group], rounded once to the scale's dtype as compressed-tensors
    decompresses it (bf16 for Kimi), then widened to `dtype` if asked (a float32 model sees bf16 weights)."""
    q = unpack_int4(packed).to(torch.float32)
    group = q.shape[-1] // scale.shape[-1]
    s = scale.to(torch.float32).repeat_interleave(group, dim=-1)
    return (q * s).to(scale.dtype).to(dtype)


def quantize_int4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group quantisation as Moonshot's QAT does it: s = absmax / 7, q = clamp(round(w/s))."""
    if w.shape[-1] % group:
        raise ValueError(f"quantize_int4: last dim {w.shape[-1]} is not a multiple of group {group}")
    wg = w.float().reshape(*w.shape[:-1], -1, group)
    scale = (wg.abs().amax(-1) / 7).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(wg / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return pack_int4(q.reshape(w.shape)), scale
