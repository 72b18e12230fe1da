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


def test_tp2_fused_allreduce_graphs_equal_eager_and_ddtree_equals_ar():
    """The embedded pair at TP 2 in bf16 with the fused all-reduce + add + RMSNorm (the default on NCCL with
    peer access): greedy tokens with graphs == without, DDTree == AR; ranks agree (one set of tokens).
    Two GPUs: `python -m pytest -q tests/test_tp_gpu.py -m multigpu`."""
    prompts, sp = [[5, 6, 7, 8, 9], [11, 12, 13]], SamplingParams(max_tokens=32, stop_token_ids=[])
    runs = {}
    for graphs in (False, True):
        llm = LLM(device="cuda", tp=2, dtype=torch.bfloat16, graphs=graphs, progress=False, max_batch=2)
        try:
            assert llm.model.tp.allreduce_add_rmsnorm is not None, "the fused all-reduce is not in use"
            for spec in (SpecConfig("ar"), SpecConfig("ddtree", 8)):
                runs[graphs, spec.method] = [o.token_ids for o in llm.generate(prompts, sp, spec)]
            llm._check_workers()
        finally:
            llm.close()
    assert runs[True, "ar"] == runs[False, "ar"]
    assert runs[True, "ddtree"] == runs[False, "ddtree"] == runs[False, "ar"]
