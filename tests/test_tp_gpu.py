"""Tensor parallel on two GPUs (NCCL, ranks driven from this process): TP 2 computes what TP 1 computes."""

import pytest
import torch

from k26 import LLM, SamplingParams, SpecConfig

pytestmark = pytest.mark.multigpu


def test_tp2_on_two_gpus_matches_tp1(tiny_tp):
    d, dr = tiny_tp
    kw = {
        "drafter": dr,
        "device": "cuda",
        "dtype": torch.float32,
        "graphs": False,
        "progress": False,
        "max_batch": 2,
        "max_model_len": 128,
    }
    ids = torch.randint(0, 600, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts, sp = [ids[:9], ids[3:17]], SamplingParams(max_tokens=12, stop_token_ids=[])
    one = LLM(d, **kw)
    logits1 = one.score(ids).cpu()
    ar1 = [o.token_ids for o in one.generate(prompts, sp, SpecConfig("ar"))]
    del one
    llm = LLM(d, tp=2, **kw)
    try:
        logits = llm.score(ids).cpu()
        assert torch.isfinite(logits).all()
        assert ((logits - logits1).norm() / logits1.norm()).item() < 1e-5
        for spec in (SpecConfig("ar"), SpecConfig("ddtree", 6)):
            assert [o.token_ids for o in llm.generate(prompts, sp, spec)] == ar1, spec
        llm._check_workers()
    finally:
        llm.close()
