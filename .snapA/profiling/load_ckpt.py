"""A full-width K2.6-layout checkpoint of a few layers for the start-up bench (profiling/bench_load.py):
layer 0 dense, the rest MoE (384 int4 experts, real dims), `language_model.` nesting, random weights
(int4 words are random bits: every pattern is a valid code), and a tokenizer of K2.6's size so that `LLM`
starts on it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from k26.load_cache import write_safetensors
from k26.tiny import text_config
from k26.tokenizer import save_tokenizer

K26 = dict(  # noqa: C408 (the config's own names)
    hidden_size=7168,
    num_hidden_layers=61,
    first_k_dense_replace=1,
    num_attention_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=384,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    max_position_embeddings=262144,
    original_max_position_embeddings=4096,
)
FIRST_SPECIAL = 163584  # vocab 163840
K26_BYTES = 594e9  # the released checkpoint


def tensor_specs(s: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, kind, shape) of every text tensor, in layer order; kind: bf16, f32, words, scale, shape."""
    D, H, V = s["hidden_size"], s["num_attention_heads"], FIRST_SPECIAL + 256
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    out = [("model.embed_tokens.weight", "bf16", (V, D))]
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", "bf16", (D,)),
            (p + "post_attention_layernorm.weight", "bf16", (D,)),
            (p + "self_attn.q_a_proj.weight", "bf16", (s["q_lora_rank"], D)),
            (p + "self_attn.q_a_layernorm.weight", "bf16", (s["q_lora_rank"],)),
            (p + "self_attn.q_b_proj.weight", "bf16", (H * qk, s["q_lora_rank"])),
            (
                p + "self_attn.kv_a_proj_with_mqa.weight",
                "bf16",
                (s["kv_lora_rank"] + s["qk_rope_head_dim"], D),
            ),
            (p + "self_attn.kv_a_layernorm.weight", "bf16", (s["kv_lora_rank"],)),
            (
                p + "self_attn.kv_b_proj.weight",
                "bf16",
                (H * (s["qk_nope_head_dim"] + s["v_head_dim"]), s["kv_lora_rank"]),
            ),
            (p + "self_attn.o_proj.weight", "bf16", (D, H * s["v_head_dim"])),
        ]
        if i < s["first_k_dense_replace"]:
            F = s["intermediate_size"]
            out += [
                (p + f"mlp.{n}.weight", "bf16", sh)
                for n, sh in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F)))
            ]
            continue
        F, E = s["moe_intermediate_size"], s["n_routed_experts"]
        out += [
            (p + "mlp.gate.weight", "bf16", (E, D)),
            (p + "mlp.gate.e_score_correction_bias", "f32", (E,)),
        ]
        out += [
            (p + f"mlp.shared_experts.{n}.weight", "bf16", sh)
            for n, sh in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F)))
        ]
        for e in range(E):
            for proj, (o, n) in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
                q = f"{p}mlp.experts.{e}.{proj}."
                out += [
                    (q + "weight_packed", "words", (o, n // 8)),
                    (q + "weight_scale", "scale", (o, n // 32)),
                    (q + "weight_shape", "shape", (o, n)),
                ]
    return out + [("model.norm.weight", "bf16", (D,)), ("lm_head.weight", "bf16", (V, D))]


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def make(kind: str, shape: tuple[int, ...], dev: str) -> torch.Tensor:
    if kind == "words":
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=dev)
    if kind == "scale":
        return (torch.rand(shape, device=dev) * 0.01 + 1e-3).to(torch.bfloat16)
    if kind == "shape":
        return torch.tensor(shape, dtype=torch.int32)
    if kind == "f32":
        return 0.05 * torch.randn(shape, device=dev)
    return (0.02 * torch.randn(shape, device=dev)).to(torch.bfloat16)


def write_checkpoint(out: Path, layers: int, shard_gb: float, dev: str, experts: int) -> tuple[int, float]:
    s = K26 | {"num_hidden_layers": layers, "n_routed_experts": experts}
    text = text_config(s | {"base_vocab": 0}, FIRST_SPECIAL, "int4")
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": FIRST_SPECIAL,
        "eos_token_id": FIRST_SPECIAL + 1,
        "tie_word_embeddings": False,
        "text_config": text,
        "quantization_config": text["quantization_config"],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    specs = tensor_specs(s)
    groups, cur, size = [], [], 0
    for spec in specs:
        # a weight_shape's spec shape is its two values, not its size (counting it as a tensor of that
        # shape cut the H200 run's 15.5 GB into 43 shards instead of 8)
        nb = (
            8
            if spec[1] == "shape"
            else torch.Size(spec[2]).numel() * (2 if spec[1] in ("bf16", "scale") else 4)
        )
        if cur and size + nb > shard_gb * 1e9:
            groups.append(cur)
            cur, size = [], 0
        cur.append(spec)
        size += nb
    groups.append(cur)
    t0, total, wmap = time.perf_counter(), 0, {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        named = [("language_model." + n, make(k, sh, dev).cpu()) for n, k, sh in g]
        total += write_safetensors(out / fname, named)
        wmap |= {n: fname for n, _ in named}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    write_tokenizer(out)
    return total, time.perf_counter() - t0


def write_tokenizer(out: Path) -> None:
    """A tokenizer with K2.6's 163,584 base ids (all bytes, all byte pairs, then byte triples), so that
    `LLM` can start on the checkpoint: only its size matters here."""
    from itertools import product

    toks = [bytes([b]) for b in range(256)] + [bytes(p) for p in product(range(256), repeat=2)]
    for p in product(range(256), repeat=3):
        if len(toks) == FIRST_SPECIAL:
            break
        toks.append(bytes(p))
    save_tokenizer(out, {t: i for i, t in enumerate(toks)})
