"""Frozen configuration built from a checkpoint directory's `config.json`.

Accepts the three shapes Kimi checkpoints come in: `kimi_k2` / `deepseek_v3` at the top level
(K2, K2-Thinking) and `kimi_k25` with the language model nested under `text_config` (K2.5, K2.6).
Anything k26 cannot run exactly is refused here, naming the field, before a byte of weights is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .config_fields import ConfigError, Fields, expect, read_config_json
from .config_quant import QuantConfig, check_quant_scope, parse_quant
from .config_rope import RopeConfig, parse_rope, yarn_mscale

_TOP_MODEL_TYPES = ("kimi_k2", "deepseek_v3", "kimi_k25")
_TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    quant: QuantConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # q_a/kv_a norms: "config" uses rms_norm_eps (SGLang/vLLM), "hf_default" uses 1e-6 (HF, DSv3-ref).
    latent_norm_eps_mode: Literal["config", "hf_default"] = "config"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: normalised c_kv followed by roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_norm_eps(self) -> float:
        return self.rms_norm_eps if self.latent_norm_eps_mode == "config" else 1e-6

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.is_yarn and r.mscale_all_dim and r.factor > 1:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def check_tp(self, world: int) -> None:
        """Every dimension TP splits must divide by `world`, and int4 groups must stay whole."""
        if not isinstance(world, int) or world < 1:
            raise ConfigError(f"tensor-parallel size {world!r}: expected a positive integer")
        bad = [
            f"{name}={getattr(self, name)}"
            for name in ("num_attention_heads", "intermediate_size", "moe_intermediate_size", "vocab_size")
            if getattr(self, name) % world
        ]
        if self.quant.int4 and not bad and (self.moe_intermediate_size // world) % self.quant.group_size:
            bad.append(
                f"moe_intermediate_size={self.moe_intermediate_size} (/{world} splits an int4 group of "
                f"{self.quant.group_size})"
            )
        if bad:
            raise ConfigError(f"tensor-parallel size {world} does not divide {', '.join(bad)}")

    def replace(self, **changes: Any) -> ModelConfig:
        from dataclasses import replace

        return replace(self, **changes)

    @classmethod
    def from_dir(cls, path: str | Path, **overrides: Any) -> ModelConfig:
        return cls.from_dict(read_config_json(path, "checkpoint"), **overrides)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], **overrides: Any) -> ModelConfig:
        top_type = raw.get("model_type")
        if top_type not in _TOP_MODEL_TYPES:  # (none: it said "model_type None is not supported")
            said = f"model_type {top_type!r} is not supported" if top_type else "config.json lacks model_type"
            raise ConfigError(f"{said}; expected one of {_TOP_MODEL_TYPES}")
        if top_type == "kimi_k25":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("model_type 'kimi_k25' needs a 'text_config' object with the LM fields")
            if text.get("model_type", "deepseek_v3") not in _TEXT_MODEL_TYPES:
                raise ConfigError(
                    f"text_config.model_type {text.get('model_type')!r} is not supported; "
                    f"expected one of {_TEXT_MODEL_TYPES}"
                )
            prefix = "text_config."
        else:
            text, prefix = raw, ""
        f = Fields(text, prefix)

        expect(f, "hidden_act", "silu")
        expect(f, "scoring_func", "sigmoid")
        expect(f, "topk_method", "noaux_tc")
        expect(f, "attention_bias", False)
        expect(f, "tie_word_embeddings", False)
        expect(f, "moe_layer_freq", 1)
        # (false, and null too — transformers tests its truth — rotate (x[i], x[i + P/2]) pairs there)
        if "rope_interleave" in f.d and not f.d["rope_interleave"]:
            raise ConfigError(
                f"{prefix}rope_interleave={f.d['rope_interleave']!r} is not supported; k26 implements True"
            )
        if f.get("q_lora_rank") is None:
            raise ConfigError(f"{prefix}q_lora_rank is null: models without a q LoRA are not supported")
        nextn = f.get("num_nextn_predict_layers", 0) or 0
        if nextn:
            raise ConfigError(f"{prefix}num_nextn_predict_layers={nextn}: MTP layers are not supported")

        # The quantization block may sit at the top, inside text_config, or both (K2.5/K2.6).
        qraw = text.get("quantization_config", raw.get("quantization_config"))
        quant = parse_quant(qraw, prefix if "quantization_config" in text else "")
        rope = parse_rope(f, prefix, target=True)

        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        cfg = cls(
            model_type=top_type,
            vocab_size=f.int("vocab_size"),
            hidden_size=f.int("hidden_size"),
            intermediate_size=f.int("intermediate_size"),
            moe_intermediate_size=f.int("moe_intermediate_size"),
            num_hidden_layers=f.int("num_hidden_layers"),
            num_attention_heads=f.int("num_attention_heads"),
            q_lora_rank=f.int("q_lora_rank"),
            kv_lora_rank=f.int("kv_lora_rank"),
            qk_nope_head_dim=f.int("qk_nope_head_dim"),
            qk_rope_head_dim=f.int("qk_rope_head_dim"),
            v_head_dim=f.int("v_head_dim"),
            n_routed_experts=f.int("n_routed_experts"),
            n_shared_experts=f.int("n_shared_experts", minimum=0),
            num_experts_per_tok=f.int("num_experts_per_tok"),
            # Routing fields required: a config without them means different routings to different readers
            # (transformers' DeepseekV3Config: n_group 8, topk_group 4, routed_scaling_factor 2.5,
            # first_k_dense_replace 3; DeepSeek's reference configuration_deepseek.py: norm_topk_prob false,
            # routed_scaling_factor 1.0, first_k_dense_replace 0); every Kimi / DeepSeek-V3 release sets them.
            n_group=f.int("n_group"),
            topk_group=f.int("topk_group"),
            routed_scaling_factor=f.float("routed_scaling_factor"),
            norm_topk_prob=f.bool("norm_topk_prob"),
            first_k_dense_replace=f.int("first_k_dense_replace", minimum=0),
            rms_norm_eps=f.float("rms_norm_eps"),
            max_position_embeddings=f.int("max_position_embeddings"),
            rope=rope,
            quant=quant,
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
        )
        if overrides:
            cfg = cfg.replace(**overrides)
        cfg.validate(prefix)
        _check_quant_blocks(raw, text, prefix, cfg)
        return cfg

    def validate(self, prefix: str = "") -> None:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(f"{prefix}{field}={getattr(self, field)!r}: {why}")

        if self.num_experts_per_tok > self.n_routed_experts:
            raise bad("num_experts_per_tok", f"exceeds n_routed_experts={self.n_routed_experts}")
        if self.n_routed_experts % self.n_group:
            raise bad("n_group", f"does not divide n_routed_experts={self.n_routed_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise bad("topk_group", f"must lie in [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise bad("n_group", "group-limited routing needs at least 2 experts per group")
        if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
            raise bad(
                "topk_group",
                f"its groups hold fewer experts than num_experts_per_tok={self.num_experts_per_tok}",
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise bad("first_k_dense_replace", f"exceeds num_hidden_layers={self.num_hidden_layers}")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", "RoPE rotates pairs; it must be even")
        if not math.isclose(self.rope.attention_factor, 1.0, rel_tol=1e-9):
            r = self.rope
            raise ConfigError(
                f"{prefix}rope_scaling: YaRN's cos / sin multiplier mscale(factor, mscale) / mscale(factor, "
                f"mscale_all_dim) is {r.attention_factor:.6g} (factor={r.factor}, mscale_all_dim="
                f"{r.mscale_all_dim}); k26 implements only 1 (mscale equal to mscale_all_dim, as in every "
                "Kimi / DeepSeek-V3 config)"
            )
        if self.latent_norm_eps_mode not in ("config", "hf_default"):
            raise bad("latent_norm_eps_mode", "expected 'config' or 'hf_default'")
        if self.quant.int4:
            g = self.quant.group_size
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % g:
                    raise bad(name, f"int4 experts need a multiple of the group size {g}")

        def token_id(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < self.vocab_size + 2

        if self.bos_token_id is not None and not token_id(self.bos_token_id):
            raise bad("bos_token_id", "outside the vocabulary")
        if not all(map(token_id, self.eos_token_ids)):  # (config.json's eos_token_id: an id or a list of ids)
            raise ConfigError(
                f"{prefix}eos_token_id={list(self.eos_token_ids)!r}: expected a token id or a list of token "
                "ids in the vocabulary"
            )


def _check_quant_blocks(raw: dict[str, Any], text: dict[str, Any], prefix: str, cfg: ModelConfig) -> None:
    """The block k26 reads (text_config's, else the top level's) must quantize exactly the routed experts
    (`check_quant_scope`). A second one at the top level may differ in bytes (K2.6 reportedly also ignores
    its vision tower there; metadata) but must describe the same text model: engines differ in which one
    they read, so the other must not silently say something else."""
    key = "quantization_config"
    q, where = (text[key], prefix) if key in text else (raw.get(key), "")
    read = parse_quant(q, where)
    layers, dense, shared = cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.n_shared_experts > 0
    if read.int4:
        check_quant_scope(q, where, layers, dense, shared)
    if text is raw or key not in text or key not in raw or raw[key] == text[key]:
        return
    try:
        top = parse_quant(raw[key], "")
        if top.int4:
            check_quant_scope(raw[key], "", layers, dense, shared)
    except ConfigError as e:
        raise ConfigError(f"{key} (top level) and {prefix}{key} disagree: {e}") from e
    if top != read:
        said = {"none": "no quantized weights", "int4": "int4 routed experts"}
        raise ConfigError(
            f"{key} (top level) and {prefix}{key} disagree: the top level says {said[top.kind]}, "
            f"{prefix}{key} {said[read.kind]}; make them equal, or keep only one"
        )


# Kimi K2.6's text_config as released (real dimensions; quantization_config left to the caller).
K26_TEXT_CONFIG = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "num_nextn_predict_layers": 0,
    "model_type": "kimi_k2",
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
