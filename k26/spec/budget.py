"""Cost-aware adaptive DDTree budget: each step verifies the prefix of the best-first tree that maximises
expected tokens per second,

    rate(n) = (1 + E[accepted | first n nodes]) / (t_draft + t_verify(n)),

with E from the tree itself (Prop. 1 of the DDTree paper: the sum of the node probabilities under the
drafter's marginals) and t_verify measured per candidate bucket. Because nodes are listed in pop order,
the tree of any smaller budget is a prefix of the largest one: one draft, one build, any budget.

Calibration: the drafter's marginals are over- or under-confident, so node probabilities are q(u)^k
with k fitted online on the device from the accepted counts the step already produces (k > 1 when the
drafter is over-confident). The ordering of nodes, hence the trees, do not depend on k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tree import DraftTree

K_RANGE = (0.1, 10.0)
_LOG_K = (math.log(K_RANGE[0]), math.log(K_RANGE[1]))


@dataclass
class BudgetPolicy:
    candidates: tuple[int, ...]  # budgets (nodes besides the root), ascending
    t_draft: float  # seconds per draft (drafter forward + tree build)
    t_verify: tuple[float, ...]  # seconds per verify+accept+commit, one per candidate
    log_k: torch.Tensor  # [] float32 on the device: the calibration exponent, log-space
    cost: torch.Tensor  # [C] seconds per step of each candidate, on the device
    index: torch.Tensor  # [C] int64: node index (budget - 1) closing each candidate prefix
    position: tuple[torch.Tensor, ...]  # [] int64 per candidate: its own index (graph-safe constants)
    lr: float = 0.2

    @classmethod
    def create(cls, candidates, t_draft: float, t_verify, device, k: float = 1.0, lr: float = 0.2) -> BudgetPolicy:
        cands = tuple(int(c) for c in candidates)
        if not cands or list(cands) != sorted(set(cands)) or cands[0] < 1:
            raise ValueError(f"budget candidates {candidates!r}: expected ascending distinct budgets >= 1")
        if len(t_verify) != len(cands) or t_draft < 0 or min(t_verify) <= 0:
            raise ValueError(f"verify costs {t_verify!r} must be positive, one per candidate {cands}")
        t_verify = tuple(float(t) for t in t_verify)
        return cls(cands, float(t_draft), t_verify, torch.tensor(math.log(k), device=device),
                   torch.tensor([t_draft + t for t in t_verify], device=device),
                   torch.tensor([c - 1 for c in cands], device=device),
                   tuple(torch.tensor(i, device=device) for i in range(len(cands))), lr)

    def set_costs(self, t_draft: float, t_verify) -> None:
        """Replace the costs in place (captured graphs read the same device tensor)."""
        self.t_draft, self.t_verify = float(t_draft), tuple(float(t) for t in t_verify)
        self.cost.copy_(torch.tensor([self.t_draft + t for t in self.t_verify]))

    @property
    def largest(self) -> int:
        return self.candidates[-1]

    def expected(self, tree: DraftTree) -> torch.Tensor:
        """[B, len(candidates)] calibrated E[accepted drafts] of each candidate prefix of the tree."""
        q = torch.where(tree.valid[:, 1:], (tree.scores[:, 1:].float() * self.log_k.exp()).exp(), 0.0)
        return q.cumsum(dim=1)[:, self.index]

    def choose(self, tree: DraftTree, alive: torch.Tensor | None = None) -> torch.Tensor:
        """Index of the candidate with the best expected tokens/s summed over the live rows ([] int64)."""
        gain = 1 + self.expected(tree)
        if alive is not None:
            gain = gain * alive[:, None]
        return (gain.sum(dim=0) / self.cost).argmax()

    def update(self, tree: DraftTree, choice: torch.Tensor, accepted: torch.Tensor, alive: torch.Tensor) -> None:
        """Move k so the predicted accepted count of the chosen prefix tracks the observed one (device only)."""
        pred = (self.expected(tree).gather(1, choice.view(1, 1).expand(tree.tokens.shape[0], 1))[:, 0] * alive).sum()
        obs = (accepted.float() * alive).sum()
        # over-confident (pred > obs) -> larger k -> smaller q(u)^k
        step = self.lr * (pred - obs) / (pred + 1.0)
        self.log_k.copy_((self.log_k + step).clamp(_LOG_K[0], _LOG_K[1]))


def truncate_tree(tree: DraftTree, budget: int) -> DraftTree:
    """The first `budget` nodes (pop order): exactly the tree of that budget."""
    n = budget + 1
    w = (n + 63) // 64
    return DraftTree(tree.tokens[:, :n], tree.parents[:, :n], tree.depths[:, :n], tree.valid[:, :n],
                     tree.words[:, :n, :w], tree.scores[:, :n], tree.max_depth)
