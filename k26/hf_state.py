"""A checkpoint directory as transformers' `DeepseekV3ForCausalLM` state dict (experts dequantised and
fused as HF stores them): for the HF oracle in the tests and the HF baseline in `k26 bench`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint_index import read_index
from .ops.int4 import dequantize_int4


def deepseek_v3_state(path: str | Path, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """(LM config fields for `DeepseekV3Config`, state dict)."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    text = {
        k: v
        for k, v in raw.get("text_config", raw).items()
        if k not in ("quantization_config", "architectures", "model_type")
    }
    # The shards k26's loader reads (read_index: the index's, which may sit in subdirectories and leave a
    # stray *.safetensors beside them out; without an index every shard in the directory)
    tensors = {}
    for f in sorted({info.file for info in read_index(path).values()}, key=str):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118  (safe_open handles have keys() but are not iterable)
                tensors[k.removeprefix("language_model.")] = h.get_tensor(k)
    state = {}
    for k, v in tensors.items():
        if k.startswith(("vision_tower.", "mm_projector.")) or k.endswith(("weight_scale", "weight_shape")):
            continue
        if k.endswith("weight_packed"):
            base = k.removesuffix("_packed")
            state[base] = dequantize_int4(v, tensors[base + "_scale"], dtype)
        else:
            state[k] = v.to(dtype)
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in state:
            continue
        E = text["n_routed_experts"]
        state[p + "gate_up_proj"] = torch.stack(
            [
                torch.cat([state.pop(f"{p}{e}.gate_proj.weight"), state.pop(f"{p}{e}.up_proj.weight")])
                for e in range(E)
            ]
        )
        state[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    return text, state
