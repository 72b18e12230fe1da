"""Frozen configuration of a DFlash drafter directory (the public Kimi-K2.5/K2.6 DFlash format):
config.json with Qwen3 fields, `block_size` and `dflash_config` {target_layer_ids, mask_token_id}."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .config import ModelConfig
from .config_fields import ConfigError, Fields, expect, read_config_json
from .config_rope import RopeConfig, parse_rope, yarn_mscale


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    rope: RopeConfig
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    # The public Kimi drafters were trained with the legacy YaRN attention factor 0.1·ln(f) + 1 on cos
    # and sin; "config" reads rope_scaling as current transformers does (RopeConfig.hf_attention_factor:
    # 1.0 for Kimi's mscale = mscale_all_dim = 1).
    rope_attention_factor: Literal["legacy", "config"] = "legacy"
    # The layer count of the target it was trained against (DFlash's config states it), when given
    num_target_layers: int | None = None

    @property
    def attention_factor(self) -> float:
        r = self.rope
        if not r.is_yarn:
            return 1.0
        if self.rope_attention_factor == "legacy":
            return yarn_mscale(r.factor, 1.0)
        return r.hf_attention_factor  # (an explicit attention_factor applies at any factor, as transformers')

    @classmethod
    def from_dir(cls, path: str | Path, **overrides: Any) -> DrafterConfig:
        return cls.from_dict(read_config_json(path, "drafter"), **overrides)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], **overrides: Any) -> DrafterConfig:
        f = Fields(raw, "drafter ")
        dc = raw.get("dflash_config")
        if not isinstance(dc, dict):
            raise ConfigError("drafter config.json has no 'dflash_config' object: not a DFlash drafter")
        if "candidate_selector" in raw or "candidate_selector" in dc:
            raise ConfigError(
                "drafter config.json describes DFlash2 (candidate_selector), which is a different model"
            )
        expect(f, "hidden_act", "silu")
        expect(f, "attention_bias", False)
        ids = dc.get("target_layer_ids")
        if not isinstance(ids, list) or not ids or not all(_id(i) for i in ids):
            raise ConfigError(
                f"drafter dflash_config.target_layer_ids={ids!r}: expected a non-empty list of layer ids"
            )
        if list(ids) != sorted(set(ids)):
            raise ConfigError(f"drafter dflash_config.target_layer_ids={ids!r} must be strictly increasing")
        mask = dc.get("mask_token_id")
        if not _id(mask):
            raise ConfigError(f"drafter dflash_config.mask_token_id={mask!r}: expected a token id")
        block = raw.get("block_size", dc.get("block_size"))
        if not _id(block) or block < 2:
            raise ConfigError(f"drafter block_size={block!r}: expected an integer >= 2")
        heads = f.int("num_attention_heads")
        hidden = f.int("hidden_size")
        cfg = cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", default=heads),
            head_dim=f.int("head_dim", default=hidden // heads),
            num_hidden_layers=f.int("num_hidden_layers"),
            intermediate_size=f.int("intermediate_size"),
            rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
            vocab_size=f.int("vocab_size"),
            max_position_embeddings=f.int("max_position_embeddings"),
            rope=parse_rope(f, "drafter "),
            block_size=block,
            target_layer_ids=tuple(ids),
            mask_token_id=mask,
            num_target_layers=f.int("num_target_layers")
            if raw.get("num_target_layers") is not None
            else None,
        )
        if overrides:
            from dataclasses import replace

            cfg = replace(cfg, **overrides)
        if cfg.head_dim % 2:  # (the rotary half-split: model/rope.py, model/drafter.py)
            raise ConfigError(
                f"drafter head_dim={cfg.head_dim}: RoPE rotates pairs of dimensions; it must be even"
            )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(
                f"drafter num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        if cfg.rope_attention_factor not in ("legacy", "config"):
            raise ConfigError(
                f"drafter rope_attention_factor={cfg.rope_attention_factor!r}: 'legacy' or 'config'"
            )
        return cfg

    def check_target(self, target: ModelConfig) -> None:
        """Every way the drafter cannot serve this target, as one error naming the fields."""
        bad = []
        if self.hidden_size != target.hidden_size:
            bad.append(f"hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            bad.append(f"vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        n = self.num_target_layers
        if n is not None and n != target.num_hidden_layers:  # (a drafter trained for another target)
            bad.append(f"num_target_layers {n} != target num_hidden_layers {target.num_hidden_layers}")
        beyond = [i for i in self.target_layer_ids if i >= target.num_hidden_layers]
        if beyond:
            bad.append(f"target_layer_ids {beyond} beyond the target's {target.num_hidden_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            bad.append(
                f"mask_token_id {self.mask_token_id} outside the target vocabulary [0, {target.vocab_size})"
            )
        if bad:
            raise ConfigError("drafter does not match the target: " + "; ".join(bad))


def _id(x: Any) -> bool:
    """A non-negative integer (a JSON true is not one)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
