"""Independent implementations k26 is checked against (transformers, compressed-tensors)."""

import torch

from k26.hf_state import deepseek_v3_state


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 600) -> list[list[int]]:
    """n prompts of random ids with lengths in [lo, hi), drawn from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def hf_oracle(path):
    """transformers' DeepseekV3ForCausalLM on the same checkpoint, float32, eager attention."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    text, state = deepseek_v3_state(path, torch.float32)
    hf_cfg = DeepseekV3Config(**text)
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_cfg).float().eval()
    model.load_state_dict(state, strict=True)
    return model
