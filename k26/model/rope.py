"""YaRN rotary embedding as Kimi/DeepSeek-V3 use it: interleaved pairs (x[2i], x[2i+1]) rotated in place.

The cos/sin multiplier get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) is 1.0 for every Kimi
config, so it is not applied (a target config where it is not 1 is refused: `ModelConfig.validate`); the
YaRN mscale lives in the softmax scale instead (config.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config_rope import RopeConfig
from ..ops.reference import rope


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """fp64 inverse frequencies [dim/2], exactly the HF-remote / vLLM / DSv3-ref formula."""
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    base_freq = rope.theta ** (-i / dim)
    if not rope.is_yarn or rope.factor == 1.0:
        return base_freq

    def corr(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low = max(math.floor(corr(rope.beta_fast)), 0)
    high = min(math.ceil(corr(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    # The ramp runs over dim/2 entries while corr() uses dim: that is how every reference does it.
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return base_freq * (1 - ramp) + (base_freq / rope.factor) * ramp


class Rope(nn.Module):
    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        self.cfg, self.dim = rope, dim
        self.register_buffer("inv_freq", yarn_inv_freq(rope, dim).float(), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute after the model moves off the meta device."""
        self.inv_freq = yarn_inv_freq(self.cfg, self.dim).float().to(self.inv_freq.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., dim] with positions broadcastable to x.shape[:-1] (heads dim added by the caller)."""
        return rope(x, positions, self.inv_freq)
