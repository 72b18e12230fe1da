"""On a CUDA device the same checkpoint gives the CPU's numbers (fresh random ids, poisoned cache)."""

import pytest
import torch

from k26 import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_cuda_matches_cpu_fp32(tiny_k25):
    ids = torch.randint(0, 600, (33,), generator=torch.Generator().manual_seed(11)).tolist()
    cpu = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False).score(ids)
    gpu_llm = LLM(tiny_k25, device="cuda", dtype=torch.float32, progress=False)
    gpu_llm.cache.kv_LRTC.fill_(float("nan"))  # anything read before it is written shows up
    gpu = gpu_llm.score(ids).cpu()
    assert torch.isfinite(gpu).all()
    assert ((gpu - cpu).norm() / cpu.norm()).item() < 1e-4


def test_cuda_bf16_greedy_ignores_a_poisoned_cache(tiny_k25):
    """Greedy bf16 decoding over a NaN-filled cache gives the tokens of a zero-filled one: no unwritten slot
    is read (argmax of NaN logits would still return ids, so the tokens are compared, and the logits of
    the same prompts scored over the poisoned cache must be finite)."""
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 600, (n,), generator=g).tolist() for n in (5, 13)]
    sp = SamplingParams(max_tokens=8, stop_token_ids=[])
    llm = LLM(tiny_k25, device="cuda", progress=False)
    runs = []
    for fill in (float("nan"), 0.0):
        llm.cache.kv_LRTC.fill_(fill)
        runs.append([o.token_ids for o in llm.generate(prompts, sp)])
    assert all(len(t) == 8 for t in runs[0])
    assert runs[0] == runs[1]
    llm.cache.kv_LRTC.fill_(float("nan"))
    assert all(torch.isfinite(llm.score(p + t)).all() for p, t in zip(prompts, runs[0], strict=True))


def test_capture_at_startup_records_every_bucket_and_first_use_captures_nothing(tiny_k25):
    """LLM(capture=True) captures the graphs of every sampling mode (greedy, sample, filter) and batch size
    before the first request, each with its seconds and pool growth in `startup.captures`; generate then
    replays them."""
    from k26.graphs.buckets import default_batches

    llm = LLM(tiny_k25, device="cuda", progress=False, max_batch=4, capture=True)
    caps = llm.startup.captures
    kinds = {c.kind for c in caps}  # greedy and the sampled mode(s)
    assert "ar greedy" in kinds and len(kinds) >= 2
    want = sorted((b, k) for b in default_batches(4) for k in kinds)
    assert sorted((c.bucket.batch, c.kind) for c in caps) == want
    assert all(c.seconds > 0 for c in caps) and max(c.pool_bytes for c in caps) > 0
    assert llm.startup.phases["capture"] >= sum(c.seconds for c in caps)
    graphs = sum(len(r.graphs) for r in llm.decoder.runners.values())
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 600, (n,), generator=g).tolist() for n in (4, 9, 6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, stop_token_ids=[]))
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    assert sum(len(r.graphs) for r in llm.decoder.runners.values()) == graphs
