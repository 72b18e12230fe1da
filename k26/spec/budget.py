"""Cost-aware adaptive DDTree budget: each step verifies the prefix of the best-first tree that maximises
expected tokens per second,

    choose n maximising  gain(n) - R * cost(n),   gain(n) = 1 + E[accepted | first n nodes],
                                                  cost(n) = t_draft + t_verify(n),

with E from the tree itself (Prop. 1 of the DDTree paper: the sum of the node probabilities under the
drafter's marginals) and t_verify measured per candidate bucket. Because nodes are listed in pop order,
the tree of any smaller budget is a prefix of the largest one: one draft, one build, any budget.

R is the long-run rate, tokens per second, tracked on the device from the steps already taken. Maximising
each step's own ratio gain(n) / cost(n) is not what maximises tokens per second over many steps: a
confident step should buy a bigger tree whenever its marginal tokens cost less than the rate the policy
already earns, even if its ratio drops (the renewal-reward / Dinkelbach argument). Before any step R is
that step's best ratio, so the first choice is the ratio rule's.

Calibration, per depth: a node u at depth d counts as q(u)^k_d. The nodes of one depth in a tree are
distinct token paths, so the sum of their q is the drafter's probability that verification accepts at least
d tokens; each step compares it, depth by depth, with the observed indicator (accepted >= d) and moves
log k_d towards agreement, on the device. One global k cannot do this: a drafter is typically well
calibrated at depth 1 and increasingly over-confident deeper (its errors compound along the path), so a
single exponent fitted to the total over-shrinks the first depths and under-shrinks the last.

Then per pop-order index j, a multiplier c_j on the calibrated q: the prefix gains the rule compares are
sums over indices, and what the depth exponents cannot see is how the mass of one depth splits between
the main path and its low-ranked siblings. c_j is the ratio of two decayed sums over the steps that
verified node j: how often j was on the accepted path, and its calibrated q. Neither calibration changes
the order of nodes, hence the trees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tree import DraftTree

K_RANGE = (0.1, 10.0)
MAX_DEPTH = 32  # calibration slots; deeper nodes share the last one
PRIOR = 0.5  # pseudo-count of the per-node ratio estimator
_LOG_K = (math.log(K_RANGE[0]), math.log(K_RANGE[1]))


@dataclass
class BudgetPolicy:
    candidates: tuple[int, ...]  # budgets (nodes besides the root), ascending
    t_draft: float  # seconds per draft (drafter forward + tree build)
    t_verify: tuple[float, ...]  # seconds per verify+accept+commit, one per candidate
    log_k: torch.Tensor  # [MAX_DEPTH] float32 on the device: log k_d for depths 1..MAX_DEPTH
    hits: torch.Tensor  # [largest] float32: decayed count of node j on the accepted path (when verified) ...
    preds: torch.Tensor  # [largest] float32: ... and of its calibrated q when verified; c_j = ratio
    cost: torch.Tensor  # [C] seconds per step of each candidate, on the device
    index: torch.Tensor  # [C] int64: node index (budget - 1) closing each candidate prefix
    position: tuple[torch.Tensor, ...]  # [] int64 per candidate: its own index (graph-safe constants)
    tokens: torch.Tensor  # [] float32: decayed sum of emitted tokens (live rows) ...
    seconds: torch.Tensor  # [] float32: ... and of the costs charged for them; their ratio is R
    steps: torch.Tensor  # [] int64: steps taken, for the exploration schedule
    lr: float = 0.2
    decay: float = 0.05
    explore_every: int = 0

    @classmethod
    def create(cls, candidates, t_draft: float, t_verify, device, k: float = 1.0, lr: float = 0.2) -> BudgetPolicy:
        cands = tuple(int(c) for c in candidates)
        if not cands or list(cands) != sorted(set(cands)) or cands[0] < 1:
            raise ValueError(f"budget candidates {candidates!r}: expected ascending distinct budgets >= 1")
        if len(t_verify) != len(cands) or t_draft < 0 or min(t_verify) <= 0:
            raise ValueError(f"verify costs {t_verify!r} must be positive, one per candidate {cands}")
        t_verify = tuple(float(t) for t in t_verify)
        return cls(cands, float(t_draft), t_verify, torch.full((MAX_DEPTH,), math.log(k), device=device),
                   torch.zeros(cands[-1], device=device), torch.zeros(cands[-1], device=device),
                   torch.tensor([t_draft + t for t in t_verify], device=device),
                   torch.tensor([c - 1 for c in cands], device=device),
                   tuple(torch.tensor(i, device=device) for i in range(len(cands))),
                   torch.zeros((), device=device), torch.zeros((), device=device),
                   torch.zeros((), dtype=torch.long, device=device), lr)

    def reset(self) -> None:
        """Forget calibration and rate (in place: captured graphs keep reading the same tensors)."""
        self.log_k.zero_()
        self.hits.zero_()
        self.preds.zero_()
        self.tokens.zero_()
        self.seconds.zero_()
        self.steps.zero_()

    def set_costs(self, t_draft: float, t_verify) -> None:
        """Replace the costs in place (captured graphs read the same device tensor)."""
        self.t_draft, self.t_verify = float(t_draft), tuple(float(t) for t in t_verify)
        self.cost.copy_(torch.tensor([self.t_draft + t for t in self.t_verify]))

    @property
    def largest(self) -> int:
        return self.candidates[-1]

    def _q(self, tree: DraftTree) -> torch.Tensor:
        """[B, n] calibrated probabilities q(u)^k_depth(u) of the non-root nodes (0 for padding)."""
        slot = (tree.depths[:, 1:] - 1).clamp(0, MAX_DEPTH - 1)
        return torch.where(tree.valid[:, 1:], (tree.scores[:, 1:].float() * self.log_k.exp()[slot]).exp(), 0.0)

    def _p(self, q: torch.Tensor) -> torch.Tensor:
        """[B, n] acceptance probability of each node: c_j q_j (q from `_q`, n <= largest); c_j is a ratio of
        decayed counts with one pseudo-observation at c = 1, so unobserved nodes keep their marginals."""
        n = q.shape[1]
        c = (self.hits[:n] + PRIOR) / (self.preds[:n] + PRIOR)
        return (q * c).clamp_max(1.0)

    def expected(self, tree: DraftTree) -> torch.Tensor:
        """[B, len(candidates)] calibrated E[accepted drafts] of each candidate prefix of the tree."""
        return self._p(self._q(tree)).cumsum(dim=1)[:, self.index]

    def choose(self, tree: DraftTree, alive: torch.Tensor | None = None) -> torch.Tensor:
        """Index of the candidate maximising gain - R * cost, gains summed over the live rows ([] int64)."""
        gain = 1 + self.expected(tree)
        if alive is not None:
            gain = gain * alive[:, None]
        gain = gain.sum(dim=0)
        # no history yet: this step's best ratio, which makes the rule pick exactly that ratio's argmax
        rate = torch.where(self.seconds > 0, self.tokens / self.seconds.clamp_min(1e-12), (gain / self.cost).max())
        best = (gain - rate * self.cost).argmax()
        # Optional: every explore_every-th step verifies the largest prefix, so nodes the rule stopped choosing
        # are observed again. Off by default: an unobserved node keeps its ratio estimate, and in the budget
        # simulation forced exploration cost more than it taught.
        if self.explore_every <= 0:
            return best
        explore = (self.steps % self.explore_every) == self.explore_every - 1
        return torch.where(explore, len(self.candidates) - 1, best)

    def update(self, tree: DraftTree, choice: torch.Tensor, accepted: torch.Tensor, alive: torch.Tensor,
               path: torch.Tensor) -> None:
        """Calibrate on what this step verified (the chosen prefix) and observed (`path`: accepted node
        indices, root first, -1 past the end), and fold the step into the long-run rate. Device only."""
        q = self._q(tree)
        n = q.shape[1]
        live = alive.float()[:, None]
        in_prefix = (torch.arange(n, device=q.device) <= self.index[choice]).float() * live  # [B, n]
        # depth exponents: predicted P(accepted >= d) vs observed, over the verified prefix
        slot = (tree.depths[:, 1:] - 1).clamp(0, MAX_DEPTH - 1)
        pred = torch.zeros(MAX_DEPTH, device=q.device).index_add_(0, slot.flatten(), (q * in_prefix).flatten())
        obs = ((accepted[:, None] >= torch.arange(1, MAX_DEPTH + 1, device=q.device)).float() * live).sum(0)
        # over-confident (pred > obs) -> larger k_d -> smaller q^k. The step's scale must not depend on the
        # outcome (obs), or the fixed point is biased: obs is a rare Bernoulli at deep depths.
        self.log_k.copy_((self.log_k + self.lr * (pred - obs) / (pred + live.sum())).clamp(*_LOG_K))
        # per-node ratio: decayed hits over decayed predictions, counted only where node j was verified
        hit = torch.zeros(q.shape[0], n + 1, device=q.device).scatter_(1, path.clamp_min(0), 1.0)[:, 1:]
        seen = in_prefix.amax(0)
        keep = 1 - self.decay * seen
        self.hits[:n] = self.hits[:n] * keep + (hit * in_prefix).sum(0)
        self.preds[:n] = self.preds[:n] * keep + (q * in_prefix).sum(0)
        self.tokens.mul_(1 - self.decay).add_(((accepted + 1).float() * live[:, 0]).sum())
        self.seconds.mul_(1 - self.decay).add_(self.cost[choice])
        self.steps.add_(1)


def truncate_tree(tree: DraftTree, budget: int) -> DraftTree:
    """The first `budget` nodes (pop order): exactly the tree of that budget."""
    n = budget + 1
    w = (n + 63) // 64
    return DraftTree(tree.tokens[:, :n], tree.parents[:, :n], tree.depths[:, :n], tree.valid[:, :n],
                     tree.words[:, :n, :w], tree.scores[:, :n], tree.max_depth)
