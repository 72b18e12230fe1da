"""(a) k26 computes what transformers' DeepseekV3ForCausalLM computes, on real-format tiny checkpoints."""

import pytest
import torch
from oracles import hf_oracle

from k26 import LLM
from k26.model import AttnBatch


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def prompt_ids(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("ckpt", ["tiny_k25", "tiny_k2", "tiny_bf16"])
def test_score_matches_hf(ckpt, request):
    path = request.getfixturevalue(ckpt)
    llm = LLM(path, device="cpu", dtype=torch.float32, progress=False)
    ids = prompt_ids(37, llm.config.vocab_size)
    ours = llm.score(ids)
    with torch.no_grad():
        ref = hf_oracle(path)(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (37, llm.config.vocab_size)
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("absorb", [True, False])
def test_token_by_token_decode_matches_hf(tiny_k25, absorb):
    llm = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, absorb=absorb)
    ids = prompt_ids(20, llm.config.vocab_size, seed=5)
    with torch.no_grad():
        ref = hf_oracle(tiny_k25)(torch.tensor([ids])).logits[0].float()
        rows = torch.zeros(1, dtype=torch.long)
        steps = []
        for t, tok in enumerate(ids):
            batch = AttnBatch.causal(torch.tensor([t]), 1, rows)
            h, _ = llm.model(torch.tensor([[tok]]), batch, llm.cache.kv_LRTC, absorb=absorb)
            steps.append(llm.model.logits(h[0, 0]))
    assert rel_err(torch.stack(steps), ref) < 1e-4
