"""RoPE / YaRN settings of a config.json (the target's and a drafter's): `RopeConfig`, `parse_rope`, and the
two readings of YaRN's cos / sin multiplier — DeepSeek's reference (`yarn_mscale`) and transformers'
(`hf_yarn_factor`) — with `check_hf_yarn`, which refuses a target whose fields the two read differently."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config_fields import ConfigError, Fields


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    # YaRN fields; factor == 1.0 with no original length means plain RoPE.
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # The reference YaRN's cos / sin multiplier, mscale(f, mscale) / mscale(f, mscale_all_dim)
    # (modeling_deepseek.py). k26 ropes without one: the target refuses configs where it is not 1
    # (`ModelConfig.validate`), and `parse_rope` those where transformers' differs (its attention_factor).
    attention_factor: float = 1.0
    # Transformers' multiplier for the same fields (`hf_yarn_factor`): what a drafter
    # trained with it applies (drafter_config.py, rope_attention_factor "config").
    hf_attention_factor: float = 1.0

    @property
    def is_yarn(self) -> bool:
        return self.original_max_position is not None


def parse_rope(f: Fields, prefix: str, *, target: bool = False) -> RopeConfig:
    rs = f.get("rope_scaling") or f.get("rope_parameters")
    key = "rope_scaling" if f.get("rope_scaling") else "rope_parameters"
    if rs is not None and not isinstance(rs, dict):
        raise ConfigError(f"{prefix}{key}={rs!r}: expected an object")
    theta = f.get("rope_theta", (rs or {}).get("rope_theta"))
    # (> 1: the inverse frequencies are powers of 1 / theta, and YaRN's correction range divides by log theta)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1 < theta < math.inf:
        raise ConfigError(f"{prefix}rope_theta={theta!r}: expected a finite number > 1")
    kind = None if rs is None else (rs.get("type") or rs.get("rope_type"))
    if kind is None and rs and {"factor", "original_max_position_embeddings"} & rs.keys():
        # YaRN's fields without its name: taking plain RoPE would silently change every position's angle
        raise ConfigError(
            f"{prefix}{key} has YaRN's fields but no 'type' / 'rope_type' (Kimi models: 'yarn')"
        )
    if kind in (None, "default"):
        return RopeConfig(theta=float(theta))
    if kind != "yarn":
        raise ConfigError(f"{prefix}{key}.type={kind!r} is not supported; Kimi models use 'yarn'")
    r = Fields(rs, f"{prefix}{key}.")
    if (
        r.get("truncate", True) is not True
    ):  # transformers' YaRN then skips the correction range's floor / ceil
        raise ConfigError(
            f"{prefix}{key}.truncate={r.get('truncate')!r} is not supported; k26 implements true"
        )
    factor = r.float("factor", default=None)
    orig = r.int("original_max_position_embeddings")
    mscale = r.nonnegative("mscale", default=1.0)
    mscale_all_dim = r.nonnegative("mscale_all_dim", default=0.0)
    extra = {
        "beta_fast": r.float("beta_fast", default=32.0),
        "beta_slow": r.float("beta_slow", default=1.0),
        "mscale": mscale or 1.0,  # (0: no scaling, as 1)
        "mscale_all_dim": mscale_all_dim,
        # (the reference's defaults and its mscale(f, m) = 1 for f <= 1, else 0.1·m·ln f + 1)
        "attention_factor": yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim),
        "hf_attention_factor": hf_yarn_factor(r, factor),
    }
    # The target's multiplier must be read one way (else validate names it); the drafter's rope factor is
    # its own setting (drafter_config.py: rope_attention_factor), whichever way the fields read.
    if target and math.isclose(extra["attention_factor"], 1.0, rel_tol=1e-9):
        check_hf_yarn(rs, factor, f"{prefix}{key}")
    # Transformers' generic YaRN may re-derive the factor from the two lengths; insisting on equality
    # keeps every engine computing the same frequencies.
    max_pos = f.int("max_position_embeddings")
    if not math.isclose(max_pos / orig, factor):
        raise ConfigError(
            f"{prefix}{key}.factor={factor} disagrees with max_position_embeddings / "
            f"original_max_position_embeddings = {max_pos}/{orig}"
        )
    return RopeConfig(
        theta=float(theta),
        factor=factor,
        original_max_position=orig,
        **extra,
    )


def hf_yarn_factor(r: Fields, factor: float) -> float:
    """Transformers' YaRN cos / sin multiplier (`_compute_yarn_parameters`) for the rope_scaling fields `r`:
    an explicit attention_factor, else mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set and
    non-zero, else mscale(f, 1)."""
    if r.get("attention_factor") is not None:
        return r.float("attention_factor")
    if r.get("mscale") and r.get("mscale_all_dim"):
        return yarn_mscale(factor, r.float("mscale")) / yarn_mscale(factor, r.float("mscale_all_dim"))
    return yarn_mscale(factor, 1.0)


def check_hf_yarn(rs: dict, factor: float, where: str) -> None:
    """Refuse YaRN fields on which transformers' cos / sin multiplier (`hf_yarn_factor`) differs from
    DeepSeek's reference (defaults mscale 1, mscale_all_dim 0), which `ModelConfig.validate` holds to 1: a
    checkpoint meaning two things is refused, not guessed."""
    if "attention_factor" in rs and rs["attention_factor"] is not None and rs["attention_factor"] != 1:
        raise ConfigError(f"{where}.attention_factor={rs['attention_factor']!r}: k26 implements only 1")
    if factor > 1 and not (rs.get("mscale") and rs.get("mscale_all_dim")):
        raise ConfigError(
            f"{where}: mscale={rs.get('mscale')!r}, mscale_all_dim={rs.get('mscale_all_dim')!r}: with factor "
            f"{factor} both must be set and non-zero (transformers and DeepSeek's reference default them "
            "differently, so the cos / sin multiplier would depend on the reader)"
        )


def yarn_mscale(factor: float, m: float) -> float:
    """YaRN's mscale as DeepSeek's reference computes it (yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
