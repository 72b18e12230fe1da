"""Presence / frequency penalties and logit biases (OpenAI's `presence_penalty`, `frequency_penalty`,
`logit_bias`) and vLLM's `min_tokens`: per-row device state, and the logits they give at one position or at
every node of a verify tree.

A row's logit of token t is shifted by  bias[t] - frequency * c - presence * (c > 0),  c the times t was
generated so far (prompt tokens do not count, as in OpenAI's API and vLLM). At a verify tree's node, c also
counts the draft tokens on the node's path (its ancestors below the root, and itself): the node's logits are
the ones autoregressive decoding would see after emitting that path, so speculative decoding stays lossless.
min_tokens: while fewer than min_tokens tokens precede a position (those generated so far, plus the node's
path), the row's stop ids get logit -inf there, so no stop id can end the answer early.
A row with no penalty and no bias gets its logits back (x + 0.0 == x), so rows without them pick the
tokens they would in a batch without penalties. In the captured "filter" / "logprobs" graphs this runs for
every row, penalised or not (two [B, N, V] fp32 temporaries and a bool mask besides the sort those modes
do anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    """Per-row penalty state of one batch, as device tensors (one captured graph serves any mix of rows)."""

    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    bias: torch.Tensor  # [B, V] float32: logit_bias, dense
    counts: torch.Tensor  # [B, V] int32: times each token was generated so far (penalised rows; others 0)
    held: torch.Tensor  # [B] int32: tokens still to generate before a stop id may be (min_tokens); 0: off
    stops: torch.Tensor  # [B, V] bool: the row's stop ids (set only while min_tokens holds them back)

    @classmethod
    def allocate(cls, batch: int, vocab: int, device) -> Penalties:
        f = torch.zeros(batch, dtype=torch.float32, device=device)
        bias = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
        counts = torch.zeros(batch, vocab, dtype=torch.int32, device=device)
        held = torch.zeros(batch, dtype=torch.int32, device=device)
        return cls(
            f, f.clone(), bias, counts, held, torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        )

    def set_row(self, b: int, row: RowPenalty) -> None:
        """Row b's parameters for a new request, its counts zeroed (a slot's previous request leaves
        nothing behind)."""
        self.frequency[b], self.presence[b] = float(row.frequency), float(row.presence)
        self.bias[b].zero_()
        self.counts[b].zero_()
        self.stops[b].zero_()
        self.held[b] = min(row.min_tokens, 2**31 - 1)  # (int32: longer than any context anyway)
        dev = self.bias.device
        if row.logit_bias:
            ids = torch.tensor([i for i, _ in row.logit_bias], dtype=torch.long, device=dev)
            self.bias[b, ids] = torch.tensor([v for _, v in row.logit_bias], dtype=torch.float32, device=dev)
        if row.min_tokens and row.stop_ids:
            self.stops[b, torch.tensor(sorted(row.stop_ids), dtype=torch.long, device=dev)] = True

    def count(self, rows: list[int], tokens: list[int]) -> None:
        """Token tokens[i] was generated once more by row rows[i] (repeats add up)."""
        if rows:
            dev = self.counts.device
            r = torch.tensor(rows, device=dev)
            one = torch.ones(len(rows), dtype=torch.int32, device=dev)
            self.counts.index_put_((r, torch.tensor(tokens, device=dev)), one, accumulate=True)
            self.held.index_put_((r,), -one, accumulate=True).clamp_(min=0)

    def rows(self, index: torch.Tensor) -> Penalties:
        """The sub-batch of rows `index` (the first token of newly admitted rows)."""
        return Penalties(
            self.frequency[index],
            self.presence[index],
            self.bias[index],
            self.counts[index],
            self.held[index],
            self.stops[index],
        )


@dataclass(frozen=True)
class RowPenalty:
    """One request's penalty parameters, as `Penalties.set_row` takes them (SamplingParams' fields)."""

    frequency: float = 0.0
    presence: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()  # the ids min_tokens holds back


def _shift(bias, frequency, presence, c: torch.Tensor) -> torch.Tensor:
    """The logit shift at count c (float32): one expression for the dense rows and the path's tokens, so a
    token gets the same bits whichever of the two writes it."""
    return bias - frequency * c - presence * (c > 0).float()


def penalized(
    logits_BNV: torch.Tensor,
    p: Penalties,
    tokens_BN: torch.Tensor | None = None,
    ancestors_BNN: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 logits [B, N, V] with each row's penalties and bias applied. Without a tree every position sees
    the row's counts; with one (`tokens_BN` the nodes' tokens, node 0 the root, `ancestors_BNN[b, n, a]`: a
    is n or an ancestor of n) node n also counts the tokens of its path below the root (the root is the
    last emitted token: already in the counts). No host sync, static shapes: graph-safe."""
    B, N, _ = logits_BNV.shape
    c = p.counts.float()
    f, pr = p.frequency[:, None], p.presence[:, None]
    out = logits_BNV + _shift(p.bias, f, pr, c)[:, None, :]
    if tokens_BN is None:
        return _hold_stops(out, p, torch.zeros(B, N, dtype=torch.int32, device=out.device))
    path = ancestors_BNN.clone()
    path[:, :, 0] = False
    same = (tokens_BN[:, :, None] == tokens_BN[:, None, :]).float()  # [B, a', a]
    on_path = torch.bmm(path.float(), same)  # [B, n, a]: tokens on n's path equal to node a's token (exact)
    idx = tokens_BN[:, None, :].expand(B, N, N)
    c_na = c.gather(1, tokens_BN)[:, None, :] + on_path
    bias_a = p.bias.gather(1, tokens_BN)[:, None, :]
    # every (n, a) writes logit (n, token a) at the count n's path gives that token: pairs naming the same
    # token write the same value (deterministic), and a token off the path gets its dense value again
    val = logits_BNV.gather(2, idx) + _shift(bias_a, f[..., None], pr[..., None], c_na)
    return _hold_stops(out.scatter_(2, idx, val), p, path.sum(-1, dtype=torch.int32))


def _hold_stops(logits_BNV: torch.Tensor, p: Penalties, depth_BN: torch.Tensor) -> torch.Tensor:
    """-inf at the row's stop ids where fewer than min_tokens tokens precede the position: the generated
    ones (min_tokens - held) and the `depth_BN` path tokens below the root."""
    early = depth_BN < p.held[:, None]  # [B, N]
    return logits_BNV.masked_fill_(early[:, :, None] & p.stops[:, None, :], float("-inf"))
