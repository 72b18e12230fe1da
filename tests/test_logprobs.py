"""SamplingParams.logprobs: every generated token's log-probability and its position's most probable
tokens under the target's raw distribution, equal to a plain forward's log-softmax at that position
(`LLM.score`), for AR, DFlash and DDTree (the accepted path's nodes), greedy and sampled; asking for them
changes no token; rows that did not ask get none."""

import pytest
import torch

from k26 import LLM, SamplingParams, SpecConfig

PROMPT = "def main(args):\n    "


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=3, max_model_len=96)


def check_against_score(llm, out, k: int) -> None:
    """out.logprobs[j] against log_softmax(score(prompt + tokens))[position of token j]."""
    ids = out.prompt_token_ids + out.token_ids
    ref = llm.score(ids).log_softmax(-1)
    assert len(out.logprobs) == len(out.token_ids) > 0
    for j, (t, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(out.prompt_token_ids) - 1 + j]
        assert lp.logprob == pytest.approx(float(row[t]), abs=2e-4)
        assert len(lp.top) == k
        vals, idx = row.topk(k)
        assert [p for _, p in lp.top] == pytest.approx(vals.tolist(), abs=2e-4)
        assert sorted(i for i, _ in lp.top) == sorted(idx.tolist())  # (near-ties may swap places)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_equal_a_plain_forwards_log_softmax(llm, method, temperature):
    spec = SpecConfig(method, 6 if method == "ddtree" else None)
    sp = SamplingParams(temperature=temperature, max_tokens=10, seed=3, stop_token_ids=[], logprobs=4)
    out = llm.generate(PROMPT, sp, spec)[0]
    check_against_score(llm, out, 4)
    if temperature == 0:  # greedy: each token is its position's most probable
        assert all(lp.top[0][0] == t for t, lp in zip(out.token_ids, out.logprobs))


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.9)])
def test_asking_for_logprobs_changes_no_token(llm, temperature, top_p):
    """The "logprobs" mode samples with the filter sampler, whose race gives each token its own draw: a
    seeded row picks the same tokens whichever mode its batch runs in."""
    sp = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=12, seed=11, stop_token_ids=[])
    spec = SpecConfig("ddtree", 6)
    plain = llm.generate(PROMPT, sp, spec)[0]
    asked = llm.generate(PROMPT, SamplingParams(**{**vars(sp), "logprobs": 0}), spec)[0]
    assert asked.token_ids == plain.token_ids and plain.logprobs is None
    assert [lp.top for lp in asked.logprobs] == [()] * len(asked.token_ids)  # logprobs=0: the token's only


def test_only_rows_that_ask_get_logprobs_in_a_shared_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=6, seed=5, stop_token_ids=[])
    alone = llm.generate("import os\n", seeded, SpecConfig("ddtree", 6))[0].token_ids
    state = llm.open_batch(SpecConfig("ddtree", 6), 3)
    try:
        prompts = [llm.tokenizer.encode(p) for p in (PROMPT, "import os\n")]
        slots = llm.admit(prompts, [SamplingParams(max_tokens=6, logprobs=2), seeded])
        while state.live:
            llm.step()
        with_lp, without = (state.outs[s] for s in slots)
        assert without.logprobs is None and without.token_ids == alone  # its neighbour's mode changed nothing
        check_against_score(llm, with_lp, 2)
    finally:
        for s in list(slots):
            llm.release(s)


def test_bad_logprobs_is_named():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="SamplingParams.logprobs"):
            SamplingParams(logprobs=bad)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_equal_a_plain_forwards_log_softmax(llm, max_tokens):
    sp = SamplingParams(max_tokens=max_tokens, prompt_logprobs=3, stop_token_ids=[])
    out = llm.generate(PROMPT, sp, SpecConfig("ddtree", 6))[0]
    ids = out.prompt_token_ids
    ref = llm.score(ids).log_softmax(-1)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for j in range(1, len(ids)):
        lp = out.prompt_logprobs[j]
        assert lp.logprob == pytest.approx(float(ref[j - 1, ids[j]]), abs=2e-4)
        assert [v for _, v in lp.top] == pytest.approx(ref[j - 1].topk(3).values.tolist(), abs=2e-4)
    assert len(out.token_ids) == max_tokens and out.logprobs is None


def test_logprobs_rows_with_stop_strings_keep_their_own(llm):
    """Several logprobs rows with stop strings in one batch: each row's logprobs are its own tokens'."""
    sp = SamplingParams(max_tokens=12, logprobs=1, stop=["\n"], stop_token_ids=[])
    outs = llm.generate(["def f(", "import os\n", "class A:"], sp, SpecConfig("ddtree", 8))
    for out in outs:
        if out.token_ids:
            check_against_score(llm, out, 1)


def test_prompt_logprobs_are_the_same_in_any_chunking(llm, monkeypatch):
    """The prefill in chunks of 3 positions (each forward over the cached ones before it) gives the
    prompt's logprobs of one whole forward, to float rounding."""
    sp = SamplingParams(max_tokens=0, prompt_logprobs=2)
    whole = llm.generate(PROMPT, sp, SpecConfig("ddtree", 6))[0].prompt_logprobs
    monkeypatch.setattr(llm.decoder.ctx, "chunk", 3)
    chunked = llm.generate(PROMPT, sp, SpecConfig("ddtree", 6))[0].prompt_logprobs
    assert len(chunked) == len(whole) > 4 and chunked[0] is None
    assert [x.logprob for x in chunked[1:]] == pytest.approx([x.logprob for x in whole[1:]], abs=1e-4)
    assert [[i for i, _ in x.top] for x in chunked[1:]] == [[i for i, _ in x.top] for x in whole[1:]]
