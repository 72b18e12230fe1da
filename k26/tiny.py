"""Write a random checkpoint directory in the exact layout of the real Kimi releases.

Flavours: "k25" (K2.5/K2.6: kimi_k25 config with text_config, `language_model.` prefix, vision
tensors to skip) and "k2-thinking" (kimi_k2 at the top level, no prefix). Routed experts are int4
pack-quantized (weight_packed / weight_scale / weight_shape) or bf16 with quant="none"; the router's
correction bias is fp32, everything else bf16. Several shards plus model.safetensors.index.json, and a
small byte-level BPE tokenizer (tiktoken.model + tokenizer_config.json) with the Kimi special names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import ModelConfig
from .config_fields import read_config_json
from .drafter_config import DrafterConfig
from .ops.int4 import quantize_int4
from .tokenizer import SPECIAL_OFFSETS, save_tokenizer

DEFAULT_SIZES = {
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "max_position_embeddings": 1024,
    "original_max_position_embeddings": 256,
    "base_vocab": 384,
}

_GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


_CORPUS = (
    "Kimi K2.6 is a mixture-of-experts language model with multi-head latent attention. "
    "A speculative decoder drafts a tree of tokens; the target verifies the whole tree in one forward "
    "pass and accepts the longest path it agrees with, so the output is exactly what it would have said. "
    "def forward(self, x):\n    return self.down(silu(self.gate(x)) * self.up(x))\n"
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?\n"
)


def write_tokenizer(out: Path, base_vocab: int) -> int:
    """Train a byte-level BPE of `base_vocab` ranks; returns the first special id."""
    from tiktoken._educational import bpe_train

    return save_tokenizer(out, bpe_train(_CORPUS * 4, base_vocab, _GPT2_PAT, visualise=None))


def quantization_config() -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "block_structure": None,
                },
            }
        },
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        ],
        "kv_cache_scheme": None,
    }


def text_config(s: dict, first_special: int, quant: str) -> dict:
    vocab = first_special + 256
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": vocab,
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "moe_intermediate_size": s["moe_intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_attention_heads"],
        "q_lora_rank": s["q_lora_rank"],
        "kv_lora_rank": s["kv_lora_rank"],
        "qk_nope_head_dim": s["qk_nope_head_dim"],
        "qk_rope_head_dim": s["qk_rope_head_dim"],
        "v_head_dim": s["v_head_dim"],
        "n_routed_experts": s["n_routed_experts"],
        "n_shared_experts": s["n_shared_experts"],
        "num_experts_per_tok": s["num_experts_per_tok"],
        "n_group": s["n_group"],
        "topk_group": s["topk_group"],
        "first_k_dense_replace": s["first_k_dense_replace"],
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        # 1e-6 keeps the latent-norm eps conventions (HF vs SGLang) identical, so HF can be the oracle.
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": s["max_position_embeddings"],
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": s["max_position_embeddings"] / s["original_max_position_embeddings"],
            "original_max_position_embeddings": s["original_max_position_embeddings"],
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": first_special,
        "eos_token_id": first_special + 1,
        "initializer_range": 0.02,
    }
    if quant == "int4":
        cfg["quantization_config"] = quantization_config()
    return cfg


def random_tensors(s: dict, vocab: int, quant: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """HF-named tensors (no prefix) of a K2 text model with random weights."""

    def w(out: int, inp: int) -> torch.Tensor:
        return (torch.randn(out, inp, generator=gen) / inp**0.5).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)

    D, H = s["hidden_size"], s["num_attention_heads"]
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, D, generator=gen).to(torch.bfloat16),
        "model.norm.weight": norm(D),
        "lm_head.weight": w(vocab, D),
    }
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": norm(D),
            p + "post_attention_layernorm.weight": norm(D),
            p + "self_attn.q_a_proj.weight": w(s["q_lora_rank"], D),
            p + "self_attn.q_a_layernorm.weight": norm(s["q_lora_rank"]),
            p + "self_attn.q_b_proj.weight": w(H * qk, s["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(s["kv_lora_rank"] + s["qk_rope_head_dim"], D),
            p + "self_attn.kv_a_layernorm.weight": norm(s["kv_lora_rank"]),
            p + "self_attn.kv_b_proj.weight": w(
                H * (s["qk_nope_head_dim"] + s["v_head_dim"]), s["kv_lora_rank"]
            ),
            p + "self_attn.o_proj.weight": w(D, H * s["v_head_dim"]),
        }
        if i < s["first_k_dense_replace"]:
            F = s["intermediate_size"]
            t |= {
                p + "mlp.gate_proj.weight": w(F, D),
                p + "mlp.up_proj.weight": w(F, D),
                p + "mlp.down_proj.weight": w(D, F),
            }
            continue
        F, E = s["moe_intermediate_size"], s["n_routed_experts"]
        Fs = F * s["n_shared_experts"]
        t |= {
            p + "mlp.gate.weight": w(E, D),
            p + "mlp.gate.e_score_correction_bias": 0.05 * torch.randn(E, generator=gen),  # fp32, as shipped
            p + "mlp.shared_experts.gate_proj.weight": w(Fs, D),
            p + "mlp.shared_experts.up_proj.weight": w(Fs, D),
            p + "mlp.shared_experts.down_proj.weight": w(D, Fs),
        }
        for e in range(E):
            for proj, (o, n) in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
                name = f"{p}mlp.experts.{e}.{proj}."
                if quant == "int4":
                    packed, scale = quantize_int4(w(o, n))
                    t |= {
                        name + "weight_packed": packed,
                        name + "weight_scale": scale,
                        name + "weight_shape": torch.tensor([o, n], dtype=torch.int32),
                    }
                else:
                    t[name + "weight"] = w(o, n)
    return t


def check_tiny(*, flavour: str = "k25", quant: str = "int4", shards: int = 3, **sizes) -> dict:
    """`write_tiny_checkpoint`'s arguments checked before anything is written, each bad one a ValueError
    naming it (a size: the ConfigError of the config it makes, read as the loader reads it); all the sizes."""
    if flavour not in ("k25", "k2-thinking"):
        raise ValueError(f"flavour {flavour!r}: expected 'k25' or 'k2-thinking'")
    if quant not in ("int4", "none"):
        raise ValueError(f"quant {quant!r}: expected 'int4' or 'none'")
    unknown = set(sizes) - set(DEFAULT_SIZES)
    if unknown:
        raise ValueError(f"unknown size flags {sorted(unknown)}; known: {sorted(DEFAULT_SIZES)}")
    if shards < 1:
        raise ValueError(f"shards {shards}: a checkpoint needs at least one")
    s = DEFAULT_SIZES | sizes
    if s["base_vocab"] < 256:
        raise ValueError(f"base_vocab {s['base_vocab']}: a byte-level BPE needs at least the 256 bytes")
    # (the tokenizer's first special id, not known before it is trained, only sets vocab_size)
    ModelConfig.from_dict(text_config(s, s["base_vocab"], quant))
    return s


def write_tiny_checkpoint(
    out: str | Path, *, flavour: str = "k25", quant: str = "int4", shards: int = 3, seed: int = 0, **sizes
) -> Path:
    s = check_tiny(flavour=flavour, quant=quant, shards=shards, **sizes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    first_special = write_tokenizer(out, s["base_vocab"])
    text = text_config(s, first_special, quant)
    gen = torch.Generator().manual_seed(seed)
    tensors = random_tensors(s, text["vocab_size"], quant, gen)

    extra = {}
    if flavour == "k25":  # a text-only engine must skip these
        extra["vision_tower.patch_embed.weight"] = torch.randn(32, 3, 2, 2, generator=gen).to(torch.bfloat16)
        extra["mm_projector.proj.0.weight"] = torch.randn(text["hidden_size"], 32, generator=gen).to(
            torch.bfloat16
        )
    return save_checkpoint(out, text, tensors, flavour=flavour, shards=shards, extra=extra)


def save_checkpoint(
    out: str | Path,
    text: dict,
    tensors: dict[str, torch.Tensor],
    *,
    flavour: str = "k25",
    shards: int = 1,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """config.json (K2.5/K2.6 nesting or K2-Thinking flat), shards and index for HF-named text tensors."""
    if shards < 1:
        raise ValueError(f"shards {shards}: a checkpoint needs at least one")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    first_special = text["vocab_size"] - 256
    if flavour == "k25":
        cfg = {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "bos_token_id": first_special,
            "eos_token_id": first_special + 1,
            "pad_token_id": first_special + 255,
            "media_placeholder_token_id": first_special + 21,
            "tie_word_embeddings": False,
            "text_config": text,
            "vision_config": {"model_type": "moonvit", "num_hidden_layers": 1, "hidden_size": 32},
        }
        if "quantization_config" in text:
            cfg["quantization_config"] = text["quantization_config"]
        tensors = {"language_model." + k: v for k, v in tensors.items()} | (extra or {})
    else:
        cfg = text
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per : (i + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        for n, v in part.items():
            weight_map[n] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def tiny_drafter_config(
    target_dir: str | Path,
    *,
    layers: int = 1,
    block_size: int = 8,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 256,
    target_layer_ids: tuple[int, ...] | None = None,
) -> dict:
    """The config.json of `write_tiny_drafter` for the target at `target_dir` (as written: unchecked, so a
    test can write a bad one; `check_tiny_drafter` reads it as the loader will)."""
    tcfg = read_config_json(target_dir, "target checkpoint")
    text = tcfg.get("text_config", tcfg)
    D, L = text["hidden_size"], text["num_hidden_layers"]
    ids = list(target_layer_ids) if target_layer_ids is not None else sorted({min(1, L - 1), L - 1})
    first_special = text["vocab_size"] - 256
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": D,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": text["vocab_size"],
        "attention_bias": False,
        "max_position_embeddings": text["max_position_embeddings"],
        "rope_theta": text["rope_theta"],
        "rope_scaling": dict(text["rope_scaling"]),
        "num_target_layers": L,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": first_special + SPECIAL_OFFSETS["[UNK]"]},
        "torch_dtype": "bfloat16",
    }


def check_tiny_drafter(target_dir: str | Path, **kw) -> None:
    """`write_tiny_drafter`'s arguments as the loader will read what it writes: a ValueError (ConfigError)
    naming the bad one, before anything is written; the target's own errors start with 'target: '."""
    try:
        target = ModelConfig.from_dict(read_config_json(target_dir, "target checkpoint"))
    except ValueError as e:
        raise type(e)(f"target: {e}") from e
    DrafterConfig.from_dict(tiny_drafter_config(target_dir, **kw)).check_target(target)


def check_out_dir(out: str | Path) -> None:
    """An output directory that is a file already is refused by name (mkdir would raise FileExistsError)."""
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"OUT {str(out)!r} is a file; give a directory (new or existing)")


def write_tiny_drafter(out: str | Path, target_dir: str | Path, *, seed: int = 0, **sizes) -> Path:
    """A random DFlash drafter in the Kimi DFlash format for the tiny target at `target_dir` (`sizes`:
    `tiny_drafter_config`'s)."""
    cfg = tiny_drafter_config(target_dir, **sizes)
    layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, intermediate = cfg["head_dim"], cfg["intermediate_size"]
    D, ids = cfg["hidden_size"], cfg["dflash_config"]["target_layer_ids"]
    gen = torch.Generator().manual_seed(seed)

    def w(o: int, i: int) -> torch.Tensor:
        return (torch.randn(o, i, generator=gen) / i**0.5).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)

    t = {"fc.weight": w(D, len(ids) * D), "hidden_norm.weight": norm(D), "norm.weight": norm(D)}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": norm(D),
            p + "post_attention_layernorm.weight": norm(D),
            p + "self_attn.q_proj.weight": w(heads * head_dim, D),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, D),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, D),
            p + "self_attn.o_proj.weight": w(D, heads * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": w(intermediate, D),
            p + "mlp.up_proj.weight": w(intermediate, D),
            p + "mlp.down_proj.weight": w(D, intermediate),
        }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(
        {k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out
