"""The one rule the front doors use to hand a kernel a tensor its 16-byte loads (cp.async, vector loads) can
read: contiguous, starting at a 16-byte aligned address."""

from __future__ import annotations

import torch


def packed(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is contiguous at a 16-byte aligned address, else a copy that is (`.contiguous()` alone
    keeps a contiguous view at an odd offset)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
