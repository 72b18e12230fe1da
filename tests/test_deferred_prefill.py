"""Deferred prefill (`LLM.admit(..., wait=False)`, what the server does): a prompt prefills a budget of
positions per step while the other rows decode, and then answers as if prefilled at once; a request that
leaves mid-prefill frees its row cleanly, and the prompts that were to copy from it prefill that part
themselves (CPU, float32, the tiny K2.5-layout pair)."""

import pytest
from oracles import assert_answers_as_fresh, finish, random_prompts

from k26 import LLM, SamplingParams, SpecConfig

GREEDY = SamplingParams(max_tokens=8, stop_token_ids=[], logprobs=1)
SPEC = SpecConfig("ddtree", 6)


@pytest.fixture(scope="module")
def llm(cpu_pair):
    return cpu_pair(max_batch=3, max_model_len=256, prefill_chunk=8, prefill_budget=16)


def same_as_fresh(llm, out, prompt):
    assert_answers_as_fresh(llm, out, prompt, GREEDY, SPEC)


def fail_prefill_of(monkeypatch, prompt):
    """Every prefill forward whose first prompt is `prompt` raises RuntimeError (an injected failure)."""
    from k26.spec.prefill import Prefill

    forward = Prefill.forward

    def failing(self):
        if self.prompts[0] == prompt:
            raise RuntimeError("injected prefill failure")
        return forward(self)

    monkeypatch.setattr(Prefill, "forward", failing)


def test_a_deferred_prompt_prefills_a_budget_per_step_while_others_decode(llm):
    """60 positions at 16 a step (two forwards of 8): live after the 4th step; the decoding row emits at
    every step meanwhile; both answer as fresh runs."""
    a, b = random_prompts(2, 20, 30, seed=30)
    b = (b * 3)[:60]
    llm.open_batch(SPEC)
    (sa,) = llm.admit([a], [SamplingParams(max_tokens=40, stop_token_ids=[], logprobs=1)])
    (sb,) = llm.admit([b], [GREEDY], wait=False)
    state = llm.batch
    assert sb not in state.live and state.pending
    for k in range(1, 5):
        before = len(state.outs[sa].token_ids)
        stepped = llm.step()
        assert len(state.outs[sa].token_ids) > before and sa in stepped
        assert (sb in state.live) == (k == 4) and (sb in stepped) == (k == 4)
    assert not state.pending
    outs = finish(llm, [sa, sb])
    same_as_fresh(llm, outs[1], b)
    fresh_a = llm.generate(a, SamplingParams(max_tokens=40, stop_token_ids=[], logprobs=1), SPEC)[0]
    assert outs[0].token_ids == fresh_a.token_ids


def test_with_no_row_decoding_a_deferred_prefill_runs_whole_at_the_next_step(llm):
    (p,) = random_prompts(1, 60, 70, seed=31)
    llm.open_batch(SPEC)
    (s,) = llm.admit([p], [GREEDY], wait=False)
    assert llm.step() == [s] and not llm.batch.pending
    same_as_fresh(llm, finish(llm, [s])[0], p)


def test_prompt_logprobs_of_a_deferred_prefill_equal_an_immediate_one(llm):
    (p,) = random_prompts(1, 40, 50, seed=32)
    sp = SamplingParams(max_tokens=0, prompt_logprobs=2)
    want = llm.generate(p, sp, SPEC)[0].prompt_logprobs
    llm.open_batch(SPEC)
    (sa,) = llm.admit([p[:10]], [SamplingParams(max_tokens=30, stop_token_ids=[])])
    (s,) = llm.admit([p], [sp], wait=False)
    while llm.batch.outs[s].finish_reason is None:
        llm.step()
    got = llm.release(s).prompt_logprobs
    assert got[0] is None and len(got) == len(want)
    assert [x.logprob for x in got[1:]] == pytest.approx([x.logprob for x in want[1:]], abs=1e-4)
    finish(llm, [sa])


def test_a_request_leaving_mid_prefill_frees_its_row_and_its_copies_fall_back(llm):
    """Two copies of a long prompt, deferred: the second was to copy the first after its wave. The first
    leaves mid-prefill: its row holds nothing, the second prefills the whole prompt itself and answers as a
    fresh run, and the freed row serves a new prompt correctly."""
    (p,) = random_prompts(1, 100, 110, seed=33)
    (other,) = random_prompts(1, 20, 30, seed=34)
    llm.open_batch(SPEC)
    llm.batch.prefix.min_wave = 64  # (below the default: the tiny pair's prompts are short)
    (sa,) = llm.admit([other], [SamplingParams(max_tokens=60, stop_token_ids=[])])
    s1, s2 = llm.admit([p, p], [GREEDY, GREEDY], wait=False)
    assert llm.batch.pending[0].plans[1].src == s1
    llm.step()
    assert llm.batch.outs[s1].finish_reason is None and s1 not in llm.batch.live
    llm.release(s1)
    assert llm.batch.prefix.known[s1] == []
    plan = llm.batch.pending[0].plans[1]  # the copy falls back at the release, before a new request takes s1
    assert plan.src is None and plan.keep == plan.have
    (s3,) = llm.admit([p[:50] + [1, 2]], [GREEDY], wait=False)
    out2 = finish(llm, [s2])[0]
    assert out2.cached_tokens == 0
    out3 = finish(llm, [s3])[0]
    finish(llm, [sa])  # (every row done: the fresh runs below may write the cache rows)
    same_as_fresh(llm, out2, p)
    same_as_fresh(llm, out3, p[:50] + [1, 2])


@pytest.mark.parametrize("chunks_run", [0, 1])
def test_a_batch_whose_every_deferred_row_was_released_leaves_the_llm_free(llm, chunks_run):
    """Released before its prefill ran, or after one chunk of it: no row is unfinished, so generate() runs
    without a step first (it was refused: the admission stayed pending until a step dropped it)."""
    (p,) = random_prompts(1, 40, 50, seed=45)
    llm.open_batch(SPEC)
    (sa,) = llm.admit([p[:12]], [SamplingParams(max_tokens=30, stop_token_ids=[])])
    (s,) = llm.admit([p], [GREEDY], wait=False)
    for _ in range(chunks_run):
        llm.step()
    assert s not in llm.batch.live and llm.batch.pending
    llm.release(s)
    llm.release(sa)
    assert not llm.batch.pending and not llm.batch.live
    assert llm.generate(p, GREEDY, SPEC)[0].token_ids


def test_a_row_finished_inside_a_waiting_admit_is_reported_by_the_next_step(llm):
    """A deferred one-token request ends when its prefill does; a later admit(wait=True) runs that prefill
    and returns only its own slot, so the next step reports the other row (a driver that answers and
    releases what step() reports would never have answered it)."""
    a, b = random_prompts(2, 20, 30, seed=46)
    llm.open_batch(SPEC)
    (sa,) = llm.admit([a], [SamplingParams(max_tokens=1, stop_token_ids=[])], wait=False)
    (sb,) = llm.admit([b], [SamplingParams(max_tokens=5, stop_token_ids=[])], wait=True)
    assert llm.batch.outs[sa].finish_reason == "length"
    assert sa in llm.step()
    finish(llm, [sa, sb])


def test_an_autoregressive_batch_writes_no_idle_row_into_a_prompt_being_prefilled(llm):
    """AR: idle rows write at their own length each step. A long prompt deferred into a row a shorter request
    left (its length was the old one) must not get that write inside its prefill; nor may a
    prompt-logprobs-only row (never live) get one inside what it holds."""
    spec, sp = SpecConfig("ar"), SamplingParams(max_tokens=8, stop_token_ids=[], logprobs=1)
    a, short, long_ = random_prompts(3, 12, 16, seed=36)
    long_ = (long_ * 6)[:70]
    llm.open_batch(spec)
    (sa,) = llm.admit([a], [SamplingParams(max_tokens=60, stop_token_ids=[])])
    (ss,) = llm.admit([short], [SamplingParams(max_tokens=2, stop_token_ids=[])])
    finish(llm, [ss])
    (sl,) = llm.admit([long_], [sp], wait=False)
    for _ in range(2):
        llm.step()
    assert llm.batch.pending
    (sq,) = llm.admit([short + [3]], [SamplingParams(max_tokens=0, prompt_logprobs=1)], wait=False)
    out = finish(llm, [sl])[0]
    llm.release(sq)
    follow = short + [3, 9, 9]
    again = finish(llm, llm.admit([follow], [sp]))[0]
    assert again.cached_tokens == len(short) + 1
    finish(llm, [sa])
    for got, prompt in ((out, long_), (again, follow)):  # (generate makes the batch forget its rows: last)
        assert_answers_as_fresh(llm, got, prompt, sp, spec)


def test_a_copy_source_taken_by_a_new_request_before_the_copy_falls_back(cpu_pair):
    """AR: B was to copy a prefix from A's row at its wave, queued behind a long deferred prompt D while a row
    L decodes. A leaves and a short request C takes its row before B's wave: C's idle steps write at C's
    length, inside the prefix B meant to copy. B must prefill that part itself and answer as a fresh run."""
    llm = cpu_pair(max_batch=4, max_model_len=256, prefill_chunk=8, prefill_budget=16)
    spec, sp = SpecConfig("ar"), SamplingParams(max_tokens=8, stop_token_ids=[], logprobs=1)
    p, long_, tail, c = random_prompts(4, 40, 48, seed=51)
    long_ = (long_ * 4)[:160]
    llm.open_batch(spec)
    (sl,) = llm.admit([tail], [SamplingParams(max_tokens=40, stop_token_ids=[])])
    (sa,) = llm.admit([p], [SamplingParams(max_tokens=3, stop_token_ids=[])])
    (sd,) = llm.admit([long_], [SamplingParams(max_tokens=2, stop_token_ids=[])], wait=False)
    (sb,) = llm.admit([p + tail[:5]], [sp], wait=False)
    assert llm.batch.pending[-1].plans[0].src == sa  # B copies A's prompt at its wave, after D's prefill
    while llm.batch.outs[sa].finish_reason is None:
        llm.step()
    llm.release(sa)
    (sc,) = llm.admit([c[:4]], [SamplingParams(max_tokens=2, stop_token_ids=[])], wait=False)
    assert sc == sa
    llm.step()  # an idle step of C's row, with B's copy still to come
    assert llm.batch.pending[1].slots == [sb] and llm.batch.pending[1].job is None
    out = finish(llm, [sb])[0]
    finish(llm, [sd, sc, sl])
    assert_answers_as_fresh(llm, out, p + tail[:5], sp, spec)


def test_a_waiting_admit_that_fails_keeps_none_of_its_rows(llm, monkeypatch):
    """admit(wait=True) prefills the older deferred admissions first; when one of those fails the call
    raises, and its own rows (never returned to the caller) must not stay taken and decode unseen."""
    older, mine = random_prompts(2, 8, 12, seed=41)
    state = llm.open_batch(SpecConfig("ar"))
    llm.admit([older], [SamplingParams(max_tokens=4, stop_token_ids=[])], wait=False)
    fail_prefill_of(monkeypatch, older)
    with pytest.raises(RuntimeError, match="injected prefill failure"):
        llm.admit([mine], [SamplingParams(max_tokens=4, stop_token_ids=[])], wait=True)
    assert len(state.free_slots()) == state.capacity and not state.pending and not state.live


@pytest.mark.parametrize("readied_by", ["the failing step", "a waiting admit before it"])
def test_rows_finished_before_a_failing_prefill_are_still_reported(llm, monkeypatch, readied_by):
    """A one-token request ends with its prefill; a later admission's prefill then fails. The failing step
    raises, and the next step reports the finished row (it was lost: held only by the call that raised)."""
    a, b, c = random_prompts(3, 8, 12, seed=47)
    one = SamplingParams(max_tokens=1, stop_token_ids=[])
    llm.open_batch(SPEC)
    (sa,) = llm.admit([a], [one], wait=False)
    if readied_by == "a waiting admit before it":
        llm.admit([c], [SamplingParams(max_tokens=20, stop_token_ids=[])], wait=True)
        assert llm.batch.outs[sa].finish_reason == "length"
    (sb,) = llm.admit([b], [GREEDY], wait=False)
    fail_prefill_of(monkeypatch, b)
    with pytest.raises(RuntimeError, match="injected prefill failure"):
        llm.step()
    monkeypatch.undo()
    assert llm.batch.outs[sa].finish_reason == "length" and llm.batch.outs[sb] is None
    assert sa in llm.step()
    finish(llm, [s for s in range(llm.batch.capacity) if llm.batch.outs[s] is not None])


def test_prefill_budget_is_checked():
    with pytest.raises(ValueError, match="prefill_budget=0"):
        LLM(prefill_budget=0)


@pytest.mark.gpu
def test_graph_batches_prefill_deferred_prompts_between_replays(tiny_k25, drafter_dir):
    """CUDA graphs: a prompt admitted with wait=False while another row decodes (its rows parked during
    the replays) answers as a fresh run, up to bf16 near-ties."""
    from oracles import assert_diverges_only_at_near_ties

    llm = LLM(
        tiny_k25,
        drafter=drafter_dir,
        device="cuda",
        progress=False,
        max_batch=3,
        max_model_len=256,
        prefill_chunk=8,
        prefill_budget=16,
    )
    sp = SamplingParams(max_tokens=8, stop_token_ids=[])
    a, b = random_prompts(2, 60, 70, seed=35)
    llm.open_batch(SPEC)
    (sa,) = llm.admit([a], [SamplingParams(max_tokens=30, stop_token_ids=[])])
    (sb,) = llm.admit([b], [sp], wait=False)
    llm.step()
    assert sb not in llm.batch.live and llm.batch.pending
    out = finish(llm, [sb])[0]
    finish(llm, [sa])
    assert_diverges_only_at_near_ties(llm, [b], llm.generate([b], sp, SPEC), [out])


@pytest.mark.gpu
def test_a_graph_batch_repoints_its_rows_after_another_batch_parked_in_the_shared_state(
    tiny_k25, drafter_dir
):
    """Graph batches of one bucket share its static `rows`: a `generate` while a batch is open leaves its own
    parking in them; the open batch's next step must point its slots back at their rows."""
    llm = LLM(tiny_k25, drafter=drafter_dir, device="cuda", progress=False, max_batch=4, max_model_len=256)
    prompts = random_prompts(4, 20, 40, seed=37)
    sp = SamplingParams(max_tokens=24, stop_token_ids=[])
    want = llm.generate(prompts, sp, SPEC)
    state = llm.open_batch(SPEC, capacity=4)
    early = SamplingParams(max_tokens=24, stop_token_ids=[t.token_ids[3] for t in want[:2]])
    llm.generate(prompts, early, SPEC)  # rows 0 and 1 stop early: the others' steps park them
    slots = llm.admit(prompts, [sp] * 4)
    while state.live:
        llm.step()
    assert [state.outs[s].token_ids for s in slots] == [w.token_ids for w in want]


@pytest.mark.parametrize("spec", [SpecConfig("ar"), SPEC], ids=str)
def test_a_prompt_copying_from_a_row_whose_own_copy_fell_back_copies_only_what_that_row_holds(cpu_pair, spec):
    """B and C (deferred, one admission) share A's prompt prefix X: B copies X from A's live row, C copies it
    from B's row in the same wave (after B's copy). A leaves and D takes its row before that wave: B falls
    back to prefilling X itself, so B's row will not hold X when C copies from it; C must not copy those
    positions either (it copied B's never-written row and answered from garbage), and answers as fresh."""
    llm = cpu_pair(max_batch=3, max_model_len=128)  # (a fresh LLM: its rows hold nothing yet)
    sp = SamplingParams(max_tokens=8, stop_token_ids=[], logprobs=1)
    x, a, b, c, d = random_prompts(5, 4, 12, seed=61)
    x = (x * 3)[:20]
    llm.open_batch(spec)
    (sa,) = llm.admit([x + a], [SamplingParams(max_tokens=1, stop_token_ids=[])])
    sb, sc = llm.admit([x + b, x + c], [sp, sp], wait=False)
    plans = llm.batch.pending[0].plans
    assert (plans[0].src, plans[1].src) == (sa, sb) and plans[0].wave == plans[1].wave
    llm.release(sa)
    (sd,) = llm.admit([d], [sp])  # D takes A's row; the pending wave runs first
    assert sd == sa
    outs = finish(llm, [sb, sc, sd])
    for out, prompt in zip(outs, (x + b, x + c, d)):
        assert_answers_as_fresh(llm, out, prompt, sp, spec)
