"""Presence / frequency penalties and logit biases (k26/penalties.py): the OpenAI formula on the tokens
generated so far, at every verify-tree node with its path counted (speculative decoding stays lossless),
nothing changed for rows without them, and bad values named."""

from dataclasses import replace

import pytest
import torch

from k26 import LLM, SamplingParams, SpecConfig
from k26.ops import tree_mask_to_words, words_to_tree_mask
from k26.penalties import Penalties, RowPenalty, penalized

PROMPT = "def main(args):\n    "


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=3, max_model_len=96)


def random_tree(B: int, N: int, V: int, g: torch.Generator):
    """Tokens [B, N] (few distinct ones, so paths repeat tokens) and the ancestor-or-self mask [B, N, N]."""
    tokens = torch.randint(0, min(V, 5), (B, N), generator=g)
    anc = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            anc[b, n, n] = True
            if n:
                parent = int(torch.randint(0, n, (1,), generator=g))
                anc[b, n] |= anc[b, parent]
    # (through the bitmask words, as DraftTree.ancestors reads them)
    return tokens, words_to_tree_mask(tree_mask_to_words(anc), N)


def test_tree_nodes_see_the_counts_of_their_own_path():
    g = torch.Generator().manual_seed(0)
    B, N, V = 3, 9, 11
    p = Penalties.allocate(B, V, "cpu")
    p.counts.copy_(torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32))
    p.bias.copy_(torch.randn(B, V, generator=g))
    p.frequency.copy_(torch.tensor([0.5, -1.25, 0.0]))
    p.presence.copy_(torch.tensor([1.5, 0.75, -2.0]))
    logits = torch.randn(B, N, V, generator=g)
    tokens, anc = random_tree(B, N, V, g)
    got = penalized(logits, p, tokens, anc)
    for b in range(B):
        for n in range(N):
            c = p.counts[b].clone()
            for a in range(1, N):  # the path below the root (the root's token is counted already)
                if anc[b, n, a]:
                    c[tokens[b, a]] += 1
            c = c.float()
            want = logits[b, n] + (p.bias[b] - p.frequency[b] * c - p.presence[b] * (c > 0).float())
            assert torch.equal(got[b, n], want), (b, n)


def test_rows_without_penalties_get_their_logits_back_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    B, N, V = 2, 7, 13
    p = Penalties.allocate(B, V, "cpu")
    p.counts.copy_(torch.randint(0, 4, (B, V), generator=g, dtype=torch.int32))  # counted, but no penalty
    p.set_row(
        1, RowPenalty(0.7, 0.3, ((2, 5.0),), 3, frozenset({1, 4}))
    )  # row 1 penalised: row 0 must not notice
    logits = torch.randn(B, N, V, generator=g)
    tokens, anc = random_tree(B, N, V, g)
    assert torch.equal(penalized(logits, p, tokens, anc)[0], logits[0])
    assert torch.equal(penalized(logits, p)[0], logits[0])
    assert not torch.equal(penalized(logits, p)[1], logits[1])


def test_set_row_clears_the_slots_previous_request():
    p = Penalties.allocate(2, 6, "cpu")
    p.set_row(0, RowPenalty(1.0, 1.0, ((1, -3.0), (4, 2.0)), 5, frozenset({0, 3})))
    p.count([0, 0, 0], [4, 4, 5])
    assert p.counts[0].tolist() == [0, 0, 0, 0, 2, 1] and p.bias[0, 4] == 2.0
    assert p.held[0] == 2 and p.stops[0].tolist() == [True, False, False, True, False, False]
    p.count([0, 0, 0], [1, 1, 1])
    assert p.held[0] == 0  # (never below)
    p.set_row(0, RowPenalty(min_tokens=5, stop_ids=frozenset({3})))
    assert p.held[0] == 5  # a request still holding its stop ids back when the slot is given again
    p.set_row(0, RowPenalty())
    assert not p.counts[0].any() and not p.bias[0].any() and p.frequency[0] == 0 and p.presence[0] == 0
    assert p.held[0] == 0 and not p.stops[0].any()


def test_min_tokens_holds_stop_ids_back_until_enough_precede_each_node():
    """A node at depth d (path tokens below the root) has generated + d tokens before its position: the stop
    ids are -inf there while that is below min_tokens, and only the stop ids."""
    g = torch.Generator().manual_seed(2)
    B, N, V = 2, 9, 11
    p = Penalties.allocate(B, V, "cpu")
    p.set_row(0, RowPenalty(min_tokens=5, stop_ids=frozenset({2, 7})))
    p.set_row(1, RowPenalty(min_tokens=4, stop_ids=frozenset({3})))
    p.count([0, 0, 0], [1, 1, 4])  # row 0: 3 generated, 2 more held back; row 1: 4 held back
    logits = torch.randn(B, N, V, generator=g)
    tokens, anc = random_tree(B, N, V, g)
    got = penalized(logits, p, tokens, anc)
    flat = penalized(logits, p)  # no tree: every position at depth 0
    for b, (stops, held) in enumerate([({2, 7}, 2), ({3}, 4)]):
        for n in range(N):
            depth = int(anc[b, n, 1:].sum())
            for t in range(V):
                early = t in stops
                assert (got[b, n, t] == float("-inf")) == (early and depth < held), (b, n, t)
                assert (flat[b, n, t] == float("-inf")) == early, (b, n, t)
                if not early:
                    assert got[b, n, t] == logits[b, n, t]


def greedy_by_hand(llm, prompt_ids, sp: SamplingParams, steps: int, stops=frozenset()) -> list[int]:
    """The specification: each token the argmax of a plain forward's last logits shifted by OpenAI's formula
    over the tokens generated so far, the `stops` ids excluded while fewer than sp.min_tokens precede."""
    out: list[int] = []
    bias = torch.zeros(llm.config.vocab_size)
    for i, v in sp.logit_bias:
        bias[i] = v
    for _ in range(steps):
        logits = llm.score(prompt_ids + out)[-1]
        c = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        shifted = logits + (bias - sp.frequency_penalty * c - sp.presence_penalty * (c > 0).float())
        if len(out) < sp.min_tokens:
            shifted[sorted(stops)] = float("-inf")
        out.append(int(shifted.argmax()))
    return out


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_greedy_penalties_follow_the_openai_formula_in_every_method(llm, method):
    """Lossless: DDTree and DFlash with penalties give the tokens of the formula applied step by step."""
    sp = SamplingParams(
        max_tokens=14, stop_token_ids=[], frequency_penalty=1.5, presence_penalty=0.5, logit_bias={7: 2.5}
    )
    ids = llm.tokenizer.encode(PROMPT)
    want = greedy_by_hand(llm, ids, sp, 14)
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=14, stop_token_ids=[]), SpecConfig("ar"))[0]
    assert want != plain.token_ids  # the penalties change this continuation (else the test proves nothing)
    spec = SpecConfig(method, 6 if method == "ddtree" else None)
    assert llm.generate(PROMPT, sp, spec)[0].token_ids == want


# (checked by dropping the path counting: these cases then fail, where the tiny drafter's own drafts never
# exercise it, nor do oracle drafts at milder penalties: the choice must flip inside a path whose tokens
# compete)
ORACLE_CASES = [("x = [0, 0, 0, 0, 0, 0,", 1.5, 0.0), ("\n\n\n\n", 0.0, 1.0)]


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
@pytest.mark.parametrize("prompt,frequency,presence", ORACLE_CASES, ids=["frequency", "presence"])
def test_oracle_drafts_accepted_whole_need_each_nodes_path_counted(
    llm, monkeypatch, method, prompt, frequency, presence
):
    """Drafts replaced by the formula's own continuation: every step accepts a whole path, and where the
    choice flips inside one, the node must count the path's earlier tokens."""
    from k26.spec import step

    sp = SamplingParams(
        max_tokens=16, stop_token_ids=[], frequency_penalty=frequency, presence_penalty=presence
    )
    ids = llm.tokenizer.encode(prompt)
    L = llm.drafter.cfg.block_size - 1
    want = greedy_by_hand(llm, ids, sp, 16 + L + 1)
    real = step.draft_topk

    def oracle(target, drafter, dcache, rows, start, bonus, k, static=False):
        lp, tok = real(target, drafter, dcache, rows, start, bonus, k, static)
        for b in range(tok.shape[0]):
            g = int(start[b]) - len(ids)  # index in `want` of this row's root (the last emitted token)
            for d in range(L):
                t = want[g + 1 + d]
                others = [x for x in tok[b, d].tolist() if x != t][: k - 1]
                tok[b, d] = torch.tensor([t, *others])
                lp[b, d] = torch.linspace(-0.01, -5.0, k)
        return lp, tok

    monkeypatch.setattr(step, "draft_topk", oracle)
    depth = 6 if method == "ddtree" else L  # (budget 6: the oracle's chain is its best-first tree)
    out = llm.generate(prompt, sp, SpecConfig(method, 6 if method == "ddtree" else None))[0]
    assert out.token_ids == want[:16]
    assert max(out.stats.accepted_per_step) == depth + 1  # whole paths accepted


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_min_tokens_generates_through_a_forced_stop_id(llm, method):
    """A logit bias makes a stop id the greedy choice: the answer ends at once, and with min_tokens = 5 it
    is the formula's 5 tokens with the stop ids held back, then ends on the stop id — in AR and through
    DFlash's and DDTree's verify (lossless)."""
    stops = set(llm.tokenizer.stop_ids)
    forced = {"max_tokens": 12, "logit_bias": {min(stops): 100.0}}
    spec = SpecConfig(method, 6 if method == "ddtree" else None)
    assert llm.generate(PROMPT, SamplingParams(**forced), spec)[0].token_ids == []
    sp = SamplingParams(**forced, min_tokens=5)
    want = greedy_by_hand(llm, llm.tokenizer.encode(PROMPT), sp, 6, stops)
    assert not stops & set(want[:5]) and want[5] in stops
    out = llm.generate(PROMPT, sp, spec)[0]
    assert out.token_ids == want[:5] and out.finish_reason == "stop"


@pytest.mark.parametrize("least", [2, 6])
def test_min_tokens_holds_stop_strings_back(llm, least):
    """vLLM's min_tokens: stop strings are sought only once more than min_tokens tokens came, in the text
    after the min_tokens-th (here the stop string is the 2nd token's text: min_tokens = 2 lets it pass)."""
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=[]))[0]
    stop = llm.tokenizer.decode(plain.token_ids[1:2])
    assert stop.strip()  # (else the test proves nothing)
    early = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=[], stop=stop))[0]
    sp = SamplingParams(max_tokens=12, stop_token_ids=[], stop=stop, min_tokens=least)
    late = llm.generate(PROMPT, sp)[0]
    assert len(early.token_ids) <= 2 < len(late.token_ids) and len(late.token_ids) >= least
    assert late.token_ids == plain.token_ids[: len(late.token_ids)]


def test_a_stop_string_begun_within_min_tokens_ends_the_answer_once_it_ends_after_them(llm):
    """vLLM's rule: a stop string counts if it ends after the min_tokens-th token's text, wherever it began.
    Here it is tokens 2..4's text and min_tokens = 2: the answer stops at token 4, cut before token 2's text
    (it was never found: stop strings were sought only from that text's end on)."""
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=[]))[0]
    stop = llm.tokenizer.decode(plain.token_ids[1:4])
    head = llm.tokenizer.decode(plain.token_ids[:1])
    assert stop.strip() and plain.text.startswith(head + stop)  # (else the test proves nothing)
    sp = SamplingParams(max_tokens=12, stop_token_ids=[], stop=stop, min_tokens=2)
    out = llm.generate(PROMPT, sp)[0]
    assert out.finish_reason == "stop" and out.token_ids == plain.token_ids[:4] and out.text == head
    late = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=[], stop=stop, min_tokens=4))[0]
    assert late.finish_reason == "length"  # it ended with the 4th token: not after min_tokens = 4


def test_min_tokens_beyond_int32_and_stop_ids_outside_the_vocabulary(llm):
    """A min_tokens longer than any context is no overflow; a stop id outside the vocabulary is named
    before decoding."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2**40, min_tokens=2**33))[0]
    assert out.finish_reason == "length"
    with pytest.raises(ValueError, match="stop_token_ids: token id .* vocabulary"):
        llm.generate(PROMPT, SamplingParams(stop_token_ids=[llm.config.vocab_size], min_tokens=2))


def test_logit_bias_can_force_and_ban_a_token(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=4, stop_token_ids=[]), SpecConfig("ddtree", 6))[0]
    first = plain.token_ids[0]
    banned = SamplingParams(max_tokens=4, stop_token_ids=[], logit_bias={first: -100})
    assert first not in llm.generate(PROMPT, banned, SpecConfig("ddtree", 6))[0].token_ids
    forced = SamplingParams(max_tokens=4, stop_token_ids=[], logit_bias={42: 100})
    assert llm.generate(PROMPT, forced, SpecConfig("ddtree", 6))[0].token_ids == [42] * 4


def test_penalised_sampling_is_seeded_and_stays_in_the_vocabulary(llm):
    sp = SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=10, seed=9, stop_token_ids=[], presence_penalty=1.0
    )
    a = llm.generate(PROMPT, sp, SpecConfig("ddtree", 6))[0].token_ids
    assert a == llm.generate(PROMPT, sp, SpecConfig("ddtree", 6))[0].token_ids
    assert len(a) == 10 and all(0 <= t < llm.config.vocab_size for t in a)
    spec = SpecConfig("ddtree", 6)
    others = [llm.generate(PROMPT, replace(sp, seed=s), spec)[0].token_ids for s in (10, 11)]
    assert any(o != a for o in others)  # the seed, not a fixed stream, decides the tokens


def test_a_penalised_neighbour_and_a_reused_slot_change_nothing(llm):
    """Batch invariance: a row without penalties decodes as it does alone, beside a penalised row and in the
    slot a penalised request left (its counts and bias cleared on admission)."""
    plain = SamplingParams(max_tokens=8, stop_token_ids=[])
    pen = SamplingParams(max_tokens=8, stop_token_ids=[], frequency_penalty=2.0, logit_bias={3: 4.0})
    spec = SpecConfig("ddtree", 6)
    alone = llm.generate("import os\n", plain, spec)[0].token_ids
    pen_alone = llm.generate(PROMPT, pen, spec)[0].token_ids
    state = llm.open_batch(spec, 2)
    slots: list[int] = []
    try:
        ids = [llm.tokenizer.encode(p) for p in (PROMPT, "import os\n")]
        slots = llm.admit(ids, [pen, plain])
        while state.live:
            llm.step()
        assert [state.outs[s].token_ids for s in slots] == [pen_alone, alone]
        llm.release(slots[0])
        again = llm.admit([ids[1]], [plain])  # into the slot the penalised request held
        assert again == [slots[0]]
        while state.live:
            llm.step()
        assert state.outs[again[0]].token_ids == alone
    finally:
        for s in range(2):
            llm.release(s)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias"),
        ({"logit_bias": 3}, "logit_bias"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2.0}, "min_tokens"),
    ],
)
def test_bad_penalties_are_named(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_named_before_decoding(llm):
    with pytest.raises(ValueError, match="logit_bias: token id .* vocabulary"):
        llm.generate(PROMPT, SamplingParams(logit_bias={llm.config.vocab_size: 1.0}))


def test_a_tiny_temperature_samples_the_argmax_not_nan(llm):
    """logits / 1e-40 overflowed to inf (NaN probabilities, token 0): shifted to a maximum of 0 first, a tiny
    temperature is greedy in the limit."""
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=6, stop_token_ids=[]), SpecConfig("ar"))[0]
    for top_p in (1.0, 0.9):
        sp = SamplingParams(temperature=1e-40, top_p=top_p, max_tokens=6, seed=1, stop_token_ids=[])
        assert llm.generate(PROMPT, sp, SpecConfig("ar"))[0].token_ids == greedy.token_ids
