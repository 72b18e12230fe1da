"""Input checks of the ops whose only implementation is their reference (`moe_w4a16`, `mla_write_cache`):
every shape / dtype / device problem a ValueError naming the argument, before any work — torch would
otherwise broadcast a wrong latent over the batch or index expert -1 as the last one."""

from __future__ import annotations

import torch

from .moe_cuda import check_ids


def _need(op: str, cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {msg}")


def check_moe_w4a16(x, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, ids, weights):
    """The compressed-tensors layout stacked over E experts: gate / up int32 [E, I, D/8] with scales
    [E, I, D/G], down int32 [E, D, I/8] with scales [E, D, I/G]; x [T, D] float; ids / weights [T, K]."""
    op = "moe_w4a16"
    _need(
        op, x.dim() == 2 and x.is_floating_point(), f"x must be float [T, D], got {x.dtype} {list(x.shape)}"
    )
    T, D = x.shape
    for name, w in (("gate_packed", gate_packed), ("up_packed", up_packed), ("down_packed", down_packed)):
        _need(
            op,
            w.dim() == 3 and w.dtype == torch.int32,
            f"{name} must be int32 3-D, got {w.dtype} {list(w.shape)}",
        )
    E, I = gate_packed.shape[0], gate_packed.shape[1]
    _need(op, gate_packed.shape[2] * 8 == D, f"gate_packed holds D={gate_packed.shape[2] * 8}, x has D={D}")
    _need(op, up_packed.shape == gate_packed.shape, f"up_packed must be {list(gate_packed.shape)}")
    _need(op, down_packed.shape == (E, D, I // 8), f"down_packed must be {[E, D, I // 8]}")
    for name, s, w in (
        ("gate_scale", gate_scale, gate_packed),
        ("up_scale", up_scale, up_packed),
        ("down_scale", down_scale, down_packed),
    ):
        cols = w.shape[2] * 8
        ok = s.dim() == 3 and s.shape[:2] == w.shape[:2] and s.shape[2] > 0 and cols % s.shape[2] == 0
        _need(
            op,
            ok and s.is_floating_point(),
            f"{name} must be float {[*w.shape[:2], 'groups']} dividing {cols}",
        )
    _need(
        op,
        ids.dim() == 2 and ids.shape[0] == T and not ids.is_floating_point() and ids.dtype != torch.bool,
        f"topk_ids must be integer [T={T}, K], got {ids.dtype} {list(ids.shape)}",
    )
    _need(
        op,
        weights.shape == ids.shape and weights.is_floating_point(),
        f"topk_weights must be float {list(ids.shape)}",
    )
    tensors = (gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, ids, weights)
    _need(op, all(t.device == x.device for t in tensors), f"every input must be on x's device {x.device}")
    check_ids(ids, E, op)


def check_write_cache(cache, latent, rows, prefix_lens) -> None:
    """cache [R, L, C]; latent [B, N, C] floating point (stored in the cache's dtype); rows / prefix_lens
    integer [B]; one device."""
    op = "mla_write_cache"
    _need(op, cache.dim() == 3, f"cache must be [rows, length, width], got {list(cache.shape)}")
    _need(
        op,
        rows.dim() == 1 and not rows.is_floating_point() and rows.dtype != torch.bool,
        f"rows must be integer [B], got {rows.dtype} {list(rows.shape)}",
    )
    B = rows.shape[0]
    _need(
        op,
        prefix_lens.shape == (B,) and not prefix_lens.is_floating_point() and prefix_lens.dtype != torch.bool,
        f"prefix_lens must be integer [B={B}], got {prefix_lens.dtype} {list(prefix_lens.shape)}",
    )
    _need(
        op,
        latent.dim() == 3 and latent.shape[0] == B and latent.shape[2] == cache.shape[2],
        f"latent must be [B={B}, N, {cache.shape[2]}], got {list(latent.shape)}",
    )
    _need(op, latent.is_floating_point(), f"latent must be floating point, got {latent.dtype}")
    _need(
        op,
        all(t.device == cache.device for t in (latent, rows, prefix_lens)),
        f"every input must be on the cache's device {cache.device}",
    )
