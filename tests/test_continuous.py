"""Continuous batching at the decoder: rows admitted at different steps, mixed greedy and seeded sampled
requests in one batch, a row released mid-flight; every request's tokens equal its solo `generate`.
Eager on CPU; one CUDA-graph replay per step on a GPU (the greedy, sample and filter graphs over one
static state)."""

import pytest
import torch
from oracles import random_prompts

from k26 import LLM, SamplingParams, SpecConfig
from k26.tiny import write_tiny_drafter

SPECS = [SpecConfig("ar"), SpecConfig("ddtree", 6), SpecConfig("ddtree", "auto", candidates=(3, 7))]


@pytest.fixture(scope="module")
def drafter_dir(tiny_k25, tmp_path_factory):
    return write_tiny_drafter(tmp_path_factory.mktemp("cb-drafter"), tiny_k25, layers=1, seed=5)


def jobs():
    """(arrival step, prompt, sampling): 6 requests over 4 rows, one sampled with its own seed."""
    ps = random_prompts(6, 3, 20, seed=4)
    greedy = SamplingParams(max_tokens=10, stop_token_ids=[])
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=10, seed=3, stop_token_ids=[])
    return [
        (0, ps[0], greedy),
        (0, ps[1], sampled),
        (1, ps[2], greedy),
        (3, ps[3], greedy),
        (3, ps[4], greedy),
        (4, ps[5], SamplingParams(max_tokens=6, stop_token_ids=[])),
    ]


def drive(llm: LLM, spec: SpecConfig, work, cancel_at: int | None = None) -> dict[int, list[int]]:
    """Admit each job at its step once a row is free, step, retire finished rows; job -> tokens."""
    state = llm.open_batch(spec)
    queue, rows, done, step = list(enumerate(work)), {}, {}, 0
    while queue or rows:
        ready = [j for j in queue if j[1][0] <= step][: len(state.free_slots())]
        for j in ready:
            queue.remove(j)
        if ready:
            slots = llm.admit([j[1][1] for j in ready], [j[1][2] for j in ready])
            rows.update(zip(slots, (j[0] for j in ready)))
        if cancel_at is not None and step == cancel_at:
            slot = next(s for s, i in rows.items() if i == 0)
            llm.release(slot)
            del rows[slot]
        for slot, i in list(rows.items()):
            if state.outs[slot].finish_reason is not None:
                done[i] = llm.release(slot).token_ids
                del rows[slot]
        if state.live:
            llm.step()
        step += 1
    return done


def check(llm, spec):
    work = jobs()
    alone = [llm.generate(p, sp, spec)[0].token_ids for _, p, sp in work]
    # the sampled job reproduces exactly when its steps verify the same trees as alone: not under "auto",
    # whose budget follows the whole batch, nor once a batch-mate nears the context end (the batch then
    # steps autoregressively; these jobs stay far from it): lossless in distribution only
    same = [i for i in range(len(work)) if not (spec.auto and work[i][2].temperature > 0)]
    got = drive(llm, spec, work)
    assert [got[i] for i in same] == [alone[i] for i in same]
    assert all(len(got[i]) == work[i][2].max_tokens for i in range(len(work)))
    dropped = drive(llm, spec, work, cancel_at=2)  # job 0 leaves mid-flight; the others do not notice
    assert 0 not in dropped and [dropped[i] for i in same if i] == [alone[i] for i in same if i]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_rows_admitted_mid_flight_equal_solo_runs(cpu_pair, spec):
    check(cpu_pair(max_batch=4, max_model_len=128), spec)


def test_tp2_batch_equals_solo_runs(tiny_k25, drafter_dir):
    """The ranks mirror open / admit / step / release: the TP 2 batch gives every request its TP 1 solo
    tokens (greedy and the seeded sampled one)."""
    kw = {
        "drafter": drafter_dir,
        "device": "cpu",
        "dtype": torch.float32,
        "progress": False,
        "max_batch": 4,
        "max_model_len": 128,
    }
    spec, work = SPECS[1], jobs()
    solo = LLM(tiny_k25, **kw)
    alone = [solo.generate(p, sp, spec)[0].token_ids for _, p, sp in work]
    tp = LLM(tiny_k25, tp=2, **kw)
    try:
        got = drive(tp, spec, work)
    finally:
        tp.close()
    assert [got[i] for i in range(len(work))] == alone


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_graph_rows_admitted_mid_flight_equal_solo_runs(tiny_k25, drafter_dir, spec):
    llm = LLM(tiny_k25, drafter=drafter_dir, device="cuda", progress=False, max_batch=4, max_model_len=512)
    check(llm, spec)


def test_a_sampled_row_done_at_admission_does_not_break_the_batch(tiny_k25, drafter_dir):
    """temperature 1 with max_tokens 0 (finished at admission) beside a greedy row, eagerly: the finished row
    must not switch the batch to sampling (its noise was never drawn, and every later step crashed)."""
    llm = LLM(tiny_k25, drafter=drafter_dir, device="cpu", dtype=torch.float32, progress=False, max_batch=2)
    spec, greedy = SpecConfig("ddtree", 6), SamplingParams(max_tokens=6, stop_token_ids=[])
    work = [(0, [5, 17, 300], SamplingParams(temperature=1.0, max_tokens=0)), (0, [8, 9, 10], greedy)]
    got = drive(llm, spec, work)
    assert got[0] == [] and got[1] == llm.generate([8, 9, 10], greedy, spec)[0].token_ids


@pytest.mark.parametrize("where", ["prefill", "taking rows in"])
def test_a_failed_admission_frees_its_rows(tiny_k25, monkeypatch, where):
    """A prefill that fails (out of memory, say), or the rows' bookkeeping failing partway (the first row
    taken, the second not: it was a seed torch.Generator refused), raises to the caller and leaves its rows
    free, so later requests still get rows (they leaked, and a server ran out of rows and hung)."""
    import k26.admission
    import k26.batch_state

    llm = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_batch=2)
    sp = SamplingParams(max_tokens=4, stop_token_ids=[])
    state = llm.open_batch(SpecConfig("ar"))

    def failing(*args, **kw):
        raise RuntimeError(f"{where} failed (simulated)")

    # TextStream is built only for a row with stop strings: the second row's
    name, second = (
        ("Prefill", sp) if where == "prefill" else ("TextStream", SamplingParams(max_tokens=4, stop="x"))
    )
    with monkeypatch.context() as mp:
        mp.setattr(k26.admission if name == "Prefill" else k26.batch_state, name, failing)
        with pytest.raises(RuntimeError, match="simulated"):
            llm.admit([[5, 17, 300], [8, 9, 10]], [sp, second])
    assert len(state.free_slots()) == 2 and not state.live
    slots = llm.admit([[8, 9, 10]], [sp])
    while state.live:
        llm.step()
    assert llm.release(slots[0]).token_ids == llm.generate([8, 9, 10], sp, SpecConfig("ar"))[0].token_ids


def test_admitting_no_prompts_takes_no_row_and_returns_no_slots(tiny_k25):
    """admit([], []) (a list of no requests) raised torch's "tensors used as indices must be long" from the
    rows' lengths written with an empty float index; it returns no slots and the batch goes on."""
    llm = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_batch=2)
    sp = SamplingParams(max_tokens=3, stop_token_ids=[])
    state = llm.open_batch(SpecConfig("ar"))
    assert llm.admit([], []) == [] and len(state.free_slots()) == 2
    slots = llm.admit([[8, 9, 10]], [sp])
    assert llm.admit([], [], wait=False) == []
    while state.live:
        llm.step()
    assert llm.release(slots[0]).token_ids == llm.generate([8, 9, 10], sp, SpecConfig("ar"))[0].token_ids


def test_a_batch_opened_without_logprobs_refuses_a_logprobs_row_on_cpu_too(tiny_k25):
    """open_batch(logprobs=False): no row may ask for logprobs — refused with graphs
    (tests/test_graphs_gpu.py) but taken by an eager (CPU) batch before; penalties (the "filter" mode, kept)
    are still taken."""
    llm = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_batch=2)
    state = llm.open_batch(SpecConfig("ar"), logprobs=False)
    with pytest.raises(ValueError, match="SamplingParams.logprobs: this batch has no logprobs"):
        llm.admit([[8, 9, 10]], [SamplingParams(max_tokens=3, logprobs=1)])
    assert len(state.free_slots()) == 2  # nothing taken
    llm.admit([[8, 9, 10]], [SamplingParams(max_tokens=3, frequency_penalty=0.5)])
    while state.live:
        llm.step()


def test_a_row_released_before_it_finished_gives_its_text_so_far_as_aborted(tiny_k25):
    """(Found in a bug hunt: release() of a cancelled row returned its tokens with text '' and no finish
    reason; `text` is the tokens' decode.)"""
    llm = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_batch=2)
    state = llm.open_batch(SpecConfig("ar"))
    slots = llm.admit(
        [[8, 9, 10], [5, 6]], [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, stop=["zz"])]
    )
    llm.step()
    llm.step()
    for slot in slots:
        out = llm.release(slot)
        assert out.token_ids and out.finish_reason == "abort"
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special=True)
    assert len(state.free_slots()) == 2
