"""One speculative step on the device: draft (DFlash block forward), tree build, verify (target forward
over [bonus, nodes] with the ancestor mask), acceptance walk, KV commit, drafter-context update; beside it
the autoregressive step and the prefill (what eager decoding and the captured graphs both run)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..kv_cache import DrafterCache
from ..model import AttnBatch, KimiK2
from ..model.drafter import DFlashDrafter, drafter_logits
from ..penalties import penalized
from ..sampling import RowSampling, StepLogprobs, builtin_number, sample_rows, token_logprobs
from .accept import accept_paths, accept_paths_compiled, commit_latent
from .budget import truncate_tree
from .timer import null_span
from .tree import DraftTree, TreeTables, build_ddtree_from_topk, chain_from_topk, pad_tree

MAX_BUDGET = 255  # verify tokens = budget + 1 <= 256, the tree-attention kernel's maximum


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _times(xs, positive: bool) -> bool:
    """Finite real numbers (not bools), each > 0 (`positive`) or >= 0."""
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in xs)
    return ok and all(x > 0 if positive else x >= 0 for x in xs)


def _items(x) -> tuple:
    """x as a tuple of builtin numbers where they are NumPy ones (an np.array of budgets); () when it is not
    iterable (5, None), so the field's own check names it."""
    try:
        return tuple(map(builtin_number, x))
    except TypeError:
        return ()


DEFAULT_CANDIDATES = (3, 7, 15, 31)  # "auto"'s budgets to pick among


@dataclass(frozen=True)
class SpecConfig:
    method: Literal["ar", "dflash", "ddtree"] = "ddtree"
    # DDTree nodes besides the root: an integer, or "auto" (the default) to pick among `candidates` each
    # step by expected tokens per second (spec/budget.py); None means block_size - 1 (the chain's count).
    budget: int | Literal["auto"] | None = "auto"
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES
    costs: tuple[float, ...] | None = None  # (t_draft, t_verify per candidate) in seconds; None: measured
    # with `costs`: seconds per context token per candidate (the tree-attention term); None: 0
    cost_per_token: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ar", "dflash", "ddtree"):
            raise ValueError(f"SpecConfig.method={self.method!r}: expected 'ar', 'dflash' or 'ddtree'")
        # (a str subclass or str Enum of the caller's as the plain str: TP ranks cannot unpickle the caller's
        # classes; np.int64(5) as 5, as SamplingParams takes NumPy numbers)
        object.__setattr__(self, "method", str.__str__(self.method))
        b = builtin_number(self.budget)
        b = "auto" if isinstance(b, str) and b == "auto" else b
        object.__setattr__(self, "budget", b)
        if b is not None and b != "auto" and (not _int(b) or not 1 <= b <= MAX_BUDGET):
            raise ValueError(f"SpecConfig.budget={b!r}: expected 'auto' or an integer in [1, {MAX_BUDGET}]")
        if _int(b) and self.method != "ddtree":  # (it was ignored, yet reported in the stats)
            raise ValueError(
                f"SpecConfig.budget={b}: a budget is DDTree's; {self.method!r} verifies "
                + ("one token a step" if self.method == "ar" else "its one draft chain")
            )
        c = _items(self.candidates)
        if not c or not all(map(_int, c)) or list(c) != sorted(set(c)) or c[0] < 1 or c[-1] > MAX_BUDGET:
            raise ValueError(
                f"SpecConfig.candidates={self.candidates!r}: ascending integer budgets in [1, {MAX_BUDGET}]"
            )
        object.__setattr__(self, "candidates", c)
        k = self.costs if self.costs is None else _items(self.costs)
        if k:  # (as builtin numbers; a non-iterable or empty one kept as given for its message)
            object.__setattr__(self, "costs", k)
        if k is not None and (len(k) != len(c) + 1 or not _times(k[:1], False) or not _times(k[1:], True)):
            raise ValueError(
                f"SpecConfig.costs={self.costs!r}: t_draft (>= 0) and one verify time (> 0) per candidate, "
                f"{len(c) + 1} finite numbers of seconds"
            )
        given = (("candidates", c != DEFAULT_CANDIDATES), ("costs", k is not None))
        ignored = [n for n, on in (*given, ("cost_per_token", self.cost_per_token is not None)) if on]
        if ignored and not self.auto:  # (taken and ignored, as a budget with "ar" would be)
            raise ValueError(
                f"SpecConfig.{ignored[0]}: picks among DDTree budgets (budget 'auto'); "
                f"method {self.method!r} with budget {self.budget!r} would ignore it"
            )
        s = self.cost_per_token if self.cost_per_token is None else _items(self.cost_per_token)
        if s:
            object.__setattr__(self, "cost_per_token", s)
        if s is not None and (self.costs is None or len(s) != len(c) or not _times(s, positive=False)):
            raise ValueError(
                f"SpecConfig.cost_per_token={self.cost_per_token!r}: needs `costs` and one finite value >= 0 "
                "per candidate"
            )

    @property
    def auto(self) -> bool:
        return self.method == "ddtree" and self.budget == "auto"

    def fixed(self, budget: int) -> SpecConfig:
        return SpecConfig(self.method, budget)  # (candidates and costs choose a budget: no fixed one's)


@dataclass
class StepResult:
    emitted: torch.Tensor  # [B, max_depth + 1] accepted drafts then the new bonus, -1 after
    n_emitted: torch.Tensor  # [B] accepted drafts + 1
    bonus: torch.Tensor  # [B] the next root
    choice: torch.Tensor | None = None  # "auto": index of the best candidate for this step's tree
    budget: int | None = None  # the budget this step verified (host-known: eager pick or graph bucket)
    logprobs: StepLogprobs | None = None  # rs.logprobs: of the emitted tokens [B, max_depth + 1]


def draft_hidden(
    target: KimiK2, drafter: DFlashDrafter, dcache: DrafterCache, rows, start, bonus, static: bool = False
) -> torch.Tensor:
    """Drafter hidden states [B, block, D] of the block [bonus, MASK x (block - 1)]; `static` as
    `AttnBatch.static`."""
    cfg = drafter.cfg
    B = bonus.shape[0]
    ids = torch.cat([bonus[:, None], bonus.new_full((B, cfg.block_size - 1), cfg.mask_token_id)], dim=1)
    pos = start[:, None] + torch.arange(cfg.block_size, device=bonus.device)
    return drafter(target.embed_tokens(ids), pos, dcache.k, dcache.v, rows, start, static)


def draft(
    target: KimiK2, drafter: DFlashDrafter, dcache: DrafterCache, rows, start, bonus, static: bool = False
) -> torch.Tensor:
    """Per-depth drafter log-probs over the whole vocabulary [B, block - 1, V] (gathered under TP)."""
    return drafter_logits(draft_hidden(target, drafter, dcache, rows, start, bonus, static), target.lm_head)


def draft_topk(
    target: KimiK2,
    drafter: DFlashDrafter,
    dcache: DrafterCache,
    rows,
    start,
    bonus,
    k: int,
    static: bool = False,
):
    """Per-depth top-k (log-probs, token ids) [B, block - 1, k], merged from vocabulary shards under TP:
    all the tree builder needs (Lemma 1 of the DDTree paper: K = min(budget, V) suffices)."""
    h = draft_hidden(target, drafter, dcache, rows, start, bonus, static)
    return target.lm_head.topk_logprobs(h[:, 1:], k)


def tree_budget(spec: SpecConfig, block_size: int) -> int:
    return 1 if spec.method == "dflash" else spec.budget if isinstance(spec.budget, int) else block_size - 1


def verify_nodes(spec: SpecConfig, block_size: int) -> int:
    """Verify tokens per sequence of one step (the largest, for "auto"): the root plus the tree's nodes."""
    if spec.method == "ar":
        return 1
    if spec.method == "dflash":
        return block_size
    return 1 + (spec.candidates[-1] if spec.auto else spec.budget or block_size - 1)


def reported_budgets(spec: SpecConfig) -> list[int | None]:
    """The budget a step reports as verified (`Stepped.budget`, a request's `stats.budgets`), per bucket
    a graph batch captures for `spec`: each candidate under "auto", a fixed DDTree budget, else None
    (DFlash and AR verify no tree) — the eager step's rule (speculative_step), never the width of the
    bucket it runs in."""
    return list(spec.candidates) if spec.auto else [spec.budget if isinstance(spec.budget, int) else None]


@dataclass(frozen=True)
class StepModels:
    """What a decode step runs on: the target (compiled or plain), the drafter and both caches."""

    target: KimiK2
    drafter: DFlashDrafter | None
    cache_LRTC: torch.Tensor
    dcache: DrafterCache | None
    absorb: bool = True
    static: bool = False  # whole cache rows, no host sync (graph bodies): see AttnBatch.static
    tables: TreeTables = field(default_factory=TreeTables)  # bucket padding's constants (graphs read them)
    compiled: bool = False  # the step's own glue (acceptance) under torch.compile: graph bodies only

    def choose(
        self, h: torch.Tensor, rs: RowSampling, tree: DraftTree | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's token at every position of h [B, N, D]: the shards' argmax merged when every row
        is greedy (no full-vocabulary gather), else per-row samples from the gathered logits, shifted by
        the rows' penalties and biases (at a verify `tree`'s nodes with each node's path counted); with
        rs.logprobs also the raw logits [B, N, V] (whose positions the caller keeps: `along`)."""
        if rs.greedy:
            return self.target.lm_head.argmax(h), None
        logits = self.target.logits(h)
        shifted = logits
        if rs.penalties is not None:
            nodes = (None, None) if tree is None else (tree.tokens, tree.ancestors)
            shifted = penalized(logits, rs.penalties, *nodes)
        return sample_rows(shifted, rs), logits if rs.logprobs else None

    def next_token(self, h_BD: torch.Tensor, rs: RowSampling) -> tuple[torch.Tensor, StepLogprobs | None]:
        """Next token per row [B] from final hidden states (`choose` at one position; logprobs [B, 1])."""
        tok, logits = self.choose(h_BD[:, None], rs)
        return tok[:, 0], None if logits is None else token_logprobs(logits, tok)


def speculative_step(
    m: StepModels,
    rows,
    start,
    bonus,
    alive,
    spec: SpecConfig,
    rs: RowSampling,
    timer=None,
    nodes: int | None = None,
    policy=None,
) -> StepResult:
    """Advance every live sequence by its accepted drafts + 1 bonus; caches are updated in place.

    With a budget policy ("auto") the tree is built at the largest candidate and cut to the chosen one:
    eagerly the choice for this very tree (one tiny read), in a graph the budget is the bucket's
    (`spec.budget`), and the choice is returned for the host to pick the next bucket."""
    t = timer or (lambda name: null_span())
    target, drafter = m.target, m.drafter
    # Finished rows still run (the batch is rectangular) but at position 0 of their own row: their frozen
    # length could sit too close to the end of the cache for a whole tree.
    start = torch.where(alive, start, 0)
    pick = None
    with t("draft"):
        largest = policy.largest if policy is not None else tree_budget(spec, drafter.cfg.block_size)
        lp, tok = draft_topk(
            target, drafter, m.dcache, rows, start, bonus, min(largest, target.cfg.vocab_size), m.static
        )
        with t("tree"):  # inside "draft": draft_s keeps counting the tree build
            if policy is not None:
                full = build_ddtree_from_topk(lp, tok, policy.largest)
                pick = policy.choose(full, alive, start)
                budget = spec.budget if isinstance(spec.budget, int) else policy.candidates[int(pick)]
                tree = truncate_tree(full, budget)
            else:
                tree = (
                    chain_from_topk(lp, tok)
                    if spec.method == "dflash"
                    else build_ddtree_from_topk(lp, tok, largest)
                )
            tree = pad_tree(tree, nodes, m.tables) if nodes else tree
            tree.tokens[:, 0] = bonus
    with t("verify"):
        batch = AttnBatch(start[:, None] + tree.depths, rows, start, tree.mask_words(), m.static)
        h, aux = target(
            tree.tokens, batch, m.cache_LRTC, aux_layers=drafter.cfg.target_layer_ids, absorb=m.absorb
        )
        choice, logits = m.choose(h, rs, tree)
    with t("accept"):  # acceptance walk, KV commit, drafter-context update
        accept = accept_paths_compiled() if m.compiled else accept_paths
        path, n_acc, new_bonus, emitted = accept(tree, choice, alive)
        commit_latent(m.cache_LRTC, rows, start, path.clamp_min(0))
        J = path.shape[1]
        feat = aux.gather(1, path.clamp_min(0)[:, :, None].expand(-1, -1, aux.shape[2]))
        pos = start[:, None] + torch.arange(J, device=start.device)
        drafter.append_context(m.dcache.k, m.dcache.v, feat, pos, rows, valid_BC=path >= 0)
    if policy is not None:
        used = policy.position[policy.candidates.index(budget)] if isinstance(spec.budget, int) else pick
        policy.update(full, used, n_acc, alive, path, start)
    return StepResult(
        emitted,
        torch.where(alive, n_acc + 1, 0),
        new_bonus,
        pick,
        budget if policy is not None else spec.budget if isinstance(spec.budget, int) else None,
        # emitted token j is the target's choice at path node j (the drafts it accepted, then the bonus): the
        # log-softmax runs on those nodes only
        None
        if logits is None
        else token_logprobs(along(logits, path.clamp_min(0)), along(choice, path.clamp_min(0))),
    )


def ar_step(
    m: StepModels, rows, start, bonus, rs: RowSampling, context: torch.Tensor | None = None
) -> tuple[torch.Tensor, StepLogprobs | None]:
    """One autoregressive step: each row's bonus token through the target at its length (its latent
    written to the cache); the next token per row [B] (and its logprobs [B, 1] with rs.logprobs).
    `context` [B] bool (a speculative batch stepping
    autoregressively near the context end): those rows' features also go into the drafter's context, as a
    speculative step's commit would write them, so that drafting later resumes on a complete context."""
    batch = AttnBatch.causal(start, 1, rows, static=m.static)
    aux_layers = m.drafter.cfg.target_layer_ids if context is not None else ()
    h, feats = m.target(bonus[:, None], batch, m.cache_LRTC, aux_layers=aux_layers, absorb=m.absorb)
    if context is not None:
        m.drafter.append_context(
            m.dcache.k, m.dcache.v, feats, start[:, None], rows, valid_BC=context[:, None]
        )
    return m.next_token(h[:, 0], rs)


@dataclass
class Stepped:
    """What one step gave the host: the emitted tokens per row, their counts, the budget verified (DDTree;
    else None) and, in the "logprobs" sampling mode, the emitted tokens' `StepLogprobs` on the host (row b
    is slot b's; `StepLogprobs.row` reads one row)."""

    tokens: list[list[int]]
    counts: list[int]
    budget: int | None = None
    logprobs: StepLogprobs | None = None  # on the host, row b = slot b (read per asking row: `row`)


def eager_speculative_step(
    m: StepModels, rows, lens, bonus, alive, spec: SpecConfig, rs: RowSampling, timer=None, policy=None
) -> Stepped:
    """`speculative_step` run eagerly with its one host read: `lens` and `bonus` advanced in place."""
    r = speculative_step(m, rows, lens, bonus, alive, spec, rs, timer, policy=policy)
    counts = r.n_emitted.tolist()  # the step's one host read, with the tokens
    new = [e[:n] for e, n in zip(r.emitted.tolist(), counts)]
    lens.add_(r.n_emitted), bonus.copy_(r.bonus)
    return Stepped(new, counts, r.budget, None if r.logprobs is None else r.logprobs.cpu())


def eager_ar_step(m: StepModels, rows, lens, bonus, alive, rs: RowSampling, context: bool = False) -> Stepped:
    """`ar_step` run eagerly: `lens` (live rows) and `bonus` advanced in place; one token per row.
    `context`: the live rows' drafter context is kept (a speculative batch near the context end); its
    finished rows run at position 0, as in a speculative step (they may share a parking row)."""
    start = torch.where(alive, lens, 0) if context else lens
    tok, lp = ar_step(m, rows, start, bonus, rs, alive if context else None)
    bonus.copy_(tok)
    lens.add_(alive.long())  # finished rows stay frozen, rewriting only their own slot
    counts = [1] * len(rows)
    return Stepped([[t] for t in bonus.tolist()], counts, None, None if lp is None else lp.cpu())


def along(x: torch.Tensor, index_BJ: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...] at positions index_BJ of each row: [B, J, ...]."""
    return x.gather(1, index_BJ.view(*index_BJ.shape, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))


def time_step(m: StepModels, spec: SpecConfig, batch: int, at: int) -> float:
    """Seconds per whole eager step of `batch` rows at context `at` (best of two; draft included), on the
    caches as scratch: what the adaptive budget's cost fit reads when no graphs are captured."""
    dev = m.cache_LRTC.device
    rows, start = torch.arange(batch, device=dev), torch.full((batch,), at, device=dev)
    bonus, alive = torch.zeros_like(rows), torch.ones(batch, dtype=torch.bool, device=dev)
    rs = RowSampling.of([None] * batch, dev)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        speculative_step(m, rows, start, bonus, alive, spec, rs)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best
