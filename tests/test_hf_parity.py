"""(a) k26 computes what transformers' DeepseekV3ForCausalLM computes, on real-format tiny checkpoints."""

import json

import pytest
import torch
from oracles import hf_oracle

from k26 import LLM
from k26.model import AttnBatch
from k26.tiny import write_tiny_checkpoint


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


# Config paths the fixtures' checkpoints do not take (they all have YaRN with mscale = mscale_all_dim = 1, one
# dense layer, norm_topk_prob true): plain RoPE, mscale_all_dim other than 1 (the softmax scale's mscale),
# norm_topk_prob false, no dense layer / two, group-limited routing keeping one group, two shared experts.
GAP_CONFIGS = {
    "plain_rope_no_dense": ({"first_k_dense_replace": 0}, {"rope_scaling": None}),
    "mscale_0707_two_shared": (
        {"n_shared_experts": 2},
        {"rope_scaling": {"mscale": 0.707, "mscale_all_dim": 0.707}},
    ),
    "groups_unnormalised_two_dense": (
        {"n_group": 4, "topk_group": 1, "first_k_dense_replace": 2},
        {"norm_topk_prob": False, "routed_scaling_factor": 1.5},
    ),
}


@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("name", sorted(GAP_CONFIGS))
def test_config_variants_match_hf(name, absorb, tmp_path):
    sizes, edits = GAP_CONFIGS[name]
    path = write_tiny_checkpoint(tmp_path, flavour="k2-thinking", quant="none", shards=1, seed=6, **sizes)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in edits.items():
        cfg[k] = cfg[k] | v if isinstance(v, dict) else v
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(path, device="cpu", dtype=torch.float32, progress=False, absorb=absorb)
    ids = prompt_ids(33, llm.config.vocab_size, seed=7)
    with torch.no_grad():
        ref = hf_oracle(path)(torch.tensor([ids])).logits[0].float()
    assert rel_err(llm.score(ids), ref) < 1e-4
