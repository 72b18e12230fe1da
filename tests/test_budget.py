"""Cost-aware adaptive budget: prefix property, the selection rule, calibration, losslessness."""

import pytest
import torch
from oracles import random_prompts

import k26.spec.step as step_mod
from k26 import SamplingParams, SpecConfig
from k26.spec.budget import BudgetPolicy, truncate_tree
from k26.spec.tree import build_ddtree


def lp(seed, sharp):
    return torch.log_softmax(torch.randn(2, 7, 300, generator=torch.Generator().manual_seed(seed)) * sharp, -1)


@pytest.mark.parametrize("small", [1, 3, 7, 15])
def test_smaller_budget_tree_is_a_prefix(small):
    x = lp(small, 3.0)
    a, b = truncate_tree(build_ddtree(x, 31), small), build_ddtree(x, small)
    for f in ("tokens", "parents", "depths", "valid", "words"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_equal_costs_and_confident_drafts_pick_the_largest():
    pol = BudgetPolicy.create((3, 7, 15, 31), 0.0, (1.0, 1.0, 1.0, 1.0), "cpu")
    assert int(pol.choose(build_ddtree(lp(0, 30.0), 31))) == 3


def test_dominant_verify_cost_picks_the_smallest():
    pol = BudgetPolicy.create((3, 7, 15, 31), 0.001, (1.0, 2.0, 4.0, 8.0), "cpu")
    assert int(pol.choose(build_ddtree(lp(0, 1.0), 31))) == 0


def chain_path(accepted: torch.Tensor, J: int = 8) -> torch.Tensor:
    """Accepted node indices for `accepted` drafts along nodes 1, 2, ...: root first, -1 past the end."""
    j = torch.arange(J)
    return torch.where(j <= accepted[:, None], j, -1)


def test_calibration_follows_observed_acceptance():
    tree = build_ddtree(lp(1, 30.0), 31)  # confident: predicts long acceptance
    over = BudgetPolicy.create((3, 7, 15, 31), 0.0, (1.0, 1.0, 1.0, 1.0), "cpu")
    for _ in range(20):
        acc = torch.zeros(2, dtype=torch.long)
        over.update(tree, torch.tensor(3), acc, torch.ones(2, dtype=torch.bool), chain_path(acc))
    assert over.log_k[0].item() > 0.1  # over-confident drafter: q(u)^k with k > 1 shrinks the estimates
    under = BudgetPolicy.create((3, 7, 15, 31), 0.0, (1.0, 1.0, 1.0, 1.0), "cpu")
    weak = build_ddtree(lp(1, 0.3), 31)
    for _ in range(20):
        acc = torch.full((2,), 7)
        under.update(weak, torch.tensor(3), acc, torch.ones(2, dtype=torch.bool), chain_path(acc))
    assert under.log_k[0].item() < -0.1


def test_bad_budget_configs():
    with pytest.raises(ValueError, match="candidates"):
        SpecConfig("ddtree", "auto", candidates=(7, 3))
    with pytest.raises(ValueError, match="costs"):
        SpecConfig("ddtree", "auto", costs=(0.1, 0.2))
    with pytest.raises(ValueError, match="budget='many'"):
        SpecConfig("ddtree", "many")


@pytest.mark.parametrize("costs", [(0.0, 1.0, 1.0, 1.0, 1.0), (0.0, 1.0, 3.0, 9.0, 27.0)])
def test_auto_is_lossless(tiny_k25, costs, monkeypatch):
    from test_spec import as_topk, oracle_draft

    from k26 import LLM
    from k26.tiny import write_tiny_drafter

    d = write_tiny_drafter(tiny_k25.parent / "auto-drafter", tiny_k25, layers=1, seed=3)
    llm = LLM(tiny_k25, drafter=d, device="cpu", dtype=torch.float32, progress=False, max_batch=4, max_model_len=256)
    prompts = random_prompts(4, 2, 20, seed=7)
    sp = SamplingParams(max_tokens=20, stop_token_ids=[])
    ar = llm.generate(prompts, sp, SpecConfig("ar"))
    ref = {b: p + a.token_ids for b, (p, a) in enumerate(zip(prompts, ar))}
    monkeypatch.setattr(step_mod, "draft_topk", as_topk(oracle_draft(ref, noise=0.3, seed=1)))
    out = llm.generate(prompts, sp, SpecConfig("ddtree", "auto", costs=costs))
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    assert llm.decoder.policies  # the policy was built and used


def test_calibration_is_per_depth():
    """Right at depth 1, over-confident deeper: k_1 stays put while the deeper exponents grow."""
    tree = build_ddtree(lp(2, 3.0), 31)
    pol = BudgetPolicy.create((3, 7, 15, 31), 0.0, (1.0, 1.0, 1.0, 1.0), "cpu")
    for _ in range(200):
        q = pol._q(tree)
        d1 = (q * (tree.depths[:, 1:] == 1)).sum(1)  # predicted P(accept >= 1) per row
        obs = (torch.rand(2, generator=torch.Generator().manual_seed(_)) < d1).long()  # depth 1 as predicted
        pol.update(tree, torch.tensor(3), obs, torch.ones(2, dtype=torch.bool), chain_path(obs))
    assert abs(pol.log_k[0].item()) < 0.3 < pol.log_k[2].item()


def test_node_multipliers_track_observed_hits():
    """Node 1 always accepted, every other node never: c_1 rises towards 1 / q_1, the rest fall."""
    tree = build_ddtree(lp(3, 2.0), 15)
    pol = BudgetPolicy.create((3, 15), 0.0, (1.0, 1.0), "cpu")
    q = pol._q(tree)
    for _ in range(100):
        acc = torch.ones(2, dtype=torch.long)
        path = torch.tensor([[0, 1, -1, -1, -1, -1, -1, -1]] * 2)
        pol.update(tree, torch.tensor(1), acc, torch.ones(2, dtype=torch.bool), path)
    p = pol._p(pol._q(tree))
    assert (p[:, 0] > q[:, 0]).all() and p[:, 1:].sum() < 0.4 * q[:, 1:].sum()


def test_long_run_rate_buys_a_bigger_tree_when_it_pays():
    """Ratio rule vs long-run rule: once the policy earns R tokens/s, a bigger tree whose extra tokens cost
    less than R is worth taking even though its own ratio is lower."""
    tree = build_ddtree(lp(0, 3.0), 31)
    pol = BudgetPolicy.create((3, 31), 0.0, (1.0, 2.0), "cpu")
    gain = 1 + pol.expected(tree).sum(0)
    assert int((gain / pol.cost).argmax()) == 0 and int(pol.choose(tree)) == 0  # no history: the ratio rule
    pol.tokens.fill_(1.0)  # a low long-run rate: 1 token per 1e6 s
    pol.seconds.fill_(1e6)
    assert int(pol.choose(tree)) == int(gain.argmax()) == 1
