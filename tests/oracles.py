"""Independent implementations k26 is checked against (transformers, compressed-tensors)."""

import json

import torch
from safetensors import safe_open

from k26.ops import dequantize_int4


def read_hf_state(path):
    """All text tensors of a checkpoint with HF names, experts dequantised exactly as compressed-tensors does."""
    raw = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                raw[k.removeprefix("language_model.")] = h.get_tensor(k)
    out = {}
    for k, v in raw.items():
        if k.startswith(("vision_tower.", "mm_projector.")) or k.endswith(("weight_scale", "weight_shape")):
            continue
        if k.endswith("weight_packed"):
            base = k.removesuffix("_packed")
            out[base] = dequantize_int4(v, raw[base + "_scale"], torch.float32)
        else:
            out[k] = v
    return out


def hf_oracle(path):
    """transformers' DeepseekV3ForCausalLM on the same checkpoint, float32, eager attention."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    drop = {"quantization_config", "architectures", "model_type"}
    hf_cfg = DeepseekV3Config(**{k: v for k, v in text.items() if k not in drop})
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_cfg).float().eval()
    state = read_hf_state(path)
    fused = {}
    for i in range(hf_cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in state:
            continue
        E = hf_cfg.n_routed_experts
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat([state.pop(f"{p}{e}.gate_proj.weight"), state.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)]
        )
        fused[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    state = {k: v.float() for k, v in (state | fused).items()}
    model.load_state_dict(state, strict=True)
    return model
