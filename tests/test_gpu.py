"""On a CUDA device the same checkpoint gives the CPU's numbers (fresh random ids, poisoned cache)."""

import pytest
import torch

from k26 import LLM, SamplingParams


@pytest.mark.gpu
def test_cuda_matches_cpu_fp32(tiny_k25):
    ids = torch.randint(0, 600, (33,), generator=torch.Generator().manual_seed(11)).tolist()
    cpu = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False).score(ids)
    gpu_llm = LLM(tiny_k25, device="cuda", dtype=torch.float32, progress=False)
    gpu_llm.cache.kv_LRTC.fill_(float("nan"))  # anything read before it is written shows up
    gpu = gpu_llm.score(ids).cpu()
    assert torch.isfinite(gpu).all()
    assert ((gpu - cpu).norm() / cpu.norm()).item() < 1e-4


@pytest.mark.gpu
def test_cuda_bf16_greedy_generate_runs(tiny_k25):
    llm = LLM(tiny_k25, device="cuda", progress=False)
    llm.cache.kv_LRTC.fill_(float("nan"))
    out = llm.generate(["hello", [1, 2, 3]], SamplingParams(max_tokens=8, stop_token_ids=[]))
    assert all(len(o.token_ids) == 8 for o in out)
