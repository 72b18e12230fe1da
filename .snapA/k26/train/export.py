"""A trained `KimiK2` (bf16/fp32 dense experts) -> HF-named tensors in the released layout: routed experts
int4 pack-quantized (group 32, symmetric, s = absmax / 7), the router bias fp32, everything else bf16."""

from __future__ import annotations

import re

import torch

from ..model import KimiK2
from ..ops.int4 import quantize_int4

_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")


@torch.no_grad()
def hf_tensors(model: KimiK2, quant: str = "int4") -> dict[str, torch.Tensor]:
    if model.tp.size != 1:
        raise ValueError("export a TP-1 model")
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        p = p.detach().cpu()
        if m := _EXPERTS.match(name):
            for e in range(p.shape[0]):
                base = f"model.layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}."
                w = p[e].to(torch.bfloat16)
                if quant == "int4":
                    packed, scale = quantize_int4(w)
                    out |= {
                        base + "weight_packed": packed,
                        base + "weight_scale": scale,
                        base + "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32),
                    }
                else:
                    out[base + "weight"] = w
        elif name.endswith("e_score_correction_bias"):
            out["model." + name] = p.float()
        else:
            out[("" if name.startswith("lm_head") else "model.") + name] = p.to(torch.bfloat16)
    return out
