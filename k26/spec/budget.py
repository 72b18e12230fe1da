"""Cost-aware adaptive DDTree budget: each step verifies the prefix of the best-first tree that maximises
expected tokens per second,

    choose n maximising  gain(n) - R * cost(n),   gain(n) = 1 + E[accepted | first n nodes],
                                                  cost(n) = t_draft + t_verify(n) + s(n) * L,

with t_verify and the per-context-token slope s measured per candidate bucket and L the mean context of
the live rows. The slope is the tree-attention term: every verified node reads the whole latent cache, so
a big tree costs far more at long context than at short (K2.6 rank, eager: budget 31 costs 6 ms more
than budget 8 at 4K, 12 ms more at 32K; the line through 4K and 32K predicts the measured 128K budget-15
step within 2 %). A cost table timed at one length would buy trees far too big at long context.

Because nodes are listed in pop order, the tree of any smaller budget is a prefix of the largest one:
one draft, one build, any budget.

R is the long-run rate, tokens per second, tracked on the device from the steps already taken. Maximising
each step's own ratio gain(n) / cost(n) is not what maximises tokens per second over many steps: a
confident step should buy a bigger tree whenever its marginal tokens cost less than the rate the policy
already earns, even if its ratio drops (the renewal-reward / Dinkelbach argument). Before any step R is
that step's best ratio, so the first choice is the ratio rule's.

E comes from the tree itself: the sum of the node probabilities under the drafter's marginals (Prop. 1 of
the DDTree paper), calibrated online. What the rule compares are the increments between candidates: the
mass f_i of the nodes candidate i adds to candidate i-1, against the accepted drafts y_i those nodes add.
A verify of n nodes reveals y_i for every candidate up to n (a smaller tree's accepted path is the part
of the observed one inside its prefix, since a child is always popped after its parent), so each step
feeds a per-candidate ridge regression y_i ~ a_i + b_i f_i (decayed sums, prior a = 0, b = 1: the raw
marginals). The increments are regressed, not the totals, because two candidates observed on the same
steps share their noise: the difference of two separately fitted totals is the noisiest number in the
rule. Why this form (measured on the trained pair, `profiling/results/*bench_budget_sim*`): the drafter
is under-confident by ~2x at the top, so raw marginals mislead; per-depth exponents and per-node ratios
fitted online lost 1-3.5 % to the best fixed budget; and no cheap feature of the tree (prefix and
per-depth masses) predicts the per-step marginal gain well enough to win more than ~0.4 % over the best
constant choice on held-out text (`bench_budget_replay`), so the calibration's job is mostly to find that
constant choice fast, per cost profile and context length, and to follow the confidence where it moves.

In CUDA graphs the choice is one step late: a graph cannot branch on its own draft, so this step's tree
picks the next step's bucket. Predicting the next step's increments with this step's same-step fit would
over-react to a tree that is not the one being verified, so a lagged policy fits a second regression,
this step's increments on the previous step's masses, and chooses with that one (on the trained pair it
learns that the previous tree says little, and settles on the best constant budget).

The largest candidate is only observed when chosen. The first `warmup` steps and every
`explore_every`-th step verify it, so an under-confident drafter cannot hide the value of a big tree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compiling import compile_static
from .tree import DraftTree

PRIOR = 2.0  # ridge precision around the raw marginals (a = 0, b = 1), in pseudo-observations


@dataclass
class BudgetPolicy:
    candidates: tuple[int, ...]  # budgets (nodes besides the root), ascending
    t_draft: float  # seconds per draft (drafter forward + tree build)
    t_verify: tuple[float, ...]  # seconds per verify+accept+commit, one per candidate
    stats: torch.Tensor  # [C, 5] float32: decayed sums (1, f, y, f^2, f y) of each candidate's increments
    lag_stats: torch.Tensor  # [C, 5] the same with f from the previous step's tree (lagged choice)
    prev_f: torch.Tensor  # [B, C] the previous step's increments, per row
    cost: torch.Tensor  # [C] seconds per step of each candidate at context 0, on the device
    slope: torch.Tensor  # [C] seconds per context token (mean over the live rows) of each candidate
    index: torch.Tensor  # [C] int64: node index (budget - 1) closing each candidate prefix
    position: tuple[torch.Tensor, ...]  # [] int64 per candidate: its own index (graph-safe constants)
    tokens: torch.Tensor  # [] float32: decayed sum of emitted tokens (live rows) ...
    seconds: torch.Tensor  # [] float32: ... and of the costs charged for them; their ratio is R
    steps: torch.Tensor  # [] int64: steps taken, for warm-up and exploration
    decay: float = 0.02  # per observation step of a candidate's sums
    rate_decay: float = 0.05
    warmup: int = 4
    explore_every: int = 128
    # In a captured step the ~80 tiny kernels of choose + update cost ~7 % of a small model's step
    # (measured, 2026-11-30-bench_budget-h200.md); compiled they fuse into a handful.
    compiled: bool = False
    lagged: bool = False  # the choice applies to the next step (graphs), not to the tree it was made on

    @classmethod
    def create(
        cls, candidates, t_draft: float, t_verify, device, per_token=None, rows: int = 1, **kw
    ) -> BudgetPolicy:
        cands = tuple(int(c) for c in candidates)
        if not cands or list(cands) != sorted(set(cands)) or cands[0] < 1:
            raise ValueError(f"budget candidates {candidates!r}: expected ascending distinct budgets >= 1")
        if len(t_verify) != len(cands) or t_draft < 0 or min(t_verify) <= 0:
            raise ValueError(f"verify costs {t_verify!r} must be positive, one per candidate {cands}")
        per_token = tuple(float(s) for s in (per_token or [0.0] * len(cands)))
        if len(per_token) != len(cands) or min(per_token) < 0:
            raise ValueError(f"per-token costs {per_token!r} must be >= 0, one per candidate {cands}")
        t_verify = tuple(float(t) for t in t_verify)
        return cls(
            cands,
            float(t_draft),
            t_verify,
            torch.zeros(len(cands), 5, device=device),
            torch.zeros(len(cands), 5, device=device),
            torch.full((rows, len(cands)), -1.0, device=device),
            torch.tensor([t_draft + t for t in t_verify], device=device),
            torch.tensor(per_token, device=device),
            torch.tensor([c - 1 for c in cands], device=device),
            tuple(torch.tensor(i, device=device) for i in range(len(cands))),
            torch.zeros((), device=device),
            torch.zeros((), device=device),
            torch.zeros((), dtype=torch.long, device=device),
            **kw,
        )

    def reset(self) -> None:
        """Forget calibration and rate (in place: captured graphs keep reading the same tensors)."""
        self.stats.zero_()
        self.lag_stats.zero_()
        self.prev_f.fill_(-1.0)  # < 0: no previous step yet
        self.tokens.zero_()
        self.seconds.zero_()
        self.steps.zero_()

    def admit(self, rows: list[int]) -> None:
        """New requests in slots `rows`: their previous-step masses belonged to the slots' former rows (or
        to no row), so their first step must not feed the lagged fit (in place, between replays)."""
        if rows:
            self.prev_f[rows] = -1.0

    def set_costs(self, t_draft: float, t_verify, per_token=None) -> None:
        """Replace the costs in place (captured graphs read the same device tensors)."""
        self.t_draft, self.t_verify = float(t_draft), tuple(float(t) for t in t_verify)
        self.cost.copy_(torch.tensor([self.t_draft + t for t in self.t_verify]))
        self.slope.copy_(torch.tensor([float(s) for s in per_token or [0.0] * len(self.candidates)]))

    def step_cost(self, alive: torch.Tensor | None, length: torch.Tensor | None) -> torch.Tensor:
        """[C] seconds per step of each candidate at the live rows' mean context length."""
        if length is None:
            return self.cost
        w = torch.ones_like(length, dtype=torch.float32) if alive is None else alive.float()
        return self.cost + self.slope * (length.float() * w).sum() / w.sum().clamp_min(1.0)

    @property
    def largest(self) -> int:
        return self.candidates[-1]

    def _increments(self, tree: DraftTree) -> torch.Tensor:
        """[B, C] drafter mass of the nodes each candidate adds to the previous one (raw marginals)."""
        q = torch.where(tree.valid[:, 1:], tree.scores[:, 1:].float().exp(), 0.0)
        total = q.cumsum(dim=1)[:, self.index]
        return torch.cat([total[:, :1], total.diff(dim=1)], dim=1)

    def coefficients(self, lagged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """([C], [C]) ridge fit a + b f of each candidate's accepted increment, prior a = 0, b = 1; `lagged`:
        of the next step's increment on this step's masses."""
        w, sf, sy, sff, sfy = (self.lag_stats if lagged else self.stats).unbind(1)
        a11, a22, b2 = w + PRIOR, sff + PRIOR, sfy + PRIOR
        det = a11 * a22 - sf * sf
        return (a22 * sy - sf * b2) / det, (a11 * b2 - sf * sy) / det

    def expected(self, tree: DraftTree, lagged: bool = False) -> torch.Tensor:
        """[B, C] calibrated E[accepted drafts] of each candidate prefix of the tree (`lagged`: of the next
        step's tree), nondecreasing."""
        a, b = self.coefficients(lagged)
        return (a + b * self._increments(tree)).clamp_min(0).cumsum(dim=1)

    def choose(
        self, tree: DraftTree, alive: torch.Tensor | None = None, length: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Index of the candidate maximising gain - R * cost, gains summed over the live rows ([] int64);
        `length` [B]: the rows' context lengths (None: costs at context 0)."""
        return (_compiled("choose") if self.compiled else BudgetPolicy._choose)(self, tree, alive, length)

    def update(
        self,
        tree: DraftTree,
        choice: torch.Tensor,
        accepted: torch.Tensor,
        alive: torch.Tensor,
        path: torch.Tensor,
        length: torch.Tensor | None = None,
    ) -> None:
        """Calibrate on what this step verified (the chosen prefix) and observed (`path`: accepted node
        indices, root first, -1 past the end), and fold the step into the long-run rate. Device only."""
        fn = _compiled("update") if self.compiled else BudgetPolicy._update
        fn(self, tree, choice, accepted, alive, path, length)

    def _choose(
        self, tree: DraftTree, alive: torch.Tensor | None, length: torch.Tensor | None
    ) -> torch.Tensor:
        cost = self.step_cost(alive, length)
        gain = 1 + self.expected(tree, self.lagged)
        if alive is not None:
            gain = gain * alive[:, None]
        gain = gain.sum(dim=0)
        # no history yet: this step's best ratio, which makes the rule pick exactly that ratio's argmax
        rate = torch.where(self.seconds > 0, self.tokens / self.seconds.clamp_min(1e-12), (gain / cost).max())
        best = (gain - rate * cost).argmax()
        explore = self.steps < self.warmup
        if self.explore_every > 0:
            explore |= (self.steps % self.explore_every) == self.explore_every - 1
        return torch.where(explore, len(self.candidates) - 1, best)

    def _update(
        self,
        tree: DraftTree,
        choice: torch.Tensor,
        accepted: torch.Tensor,
        alive: torch.Tensor,
        path: torch.Tensor,
        length: torch.Tensor | None,
    ) -> None:
        f = self._increments(tree)
        # accepted drafts inside each candidate's prefix: path nodes 1..budget (a path only climbs in index)
        inside = ((path[:, 1:, None] >= 1) & (path[:, 1:, None] <= self.index + 1)).sum(1).float()  # [B, C]
        y = torch.cat([inside[:, :1], inside.diff(dim=1)], dim=1)
        live = alive.float()[:, None]
        # a step with no live row (graph capture's warm-ups on scratch state; decoding never runs one) is no
        # observation: nothing decays, no cost is charged, no step counted
        on = alive.any()
        seen = ((torch.arange(len(self.candidates), device=f.device) <= choice) & on).float()  # [C]
        w = live * seen
        keep = 1 - self.decay * seen[:, None]
        self.stats.mul_(keep).add_(_sums(w, f, y))
        if self.lagged:
            w = w * (self.prev_f[:, :1] >= 0)
            self.lag_stats.mul_(keep).add_(_sums(w, self.prev_f, y))
            # an idle row's tree (parked, say while its prompt prefills) is not its next step's predecessor
            self.prev_f.copy_(torch.where(alive[:, None], f, -1.0))
        rate_keep = 1 - self.rate_decay * on.float()
        self.tokens.mul_(rate_keep).add_(((accepted + 1).float() * live[:, 0]).sum())
        # gather, not cost[choice]: a 0-d index tensor is read back to the host, which a graph cannot capture
        cost = self.step_cost(alive, length)
        self.seconds.mul_(rate_keep).add_(cost.gather(0, choice.reshape(1)).squeeze(0) * on)
        self.steps.add_(on.long())


def _sums(w: torch.Tensor, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[C, 5] weighted sums (1, f, y, f^2, f y) over the rows."""
    return torch.stack([w, w * f, w * y, w * f * f, w * f * y], dim=2).sum(0)


@functools.cache
def _compiled(name: str):
    # Batch size symbolic after the second one seen: a DDTree bucket set of 4 batch sizes compiled choose and
    # update 8 times (17.7 s on the CPU; most of the tiny pair's 25.7 s DDTree capture on the H200), now 4
    # (10.0 s) whatever the number of batch sizes. compile_static also lifts dynamo's limit of 8 versions,
    # a hard failure under fullgraph.
    return compile_static(getattr(BudgetPolicy, "_" + name), dynamic=None)


def truncate_tree(tree: DraftTree, budget: int) -> DraftTree:
    """The first `budget` nodes (pop order): exactly the tree of that budget."""
    n = budget + 1
    w = (n + 63) // 64
    return DraftTree(
        tree.tokens[:, :n],
        tree.parents[:, :n],
        tree.depths[:, :n],
        tree.valid[:, :n],
        tree.words[:, :n, :w],
        tree.scores[:, :n],
        tree.max_depth,
    )


def timing_contexts(max_model_len: int, largest: int, block: int, near: int = 16) -> tuple[int, ...]:
    """Context lengths at which to time each candidate step: a short and a long one (the longest a step of
    the largest tree fits at), or only the short one when the cache is too short to tell them apart."""
    far = max_model_len - largest - block - 1
    return (near, far) if far - near >= 256 else (max(0, min(near, far)),)


def fit_costs(t_AC: torch.Tensor, ats: tuple[int, ...]) -> tuple[list[float], list[float]]:
    """Per candidate, seconds per whole step at context 0 and per context token: the line through the
    timings [len(ats), C] (flat with one context)."""
    slope = (
        ((t_AC[-1] - t_AC[0]) / (ats[-1] - ats[0])).clamp_min(0)
        if len(ats) > 1
        else torch.zeros_like(t_AC[0])
    )
    return (t_AC[0] - slope * ats[0]).clamp_min(1e-6).tolist(), slope.tolist()


def measure_costs(
    time_at: Callable[[int], list[float]], ats: tuple[int, ...], device, all_ranks: bool = False
) -> tuple[list[float], list[float]]:
    """Per candidate: seconds per whole step at context 0 and per context token (`fit_costs`), from
    `time_at(context)`: each candidate's step timed at that context (graph replays or eager steps).
    `all_ranks`: every TP rank must pick the same budget, so all agree on the slowest timings."""
    t = torch.tensor([time_at(at) for at in ats], device=device)
    if all_ranks:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return fit_costs(t, ats)


class Budgets:
    """A decoder's adaptive-budget policies, one per (SpecConfig, batch size), kept as long as the decoder
    (a captured graph reads its policy's tensors); each one's costs measured once."""

    def __init__(self, device, graphs: bool):
        self.device = device
        self.graphs = graphs  # graphs: compiled policy, and the choice applies to the next step
        self.policies: dict[tuple, BudgetPolicy] = {}
        self.measured: set[tuple] = set()

    def policy(self, spec, batch: int) -> BudgetPolicy:
        """The budget policy of one (spec, batch size): costs from the SpecConfig, else equal placeholders
        that `calibrate` replaces by measurement before the first prefill."""
        key = (spec, batch)
        if key not in self.policies:
            costs = spec.costs or (0.0, *([1.0] * len(spec.candidates)))
            self.policies[key] = BudgetPolicy.create(
                spec.candidates,
                costs[0],
                costs[1:],
                self.device,
                per_token=spec.cost_per_token,
                rows=batch,
                compiled=self.graphs,
                lagged=self.graphs,
            )
        return self.policies[key]

    def calibrate(
        self, spec, batch: int, time_at: Callable[[int], list[float]], ats: tuple[int, ...], all_ranks: bool
    ) -> None:
        """Measure the policy's costs (`measure_costs`) unless the SpecConfig gives them or they were
        measured already; the timing steps run on scratch caches, so what they taught is forgotten."""
        key = (spec, batch)
        if spec.costs is not None or key in self.measured:
            return
        policy = self.policies[key]
        policy.set_costs(0.0, *measure_costs(time_at, ats, self.device, all_ranks))
        policy.reset()
        self.measured.add(key)
