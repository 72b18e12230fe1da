"""Cost-aware adaptive budget: prefix property, the selection rule, calibration, exploration, losslessness."""

import pytest
import torch
from oracles import random_prompts

import k26.spec.step as step_mod
from k26 import SamplingParams, SpecConfig
from k26.spec.budget import BudgetPolicy, fit_costs, timing_contexts, truncate_tree
from k26.spec.tree import build_ddtree


def lp(seed, sharp):
    return torch.log_softmax(
        torch.randn(2, 7, 300, generator=torch.Generator().manual_seed(seed)) * sharp, -1
    )


@pytest.mark.parametrize("small", [1, 3, 7, 15])
def test_smaller_budget_tree_is_a_prefix(small):
    x = lp(small, 3.0)
    a, b = truncate_tree(build_ddtree(x, 31), small), build_ddtree(x, small)
    for f in ("tokens", "parents", "depths", "valid", "words"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_equal_costs_and_confident_drafts_pick_the_largest():
    pol = BudgetPolicy.create((3, 7, 15, 31), 0.0, (1.0, 1.0, 1.0, 1.0), "cpu", warmup=0)
    assert int(pol.choose(build_ddtree(lp(0, 30.0), 31))) == 3


def test_dominant_verify_cost_picks_the_smallest():
    pol = BudgetPolicy.create((3, 7, 15, 31), 0.001, (1.0, 2.0, 4.0, 8.0), "cpu", warmup=0)
    assert int(pol.choose(build_ddtree(lp(0, 1.0), 31))) == 0


def chain_path(accepted: torch.Tensor, J: int = 8) -> torch.Tensor:
    """Accepted node indices for `accepted` drafts along nodes 1, 2, ...: root first, -1 past the end."""
    j = torch.arange(J)
    return torch.where(j <= accepted[:, None], j, -1)


def test_calibration_follows_observed_acceptance():
    """Confident drafts that are never accepted stop buying big trees; weak drafts that are always accepted
    start buying them."""
    ones = torch.ones(2, dtype=torch.bool)
    costs = (1.0, 1.2, 1.5, 2.0)
    tree = build_ddtree(lp(1, 30.0), 31)  # confident: the raw marginals promise a long accepted chain
    over = BudgetPolicy.create((3, 7, 15, 31), 0.0, costs, "cpu", warmup=0, explore_every=0)
    assert int(over.choose(tree)) > 0
    for _ in range(20):
        acc = torch.zeros(2, dtype=torch.long)
        over.update(tree, torch.tensor(3), acc, ones, chain_path(acc))
    assert over.expected(tree)[:, -1].max() < 0.3 and int(over.choose(tree)) == 0
    weak = build_ddtree(lp(1, 0.3), 31)
    under = BudgetPolicy.create((3, 7, 15, 31), 0.0, costs, "cpu", warmup=0, explore_every=0)
    assert int(under.choose(weak)) == 0
    for _ in range(20):
        acc = torch.full((2,), 7)
        under.update(weak, torch.tensor(3), acc, ones, chain_path(acc))
    assert int(under.choose(weak)) == 1  # nodes 1..7 are the accepted chain, the rest never pays


def test_long_context_buys_smaller_trees():
    """Same tree, same calibration: the per-token cost (tree attention reads the whole cache per node)
    moves the choice from the largest candidate at short context to the smallest at long context."""
    tree = build_ddtree(lp(0, 3.0), 31)
    pol = BudgetPolicy.create(
        (3, 7, 15, 31), 0.0, (1.0, 1.0, 1.0, 1.0), "cpu", per_token=(0.0, 1e-3, 2e-3, 4e-3), warmup=0
    )
    alive = torch.ones(2, dtype=torch.bool)
    assert int(pol.choose(tree, alive, torch.tensor([0, 0]))) == 3
    assert int(pol.choose(tree, alive, torch.tensor([4000, 4000]))) == 0
    # a finished row's length does not count
    assert int(pol.choose(tree, torch.tensor([True, False]), torch.tensor([0, 100000]))) == 3
    acc = torch.ones(2, dtype=torch.long)
    pol.update(tree, torch.tensor(3), acc, alive, chain_path(acc), torch.tensor([1000, 3000]))
    assert pol.seconds.item() == pytest.approx(1.0 + 4e-3 * 2000)  # charged at the mean live length


def test_measured_costs_have_a_context_slope(tiny_k25):
    from k26 import LLM
    from k26.tiny import write_tiny_drafter

    d = write_tiny_drafter(tiny_k25.parent / "slope-drafter", tiny_k25, layers=1, seed=3)
    llm = LLM(
        tiny_k25, drafter=d, device="cpu", dtype=torch.float32, progress=False, max_batch=1, max_model_len=512
    )
    spec = SpecConfig("ddtree", "auto", candidates=(3, 15))
    budgets, seen = llm.decoder.budgets, []
    calibrate = budgets.calibrate

    def recording(spec, batch, time_at, ats, **kw):
        seen.append(tuple(ats))
        return calibrate(spec, batch, time_at, ats, **kw)

    budgets.calibrate = recording
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop_token_ids=[]), spec)
    pol = llm.decoder.policies[(spec, 1)]
    assert min(pol.t_verify) > 0
    assert pol.cost.tolist() != [1.0, 1.0]  # measured, not the placeholders
    # 512 tokens leave room for a short and a long timing context: the costs are timed at both (the line
    # through them is the slope; fit_costs' own test below checks the fit)
    ats = timing_contexts(512, 15, llm.drafter.cfg.block_size)
    assert len(ats) == 2 and seen == [tuple(ats)]


def test_fitted_costs_follow_the_context_slope():
    """Timings at a short and a long context give each candidate the line through them; a candidate timed
    faster at the long context (noise) gets no negative slope but its short-context cost."""
    ats = (16, 400)
    t = torch.tensor([[1e-3, 2e-3, 5e-3], [1e-3 + 384e-6, 2e-3 + 768e-7, 4e-3]])
    cost, slope = fit_costs(t, ats)
    assert slope == pytest.approx([1e-6, 2e-7, 0.0])
    assert cost == pytest.approx([1e-3 - 16e-6, 2e-3 - 32e-7, 5e-3])
    assert fit_costs(t[:1], ats[:1])[1] == [0.0, 0.0, 0.0]  # one context: flat


def test_bad_budget_configs():
    with pytest.raises(ValueError, match="cost_per_token"):
        SpecConfig("ddtree", "auto", candidates=(3, 7), costs=(0.0, 1.0, 1.0), cost_per_token=(1e-6,))
    with pytest.raises(ValueError, match="cost_per_token"):
        SpecConfig("ddtree", "auto", candidates=(3, 7), cost_per_token=(1e-6, 1e-6))
    with pytest.raises(ValueError, match="per-token"):
        BudgetPolicy.create((3, 7), 0.0, (1.0, 1.0), "cpu", per_token=(-1.0, 0.0))
    with pytest.raises(ValueError, match="candidates"):
        SpecConfig("ddtree", "auto", candidates=(7, 3))
    with pytest.raises(ValueError, match="costs"):
        SpecConfig("ddtree", "auto", costs=(0.1, 0.2))
    with pytest.raises(ValueError, match="budget='many'"):
        SpecConfig("ddtree", "many")


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"budget": True}, "budget=True"),  # (a bool is an int to Python: it reached topk as k=True)
        ({"candidates": (True, 7)}, "candidates"),
        ({"candidates": (3.5, 7)}, "candidates"),
        ({"costs": ("a",) * 5}, "costs"),
        ({"costs": (0.0, float("nan"), 1.0, 1.0, 1.0)}, "costs"),
        ({"costs": (0.0, 1.0, 1.0, 1.0, 0.0)}, "costs"),
        ({"costs": (0.0,) + (1.0,) * 4, "cost_per_token": (float("inf"), 0.0, 0.0, 0.0)}, "cost_per_token"),
    ],
)
def test_spec_config_values_of_the_wrong_kind_are_named(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SpecConfig("ddtree", **kw)


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_a_budget_for_a_method_without_one_is_refused_not_ignored(method):
    with pytest.raises(ValueError, match=f"budget=5: a budget is DDTree's; '{method}'"):
        SpecConfig(method, 5)
    assert SpecConfig(method).budget == "auto" and SpecConfig(method, None).budget is None


@pytest.mark.parametrize("costs", [(0.0, 1.0, 1.0, 1.0, 1.0), (0.0, 1.0, 3.0, 9.0, 27.0)])
def test_auto_is_lossless(tiny_k25, costs, monkeypatch):
    from test_spec import as_topk, oracle_draft

    from k26 import LLM
    from k26.tiny import write_tiny_drafter

    d = write_tiny_drafter(tiny_k25.parent / "auto-drafter", tiny_k25, layers=1, seed=3)
    llm = LLM(
        tiny_k25, drafter=d, device="cpu", dtype=torch.float32, progress=False, max_batch=4, max_model_len=256
    )
    prompts = random_prompts(4, 2, 20, seed=7)
    sp = SamplingParams(max_tokens=20, stop_token_ids=[])
    ar = llm.generate(prompts, sp, SpecConfig("ar"))
    ref = {b: p + a.token_ids for b, (p, a) in enumerate(zip(prompts, ar))}
    monkeypatch.setattr(step_mod, "draft_topk", as_topk(oracle_draft(ref, noise=0.3, seed=1)))
    out = llm.generate(prompts, sp, SpecConfig("ddtree", "auto", costs=costs))
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    pol = next(iter(llm.decoder.policies.values()))  # the policy was built and chose every step
    assert int(pol.steps) == max(o.stats.steps for o in out)
    assert {b for o in out for b in o.stats.budgets} <= set(SpecConfig("ddtree", "auto").candidates)


def feed_twice_the_mass(pol: BudgetPolicy, steps: int = 300) -> torch.Tensor:
    """Steps on random trees whose candidates 0 and 1 accept ~2x the drafter's mass of their nodes (the
    sums only count path nodes per prefix: candidate 0's on nodes 1.., candidate 1's on nodes 4..).
    Returns the increments f [steps * 2, 2] of those candidates."""
    gen = torch.Generator().manual_seed(0)
    fs = []
    for i in range(steps):
        tree = build_ddtree(lp(10 + i, 0.5 + 5 * torch.rand((), generator=gen).item()), 15)
        f = pol._increments(tree)
        fs.append(f[:, :2])
        y = (2 * f[:, :2] + torch.rand(2, 2, generator=gen) - 0.5).round().clamp(0, 3).long()  # E[y] ~ 2 f
        path = torch.full((2, 9), -1)
        path[:, 0] = 0
        for r in range(2):
            nodes = list(range(1, 1 + y[r, 0])) + list(range(4, 4 + y[r, 1]))
            path[r, 1 : 1 + len(nodes)] = torch.tensor(nodes, dtype=torch.long)
        pol.update(tree, torch.tensor(1), y.sum(1), torch.ones(2, dtype=torch.bool), path)
    return torch.cat(fs)


def test_increments_learn_their_slope():
    """Accepted increments twice the drafter's mass: the fitted increments of the verified candidates land
    near 2 f (much nearer than the raw marginals), and the never-verified candidate keeps its prior."""
    pol = BudgetPolicy.create((3, 7, 15), 0.0, (1.0, 1.0, 1.0), "cpu")
    f = feed_twice_the_mass(pol)
    a, b = pol.coefficients()
    assert abs(a[2]) < 1e-6 and abs(b[2] - 1) < 1e-6  # never verified: the raw marginals
    assert (a[:2] + b[:2] * f - 2 * f).abs().mean() < 0.3 * f.abs().mean(), (a, b)


def test_lagged_fit_learns_that_the_previous_tree_says_little():
    """Graphs choose the next step's bucket from this step's tree. With independent trees the lagged fit
    finds (almost) no slope — it predicts the mean — while the same-step fit finds the true one."""
    pol = BudgetPolicy.create((3, 7, 15), 0.0, (1.0, 1.0, 1.0), "cpu", rows=2, lagged=True)
    f = feed_twice_the_mass(pol)
    _, b_now = pol.coefficients()
    a_lag, b_lag = pol.coefficients(lagged=True)
    assert (b_now[:2] > 1.3).all() and (b_lag[:2].abs() < 0.5).all(), (b_now, b_lag)
    assert ((a_lag[:2] + b_lag[:2] * f.mean(0)) - 2 * f.mean(0)).abs().max() < 0.3  # the mean increment
    pol.reset()
    assert (pol.prev_f < 0).all() and pol.lag_stats.abs().sum() == 0


def test_only_verified_candidates_are_calibrated():
    tree = build_ddtree(lp(4, 2.0), 31)
    pol = BudgetPolicy.create((3, 7, 15, 31), 0.0, (1.0, 1.0, 1.0, 1.0), "cpu")
    acc = torch.ones(2, dtype=torch.long)
    pol.update(tree, torch.tensor(1), acc, torch.tensor([True, False]), chain_path(acc))
    assert pol.stats[:2, 0].tolist() == [1.0, 1.0] and pol.stats[2:].abs().sum() == 0
    assert pol.stats[0, 2] == 1 and pol.stats[1, 2] == 0  # node 1 lies in candidate 0's prefix


def test_warmup_and_exploration_verify_the_largest():
    tree = build_ddtree(lp(0, 1.0), 31)
    pol = BudgetPolicy.create((3, 7, 15, 31), 0.001, (1.0, 2.0, 4.0, 8.0), "cpu", warmup=2, explore_every=5)
    picks = []
    for _ in range(10):
        picks.append(int(pol.choose(tree)))
        acc = torch.zeros(2, dtype=torch.long)
        pol.update(tree, torch.tensor(picks[-1]), acc, torch.ones(2, dtype=torch.bool), chain_path(acc))
    assert picks == [3, 3, 0, 0, 3, 0, 0, 0, 0, 3]


def test_long_run_rate_buys_a_bigger_tree_when_it_pays():
    """Ratio rule vs long-run rule: once the policy earns R tokens/s, a bigger tree whose extra tokens cost
    less than R is worth taking even though its own ratio is lower."""
    tree = build_ddtree(lp(0, 3.0), 31)
    pol = BudgetPolicy.create((3, 31), 0.0, (1.0, 2.0), "cpu", warmup=0)
    gain = 1 + pol.expected(tree).sum(0)
    assert int((gain / pol.cost).argmax()) == 0 and int(pol.choose(tree)) == 0  # no history: the ratio rule
    pol.tokens.fill_(1.0)  # a low long-run rate: 1 token per 1e6 s
    pol.seconds.fill_(1e6)
    assert int(pol.choose(tree)) == int(gain.argmax()) == 1


def test_an_admitted_row_does_not_inherit_its_slots_previous_masses():
    """Lagged fit (graphs): a request admitted into a slot must not pair the slot's former row's tree
    masses with its own first accepted increments; the other rows keep theirs."""
    tree, path = build_ddtree(lp(5, 2.0), 15), chain_path(torch.tensor([2, 1]))
    alive, acc = torch.ones(2, dtype=torch.bool), torch.tensor([2, 1])

    def step_after_admission(admit: list[int]) -> torch.Tensor:
        pol = BudgetPolicy.create((3, 7, 15), 0.0, (1.0, 1.0, 1.0), "cpu", rows=2, lagged=True)
        pol.update(tree, torch.tensor(2), acc, alive, path)  # both slots' former rows
        pol.admit(admit)
        before = pol.lag_stats.clone()
        pol.update(tree, torch.tensor(2), acc, alive, path)
        return pol.lag_stats - before * (1 - pol.decay)  # what this step added

    both, fresh_0 = step_after_admission([]), step_after_admission([0])
    assert both[:, 0].tolist() == [2.0, 2.0, 2.0] and fresh_0[:, 0].tolist() == [1.0, 1.0, 1.0]


def test_the_decoder_tells_the_policy_which_slots_it_admits(tiny_k25, drafter_dir):
    from k26 import LLM

    llm = LLM(tiny_k25, drafter=drafter_dir, device="cpu", dtype=torch.float32, progress=False, max_batch=2)
    state = llm.decoder.open(SpecConfig("ddtree", "auto", costs=(0.0, 1.0, 1.0, 1.0, 1.0)), 2)
    state.policy.prev_f.fill_(0.5)  # masses of the slots' former rows
    llm.decoder.admit(state, [[5, 6, 7]], [SamplingParams(max_tokens=4)])
    assert state.policy.prev_f[0].tolist() == [-1.0] * 4 and state.policy.prev_f[1].tolist() == [0.5] * 4


def test_compiled_policy_compiles_once_for_every_batch_size_past_the_first():
    """Under graphs the policy's choose / update are compiled: one version for batch 1 and one symbolic in
    the batch for all larger ones (a static version per batch size cost most of a DDTree bucket set's
    capture time), with the same choices as the eager policy."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    for B in (1, 2, 4):
        picks = []
        for compiled in (False, True):
            pol = BudgetPolicy.create(
                (3, 7, 15, 31), 0.001, (1.0, 2.0, 4.0, 8.0), "cpu", rows=B, compiled=compiled, lagged=True
            )
            tree = build_ddtree(torch.randn(B, 7, 300, generator=torch.Generator().manual_seed(B)), 31)
            alive = torch.ones(B, dtype=torch.bool)
            choice = pol.choose(tree, alive)
            path = torch.full((B, 8), -1, dtype=torch.long)
            path[:, 0] = 0
            pol.update(tree, choice, torch.zeros(B, dtype=torch.long), alive, path)
            picks.append((int(choice), pol.stats.clone(), float(pol.tokens)))
        assert picks[0][0] == picks[1][0] and picks[0][2] == picks[1][2]
        torch.testing.assert_close(picks[0][1], picks[1][1])
    assert dynamo_utils.counters["stats"]["unique_graphs"] - before == 4  # 2 functions x (batch 1, symbolic)


def test_a_row_idle_in_a_step_leaves_no_masses_for_the_lagged_fit():
    """Lagged fit (graphs): a slot admitted with a deferred prefill (the server's) is idle for the steps its
    prompt takes (parked, drafting garbage at position 0); its first live step must not pair the masses of
    those idle trees with its own first accepted increments, as `admit` ensures for the slot's former row."""
    tree, path = build_ddtree(lp(5, 2.0), 15), chain_path(torch.tensor([2, 1]))
    acc = torch.tensor([2, 1])
    pol = BudgetPolicy.create((3, 7, 15), 0.0, (1.0, 1.0, 1.0), "cpu", rows=2, lagged=True)
    pol.admit([0, 1])
    pol.update(tree, torch.tensor(2), acc, torch.tensor([True, False]), path)  # slot 1 still prefilling
    assert pol.prev_f[1].tolist() == [-1.0] * 3
    before = pol.lag_stats.clone()
    pol.update(tree, torch.tensor(2), acc, torch.ones(2, dtype=torch.bool), path)  # slot 1's first live step
    added = pol.lag_stats - before * (1 - pol.decay)
    assert added[:, 0].tolist() == [1.0, 1.0, 1.0]  # slot 0's pair only


def test_a_deferred_prefill_keeps_its_slot_out_of_the_lagged_fit(tiny_k25, drafter_dir):
    """The decoder's side of the above: while a long prompt prefills between steps, the policy holds no
    previous masses for its slot (the eager policy made lagged, as the graphs' is)."""
    from k26 import LLM

    llm = LLM(
        tiny_k25,
        drafter=drafter_dir,
        device="cpu",
        dtype=torch.float32,
        progress=False,
        max_batch=2,
        prefill_chunk=8,
        prefill_budget=8,
    )
    state = llm.decoder.open(SpecConfig("ddtree", "auto", costs=(0.0, 1.0, 1.0, 1.0, 1.0)), 2)
    state.policy.lagged = True
    sp = SamplingParams(max_tokens=20, stop_token_ids=[])
    (s0,) = llm.decoder.admit(state, [[5, 6, 7]], [sp])
    (s1,) = llm.decoder.admit(state, [list(range(3, 43))], [sp], wait=False)
    llm.decoder.step(state)
    assert s0 in state.live and s1 not in state.live  # the long prompt still prefilling
    assert state.policy.prev_f[s1].tolist() == [-1.0] * 4 and (state.policy.prev_f[s0] >= 0).all()


def test_a_step_with_no_live_row_teaches_the_policy_nothing(tiny_k25, drafter_dir):
    """Graph capture runs the step body twice per bucket and sampling mode on the batch's scratch state, no
    row live (a decode step never runs without one): the policy, which costs given in the SpecConfig never
    reset afterwards and a later capture of another mode reaches mid-run, must come out of it unchanged —
    such a step charged its cost for no token (the long-run rate fell), decayed the calibration and
    advanced the warm-up / exploration count."""
    from k26 import LLM
    from k26.graphs import Bucket
    from k26.graphs.runner import StepState
    from k26.graphs.stepper import graph_step

    tree, path = build_ddtree(lp(5, 2.0), 15), chain_path(torch.tensor([2, 1]))
    pol = BudgetPolicy.create((3, 7, 15), 0.0, (1.0, 2.0, 3.0), "cpu", rows=2, lagged=True)
    for _ in range(3):
        pol.update(tree, torch.tensor(2), torch.tensor([2, 1]), torch.ones(2, dtype=torch.bool), path)
    fields = ("stats", "lag_stats", "prev_f", "tokens", "seconds", "steps")
    before = {f: getattr(pol, f).clone() for f in fields}
    pol.update(tree, torch.tensor(2), torch.tensor([2, 1]), torch.zeros(2, dtype=torch.bool), path)
    for f in ("stats", "lag_stats", "tokens", "seconds", "steps"):
        assert torch.equal(getattr(pol, f), before[f]), f
    # the captured body itself, run eagerly on a fresh (scratch) state as a warm-up runs it
    llm = LLM(tiny_k25, drafter=drafter_dir, device="cpu", dtype=torch.float32, progress=False, max_batch=2)
    spec = SpecConfig("ddtree", "auto", candidates=(3, 7), costs=(0.0, 1.0, 2.0))
    pol = BudgetPolicy.create(spec.candidates, 0.0, (1.0, 2.0), "cpu", rows=2, lagged=True)
    bucket = Bucket(2, 8)
    state = StepState.allocate(bucket, llm.drafter.cfg.block_size, "cpu")
    with torch.inference_mode():
        graph_step(llm.decoder.ctx.models(), spec, "greedy", lambda b: pol)(state, bucket)
    assert int(pol.steps) == 0 and float(pol.seconds) == 0.0 and pol.stats.abs().sum() == 0


@pytest.mark.parametrize(
    "spec, want",
    [
        (SpecConfig("dflash"), None),
        (SpecConfig("ar"), None),
        (SpecConfig("ddtree", 6), 6),
        (SpecConfig(), None),
    ],
)
def test_graph_batches_report_the_budgets_the_eager_step_reports(cpu_pair, spec, want):
    """Graph decoding reported each bucket's width less one as the step's budget: a DFlash step 15 (eager:
    none), a fixed budget 12 padded to a user bucket of 16 nodes 15. Its per-bucket rule is the eager one."""
    from k26.spec.step import reported_budgets

    sp = SamplingParams(max_tokens=8, stop_token_ids=[])
    out = cpu_pair(max_batch=1).generate([[1, 2, 3, 4, 5]], sp, spec)[0]
    if spec.auto:
        assert reported_budgets(spec) == list(spec.candidates)
        assert out.stats.budgets and set(out.stats.budgets) <= set(spec.candidates)
    else:
        assert reported_budgets(spec) == [want]
        assert out.stats.budgets == ([] if want is None else [want] * len(out.stats.budgets))
        assert (want is None) == (not out.stats.budgets)
