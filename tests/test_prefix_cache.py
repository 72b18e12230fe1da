"""The prefix cache's bookkeeping (k26/prefix_cache.py) on its own: which row a prompt goes to, what of it
is cached there or copied from where, in which prefill wave, and the parking row of idle slots."""

import random

from k26.prefix_cache import MIN_WAVE_TOKENS, PrefixCache, Reuse, cached_tokens, common_prefix


def naive_common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_equals_a_token_by_token_walk():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 1200))]
        cut = rng.randrange(0, len(a) + 1)
        b = a[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 700))]
        assert common_prefix(a, b) == naive_common_prefix(a, b) == common_prefix(b, a)


def cache_holding(rows: int, held: dict[int, list[int]]) -> PrefixCache:
    pc = PrefixCache(rows)
    for slot, tokens in held.items():
        pc.admitted(slot)
        pc.released(slot, tokens)
    return pc


def test_a_prompt_goes_to_the_free_row_holding_most_of_it():
    a, b = list(range(100)), list(range(500, 600))
    pc = cache_holding(3, {0: b, 1: a[:70], 2: a + [7, 7]})
    plan = pc.plan([a + [1, 2, 3]], [0, 1, 2], {})
    assert plan == [Reuse(2, 100, None, 100, 0)]


def test_the_last_prompt_token_is_always_prefilled():
    a = list(range(40))
    pc = cache_holding(2, {1: a + [9]})
    assert pc.plan([a], [0, 1], {}) == [Reuse(1, 39, None, 39, 0)]


def test_an_occupied_rows_prefix_is_copied_into_a_free_row():
    """Row 0 holds a live request (its prompt and output so far); a new prompt sharing 80 tokens of it
    takes free row 1 and copies from row 0 what row 1 does not hold already."""
    shared = list(range(80))
    pc = cache_holding(3, {1: shared[:30] + [999], 2: [5, 5, 5]})
    plan = pc.plan([shared + [1, 2]], [1, 2], held={0: shared + [4, 4, 4]})
    assert plan == [Reuse(1, 80, 0, 30, 0)]


def test_an_unrelated_prompt_takes_the_row_holding_least():
    pc = cache_holding(3, {0: list(range(300)), 1: list(range(10)), 2: list(range(50))})
    assert pc.plan([[7, 8, 9]], [0, 1, 2], {})[0].slot == 1


def test_equal_rows_are_given_up_oldest_freed_first():
    pc = cache_holding(3, {2: [1], 0: [2], 1: [3]})  # freed in the order 2, 0, 1
    assert [r.slot for r in pc.plan([[7], [8]], [0, 1, 2], {})] == [2, 0]


def test_copies_of_one_prompt_in_one_call_wait_one_wave_for_the_first():
    """n choices of a long prompt: the first is prefilled, the others copy it after that wave."""
    p = list(range(200))
    plans = PrefixCache(4, min_wave=64).plan([p, p, p], [0, 1, 2, 3], {})
    assert plans[0] == Reuse(plans[0].slot, 0, None, 0, 0)
    for r in plans[1:]:
        assert r.keep == 199 and r.wave == 1 and r.src in {x.slot for x in plans} - {r.slot}


def test_a_same_call_source_worth_less_than_a_wave_is_not_waited_for():
    p = list(range(MIN_WAVE_TOKENS - 2))
    plans = PrefixCache(2).plan([p, p], [0, 1], {})
    assert [(r.keep, r.wave, r.src) for r in plans] == [(0, 0, None), (0, 0, None)]


def test_a_cached_part_of_a_row_planned_in_the_same_call_is_copied_in_its_wave():
    """Prompt 0 takes row 0, which holds 100 tokens of it; prompt 1 shares those 100 and copies them in the
    same wave (after row 0's own copy, none here), without waiting for prompt 0's prefill."""
    base = list(range(100))
    pc = cache_holding(2, {0: base})
    plans = pc.plan([base + [1] * 50, base + [2] * 50], [0, 1], {})
    assert plans == [Reuse(0, 100, None, 100, 0), Reuse(1, 100, 0, 0, 0)]


def test_a_source_not_worth_a_wave_still_gives_what_it_holds_now():
    """Two prompts extend row 0's 100 tokens by 20 each, the second sharing the first's: it copies the 100
    row 0 holds now rather than wait a wave for 20 more."""
    base, ext = list(range(100)), list(range(500, 520))
    pc = cache_holding(2, {0: base})
    plans = pc.plan([base + ext + [1], base + ext + [2]], [0, 1], {})
    assert plans == [Reuse(0, 100, None, 100, 0), Reuse(1, 100, 0, 0, 0)]


def test_prompts_asking_for_prompt_logprobs_or_not_prefilled_reuse_nothing():
    """Prompt 0 wants prompt logprobs (every position runs) and prompt 1 is not prefilled: neither takes
    the row holding 90 tokens of them; prompt 2 does, and keeps them."""
    a = list(range(90))
    pc = cache_holding(3, {0: a})
    plans = pc.plan([a + [1], None, a + [2]], [0, 1, 2], {}, reuse=[False, True, True])
    assert [(r.keep, r.src) for r in plans[:2]] == [(0, None), (0, None)]
    assert 0 not in (plans[0].slot, plans[1].slot)
    assert plans[2] == Reuse(0, 90, None, 90, 0)


def test_a_disabled_cache_plans_whole_prefills():
    a = list(range(90))
    pc = cache_holding(2, {0: a})
    pc.enabled = False
    assert [r.keep for r in pc.plan([a + [1], a + [2]], [0, 1], {0: a})] == [0, 0]


def test_idle_slots_park_in_a_free_row_holding_least_and_stay_there():
    pc = cache_holding(4, {1: list(range(50)), 2: [1, 2], 3: list(range(9))})
    assert pc.park(idle=[0, 1, 2, 3], free=[1, 2, 3]) == 2
    assert pc.known[2] == [1, 2]  # kept: the batch saves the row's head meanwhile (kv_cache.HeadStash)
    assert pc.park(idle=[1, 2, 3], free=[1, 2, 3]) == 2  # it stays while idle
    pc.admitted(3)
    pc.released(3, [])  # row 3 now holds least: the parked row stays anyway (its head is stashed)
    assert pc.park(idle=[1, 2, 3], free=[1, 2, 3]) == 2
    pc.admitted(2)
    assert pc.park(idle=[1, 3], free=[1, 3]) == 3
    assert pc.park(idle=[0], free=[]) == 0  # finished, not yet released: still a place to park
    assert pc.park(idle=[], free=[]) is None


def test_a_row_holds_its_prompt_and_every_output_token_but_the_last():
    assert cached_tokens([1, 2], [3, 4, 5]) == [1, 2, 3, 4]
    assert cached_tokens([1, 2], []) == [1, 2]
