"""Front door of the MLA tree-attention CUDA kernel (csrc/mla_tree_attn_kernel.cuh; host side
csrc/mla_tree_attn.cu) for `torch.ops.k26.mla_tree_attention`: input checks before launch, the split count,
the workspace.

The kernel serves K2's absorbed shape (576-wide latent keys, 512-wide values, bf16). Other shapes and
dtypes (the tiny test models, float32 scoring) run the op's pure-torch reference on the same device.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging

import torch

from . import pdl, reference
from .log import say_once

DQK, DV = 576, 512
MAX_NEW_TOKENS = 256  # 4 ancestor words per row: the largest verify bucket the kernel is built for
# Keys per split at least: below this a split's fixed cost (Q load, pipeline fill, partial write and its
# share of the merge) outweighs the bandwidth another SM adds. Tuned on an H200 (bench_tree_attn.py --tune).
MIN_SPLIT_KEYS = 64


def min_split_keys(tile_rows: int) -> int:
    """Keys a split takes at least for a kernel tile of `tile_rows` query rows. A split's merge cost grows
    with its rows, its streaming work with its keys: the minimum scales with the rows (16, 32). The 64-row
    wide tile (an A/B side, -DK26_ATTN_WIDE) covers twice the rows a block: with the plain minimum a short
    context fills the same wave as the 32-row tile (N = 16 at 4K: 2 x 65 blocks of 64 keys, 4 x 33 of 128)."""
    return MIN_SPLIT_KEYS * (tile_rows // 16 if tile_rows <= 32 else 1)


class _Plans:
    """Per (device, B, N, H) launch plan, computed once: the splits per row tile from the kernel's
    occupancy and the SM count (one wave), and the workspace holding the merge barriers' state (zeroed once
    at allocation; the kernel keeps it consistent across calls and graph replays)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, int] = {}
        self._workspaces: dict[tuple, torch.Tensor] = {}

    def plan(self, lib, device: torch.device, B: int, N: int, H: int) -> int:
        key = (device, B, N, H)
        if key not in self._plans:
            splits = ctypes.c_int()
            with torch.cuda.device(device):
                err = lib.k26_mla_tree_attn_plan(B, N, H, ctypes.byref(splits))
            if err:
                raise RuntimeError(f"mla_tree_attention: launch planning failed with CUDA error {err}")
            self._plans[key] = splits.value
        return self._plans[key]

    def workspace(self, lib, device: torch.device, B: int, N: int, H: int, S: int) -> torch.Tensor:
        key = (device, B, N, H, S)
        ws = self._workspaces.get(key)
        if ws is None:
            size = lib.k26_mla_tree_attn_workspace(B, N, H, S)
            ws = torch.empty(size, dtype=torch.uint8, device=device)
            ws[: lib.k26_mla_tree_attn_counter_bytes(B, N, H, S)].zero_()
            if torch.cuda.is_current_stream_capturing():
                return ws  # owned by the graph's pool (its zeroing is captured too): never cached
            self._workspaces[key] = ws
        return ws


PLANS = _Plans()


def _bind(lib) -> None:
    """ctypes signatures of the kernel's entry points (set once per loaded library)."""
    if getattr(lib, "_k26_attn_bound", False):
        return
    for name in ("k26_mla_tree_attn_workspace", "k26_mla_tree_attn_counter_bytes"):
        getattr(lib, name).restype = ctypes.c_size_t
        getattr(lib, name).argtypes = [ctypes.c_int] * 4
    lib.k26_mla_tree_attn_tile_rows.restype = ctypes.c_int
    lib.k26_mla_tree_attn_tile_rows.argtypes = [ctypes.c_int] * 2
    lib.k26_mla_merge_uv_defers_verify.restype = ctypes.c_int
    lib.k26_mla_merge_uv_defers_verify.argtypes = []
    lib.k26_mla_tree_attn_plan.restype = ctypes.c_int
    lib.k26_mla_tree_attn_plan.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.k26_mla_tree_attn.restype = ctypes.c_int
    ints = [ctypes.c_int] * 7  # B, N, H, W, max_len, S, min_keys
    # q_pe, pe_ld, positions, inv_freq
    rotary = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p]
    lib.k26_mla_tree_attn.argtypes = (
        [ctypes.c_void_p] * 8 + ints + [ctypes.c_float] + rotary + [ctypes.c_int] * 2 + [ctypes.c_void_p]
    )
    lib.k26_mla_merge_uv.restype = ctypes.c_int
    lib.k26_mla_merge_uv.argtypes = (
        [ctypes.c_void_p] * 4
        + [ctypes.c_longlong] * 2
        + [ctypes.c_void_p]
        + [ctypes.c_int] * 10
        + [ctypes.c_void_p]
    )
    lib._k26_attn_bound = True


def check_inputs(
    q, cache, rows, prefix_lens, mask_words, v_dim, q_pe=None, positions=None, inv_freq=None
) -> int:
    """Every shape / dtype / device problem as a ValueError naming the argument; returns the key width
    (q's, plus q_pe's when the query comes split)."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"mla_tree_attention: {msg}")

    need(q.dim() == 4, f"q must be [B, N, H, C], got {list(q.shape)}")
    B, N, H, C = q.shape
    need(
        (q_pe is None) == (positions is None) == (inv_freq is None),
        "q_pe, positions and inv_freq come together (the query's rotary part, its positions and frequencies)",
    )
    if q_pe is not None:
        need(
            q_pe.dim() == 4 and q_pe.shape[:3] == q.shape[:3] and q_pe.shape[3] % 2 == 0,
            f"q_pe must be [{B}, {N}, {H}, P] with P even, got {list(q_pe.shape)}",
        )
        need(q_pe.dtype == q.dtype, f"q_pe dtype {q_pe.dtype} differs from q's {q.dtype}")
        need(
            positions.shape == (B, N) and not positions.is_floating_point(),
            f"positions must be integer [{B}, {N}], got {positions.dtype} {list(positions.shape)}",
        )
        need(
            inv_freq.shape == (q_pe.shape[3] // 2,) and inv_freq.dtype == torch.float32,
            f"inv_freq must be float32 [{q_pe.shape[3] // 2}], got {inv_freq.dtype} {list(inv_freq.shape)}",
        )
        for name, t in (("q_pe", q_pe), ("positions", positions), ("inv_freq", inv_freq)):
            need(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
        C += q_pe.shape[3]
    need(
        cache.dim() == 3 and cache.shape[2] == C,
        f"cache must be [rows, max_len, {C}], got {list(cache.shape)}",
    )
    need(cache.dtype == q.dtype, f"cache dtype {cache.dtype} differs from q's {q.dtype}")
    need(0 < v_dim <= C, f"v_dim={v_dim} must lie in (0, {C}]")
    need(rows.shape == (B,) and prefix_lens.shape == (B,), f"rows and prefix_lens must be [B={B}]")
    need(
        not rows.is_floating_point() and not prefix_lens.is_floating_point(),
        "rows and prefix_lens must be integers",
    )
    need(
        mask_words.shape == (B, N, (N + 63) // 64) and mask_words.dtype == torch.int64,
        f"mask_words must be int64 [{B}, {N}, {(N + 63) // 64}], "
        f"got {mask_words.dtype} {list(mask_words.shape)}",
    )
    for name, t in (
        ("cache", cache),
        ("rows", rows),
        ("prefix_lens", prefix_lens),
        ("mask_words", mask_words),
    ):
        need(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
    return C


def _unsupported(q, C: int, v_dim: int, q_pe) -> str | None:
    """Why the kernel does not serve these shapes (None: it does). It holds K2's MLA: bf16, 576-wide keys,
    512-wide values, a rotary query part of 64 beside 512."""
    if q.dtype != torch.bfloat16:
        return f"dtype {q.dtype}"
    if C != DQK or v_dim != DV:
        return f"key width {C} / value width {v_dim} (not {DQK} / {DV})"
    if q_pe is not None and q.shape[3] != DV:
        return f"a rotary query of {q.shape[3]} + {q_pe.shape[3]} (not {DV} + {DQK - DV})"
    if q.shape[1] > MAX_NEW_TOKENS:  # (the engine's prefill chunks stay within it: checks.check_prefill)
        return f"{q.shape[1]} new tokens a sequence (the kernel takes up to {MAX_NEW_TOKENS})"
    return None


def library_bound():
    """The kernel library with this module's ctypes signatures set."""
    from .build import library  # lazily: `python -m k26.ops.build` must not import itself first

    lib = library()
    _bind(lib)
    return lib


def fallback_reason(q, C: int, v_dim: int, q_pe) -> str | None:
    """Why these inputs run the reference (None: the kernel takes them)."""
    from .build import available  # lazily: `python -m k26.ops.build` must not import itself first

    return _unsupported(q, C, v_dim, q_pe) or (None if available() else "no kernel library")


@torch.library.register_kernel("k26::mla_tree_attention", "cuda")
def _(
    q,
    cache,
    rows,
    prefix_lens,
    mask_words,
    scale,
    v_dim,
    static=False,
    q_pe=None,
    positions=None,
    inv_freq=None,
):
    C = check_inputs(q, cache, rows, prefix_lens, mask_words, v_dim, q_pe, positions, inv_freq)
    B, N, H, _ = q.shape
    if (why := fallback_reason(q, C, v_dim, q_pe)) is not None:
        say_once(__name__, logging.INFO, f"k26.mla_tree_attention: {why} runs the reference")
        return reference.mla_tree_attention(
            q, cache, rows, prefix_lens, mask_words, scale, v_dim, static, q_pe, positions, inv_freq
        )
    if B * N * H == 0:  # nothing to attend (the launch plan divides by the row tiles)
        return q.new_empty(B, N, H, DV), q.new_empty(B, N, H, dtype=torch.float32)
    launch = attend(q, cache, rows, prefix_lens, mask_words, scale, q_pe, positions, inv_freq, 0)
    return launch.out, launch.lse


@dataclasses.dataclass
class _Launch:
    """One attention launch: its outputs, and what the merging W_UV launch after it needs."""

    out: torch.Tensor
    lse: torch.Tensor
    workspace: torch.Tensor
    prefix: torch.Tensor  # int64, what the kernel read
    splits: int
    min_keys: int


def attend(
    q, cache, rows, prefix_lens, mask_words, scale, q_pe, positions, inv_freq, defer_max: int, out=None
) -> _Launch:
    """Launch the kernel on checked, served inputs (at least one query row); `defer_max`: the split counts up
    to which it leaves the merge to W_UV's kernel (attention_uv_cuda; 0: none); `out`: the output buffer
    (tests: a poisoned one shows which sequences the kernel left unmerged), else a new one."""
    B, N, H, _ = q.shape
    rows64, prefix64 = rows.to(torch.int64).contiguous(), prefix_lens.to(torch.int64).contiguous()
    # Inside a graph the kernel clamps reads to the cache row; outside it we can afford to refuse.
    reference.check_cache_span("mla_tree_attention", cache, rows64, prefix64, N)
    qc, cc, words = q.contiguous(), cache.contiguous(), mask_words.contiguous()
    pe_ptr, pe_ld, pos_ptr, freq_ptr = None, 0, None, None
    if q_pe is not None:  # rows pe_ld apart: a view into the q_b projection's output is read in place
        s = q_pe.stride()
        if s[3] != 1 or s[2] % 8 or s[1] != H * s[2] or s[0] != N * H * s[2] or q_pe.data_ptr() % 16:
            q_pe = q_pe.contiguous()
        pos64, freq = positions.to(torch.int64).contiguous(), inv_freq.contiguous()
        pe_ptr, pe_ld, pos_ptr, freq_ptr = q_pe.data_ptr(), q_pe.stride(2), pos64.data_ptr(), freq.data_ptr()
    out = torch.empty(B, N, H, DV, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(B, N, H, dtype=torch.float32, device=q.device)
    # Under PDL the kernel reads rows, prefix_lens and the prefix keys before its grid-dependency wait.
    early_ok = pdl.enabled_as_given((rows64, rows), (prefix64, prefix_lens), (cc, cache))
    lib = library_bound()
    S = PLANS.plan(lib, q.device, B, N, H)
    ws = PLANS.workspace(lib, q.device, B, N, H, S)
    min_keys = min_split_keys(lib.k26_mla_tree_attn_tile_rows(N, H))
    err = lib.k26_mla_tree_attn(
        qc.data_ptr(),
        cc.data_ptr(),
        rows64.data_ptr(),
        prefix64.data_ptr(),
        words.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        ws.data_ptr(),
        B,
        N,
        H,
        words.shape[2],
        cache.shape[1],
        S,
        min_keys,
        ctypes.c_float(scale),
        pe_ptr,
        pe_ld,
        pos_ptr,
        freq_ptr,
        defer_max,
        int(early_ok),
        torch.cuda.current_stream(q.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"mla_tree_attention: CUDA launch failed with error {err}")
    return _Launch(out, lse, ws, prefix64, S, min_keys)
