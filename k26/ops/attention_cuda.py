"""Front door of the MLA tree-attention CUDA kernel (csrc/mla_tree_attn.cu) for
`torch.ops.k26.mla_tree_attention`: input checks before launch, the split count, the workspace.

The kernel serves K2's absorbed shape (576-wide latent keys, 512-wide values, bf16). Other shapes and
dtypes (the tiny test models, float32 scoring) run the op's pure-torch reference on the same device.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import reference

DQK, DV = 576, 512
MAX_NEW_TOKENS = 256  # 4 ancestor words per row: the largest verify bucket the kernel is built for
BLOCK_ROWS = 32


def num_splits(batch: int, rows: int, device: torch.device) -> int:
    """Prefix splits so batch 1 fills the GPU: about two blocks per SM; fixed by shapes, so per bucket."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = math.ceil(rows / BLOCK_ROWS) * batch
    return max(1, min(256, math.ceil(2 * sms / tiles)))


def check_inputs(q, cache, rows, prefix_lens, mask_words, v_dim) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"mla_tree_attention: {msg}")

    need(q.dim() == 4, f"q must be [B, N, H, C], got {list(q.shape)}")
    B, N, H, C = q.shape
    need(cache.dim() == 3 and cache.shape[2] == C, f"cache must be [rows, max_len, {C}], got {list(cache.shape)}")
    need(cache.dtype == q.dtype, f"cache dtype {cache.dtype} differs from q's {q.dtype}")
    need(0 < v_dim <= C, f"v_dim={v_dim} must lie in (0, {C}]")
    need(rows.shape == (B,) and prefix_lens.shape == (B,), f"rows and prefix_lens must be [B={B}]")
    need(not rows.is_floating_point() and not prefix_lens.is_floating_point(), "rows and prefix_lens must be integers")
    need(mask_words.shape == (B, N, (N + 63) // 64) and mask_words.dtype == torch.int64,
         f"mask_words must be int64 [{B}, {N}, {(N + 63) // 64}], got {mask_words.dtype} {list(mask_words.shape)}")
    for name, t in (("cache", cache), ("rows", rows), ("prefix_lens", prefix_lens), ("mask_words", mask_words)):
        need(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")


@torch.library.register_kernel("k26::mla_tree_attention", "cuda")
def _(q, cache, rows, prefix_lens, mask_words, scale, v_dim):
    from .build import available, library  # lazily: `python -m k26.ops.build` must not import itself first

    check_inputs(q, cache, rows, prefix_lens, mask_words, v_dim)
    B, N, H, C = q.shape
    if q.dtype != torch.bfloat16 or C != DQK or v_dim != DV or not available():
        return reference.mla_tree_attention(q, cache, rows, prefix_lens, mask_words, scale, v_dim)
    if N > MAX_NEW_TOKENS:
        raise ValueError(f"mla_tree_attention: N={N} new tokens exceeds the kernel's maximum {MAX_NEW_TOKENS}")
    rows64, prefix64 = rows.to(torch.int64).contiguous(), prefix_lens.to(torch.int64).contiguous()
    if not torch.cuda.is_current_stream_capturing():
        # Inside a graph the kernel clamps reads to the cache row; outside it we can afford to refuse.
        if bool((prefix64 + N > cache.shape[1]).any()) or bool(((rows64 < 0) | (rows64 >= cache.shape[0])).any()):
            raise ValueError(
                f"mla_tree_attention: prefix_lens + {N} exceeds the cache length {cache.shape[1]} or a row is "
                f"outside [0, {cache.shape[0]})"
            )
    qc, cc, words = q.contiguous(), cache.contiguous(), mask_words.contiguous()
    out = torch.empty(B, N, H, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, N, H, dtype=torch.float32, device=q.device)
    lib = library()
    S = num_splits(B, N * H, q.device)
    ws = torch.empty(lib.k26_mla_tree_attn_workspace(B, N, H, S), dtype=torch.uint8, device=q.device)
    err = lib.k26_mla_tree_attn(
        qc.data_ptr(), cc.data_ptr(), rows64.data_ptr(), prefix64.data_ptr(), words.data_ptr(), out.data_ptr(),
        lse.data_ptr(), ws.data_ptr(), B, N, H, words.shape[2], cache.shape[1], S, ctypes.c_float(scale),
        torch.cuda.current_stream(q.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"mla_tree_attention: CUDA launch failed with error {err}")
    return out, lse
