"""Tensor parallel on CPU with gloo: TP 2, 4 and 8 compute what TP 1 computes (ranks driven from Python)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from k26 import LLM, SamplingParams, SpecConfig
from k26.tiny import write_tiny_checkpoint, write_tiny_drafter

# logprobs of the generated and the prompt tokens: the logprobs sampling mode and the prefill's chunks, whose
# collectives every rank must make alike
LOGPROBS = SamplingParams(max_tokens=6, stop_token_ids=[], logprobs=2, prompt_logprobs=2)


@pytest.fixture(scope="module")
def reference(tiny_tp):
    d, dr = tiny_tp
    llm = LLM(
        d, drafter=dr, device="cpu", dtype=torch.float32, progress=False, max_batch=2, max_model_len=128
    )
    ids = torch.randint(0, 600, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [ids[:9], ids[3:17]]
    sp = SamplingParams(max_tokens=12, stop_token_ids=[])
    return (
        ids,
        llm.score(ids),
        [o.token_ids for o in llm.generate(prompts, sp, SpecConfig("ar"))],
        prompts,
        sp,
        llm.generate(prompts, LOGPROBS, SpecConfig("ddtree", 6)),
    )


def same_logprobs(a, b) -> bool:
    flat = [(x.logprob, *(v for _, v in x.top)) for o in a for x in [*o.prompt_logprobs[1:], *o.logprobs]]
    want = [(x.logprob, *(v for _, v in x.top)) for o in b for x in [*o.prompt_logprobs[1:], *o.logprobs]]
    return [o.token_ids for o in a] == [o.token_ids for o in b] and torch.allclose(
        torch.tensor(flat), torch.tensor(want), atol=1e-4
    )


def test_tp4_matches_tp1(tiny_tp, reference):
    d, dr = tiny_tp
    ids, logits1, ar1, prompts, sp, lp1 = reference
    llm = LLM(
        d, drafter=dr, device="cpu", dtype=torch.float32, progress=False, max_batch=2, max_model_len=128, tp=4
    )
    try:
        logits = llm.score(ids)
        assert ((logits - logits1).norm() / logits1.norm()).item() < 1e-5
        assert [o.token_ids for o in llm.generate(prompts, sp, SpecConfig("ar"))] == ar1
        assert [o.token_ids for o in llm.generate(prompts, sp, SpecConfig("ddtree", 6))] == ar1
        assert same_logprobs(llm.generate(prompts, LOGPROBS, SpecConfig("ddtree", 6)), lp1)
        llm._check_workers()
    finally:
        llm.close()


def test_tp_stream_stopped_early_keeps_ranks_in_step(tiny_tp, reference):
    """A caller that leaves `stream()` after the first piece: the ranks ran the whole stream, so the next
    calls must still pair their collectives with the ranks' (before the fix, gloo reported a mismatch)."""
    d, dr = tiny_tp
    ids, logits1, ar1, prompts, sp, _ = reference
    llm = LLM(
        d, drafter=dr, device="cpu", dtype=torch.float32, progress=False, max_batch=2, max_model_len=128, tp=2
    )
    try:
        pieces = llm.stream(prompts[0], sp, SpecConfig("ddtree", 6))
        next(pieces)
        pieces.close()
        logits = llm.score(ids)
        assert ((logits - logits1).norm() / logits1.norm()).item() < 1e-5
        assert [o.token_ids for o in llm.generate(prompts, sp, SpecConfig("ar"))] == ar1
        llm._check_workers()
    finally:
        llm.close()


def test_tp2_from_a_script_on_stdin_matches_tp1(tiny_tp, reference, tmp_path):
    """TP 2 driven from `python -` (multiprocessing's spawn would re-run a `__main__` that is no file): the
    same checks as TP 4, in that script against this process's TP 1 results."""
    d, dr = tiny_tp
    ids, logits1, ar1, prompts, sp, _ = reference
    torch.save({"ids": ids, "logits": logits1, "ar": ar1, "prompts": prompts}, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import torch
        from k26 import LLM, SamplingParams, SpecConfig

        torch.set_num_threads(1)  # as conftest's one_cpu_thread
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        sp = SamplingParams(max_tokens={sp.max_tokens}, stop_token_ids=[])
        llm = LLM({str(d)!r}, drafter={str(dr)!r}, device="cpu", dtype=torch.float32, progress=False,
                  max_batch=2, max_model_len=128, tp=2)
        logits = llm.score(ref["ids"])
        assert ((logits - ref["logits"]).norm() / ref["logits"].norm()).item() < 1e-5
        assert [o.token_ids for o in llm.generate(ref["prompts"], sp, SpecConfig("ar"))] == ref["ar"]
        assert [o.token_ids for o in llm.generate(ref["prompts"], sp, SpecConfig("ddtree", 6))] == ref["ar"]
        llm._check_workers()
        llm.close()
        print("tp2 matches tp1")
    """)
    done = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "tp2 matches tp1" in done.stdout


def test_tp_that_does_not_divide(tiny_tp):
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide"):
        from k26.config import ModelConfig

        ModelConfig.from_dir(tiny_tp[0]).check_tp(3)


def test_tp8_on_gloo_matches_tp1(tmp_path_factory):
    """TP 8 (the K2.6 deployment width) on CPU: every sharded dimension divides by 8, ranks agree on the
    adaptive budget's measured costs and on every tree, and the output is TP 1's."""
    d = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp8"), seed=5, num_attention_heads=8, moe_intermediate_size=256, shards=2
    )
    dr = write_tiny_drafter(tmp_path_factory.mktemp("tp8d"), d, layers=1, seed=6, heads=8, kv_heads=8)
    kw = {
        "drafter": dr,
        "device": "cpu",
        "dtype": torch.float32,
        "progress": False,
        "max_batch": 2,
        "max_model_len": 96,
    }
    ids = torch.randint(0, 600, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts, sp = [ids[:7], ids[5:20]], SamplingParams(max_tokens=10, stop_token_ids=[])
    one = LLM(d, **kw)
    logits1, ar1 = one.score(ids), [o.token_ids for o in one.generate(prompts, sp, SpecConfig("ar"))]
    llm = LLM(d, tp=8, **kw)
    try:
        assert ((llm.score(ids) - logits1).norm() / logits1.norm()).item() < 1e-5
        for spec in (
            SpecConfig("ar"),
            SpecConfig("ddtree", 6),
            SpecConfig("ddtree", "auto", candidates=(3, 7)),
        ):
            assert [o.token_ids for o in llm.generate(prompts, sp, spec)] == ar1, spec
        llm._check_workers()
    finally:
        llm.close()
