"""Presence / frequency penalties and logit biases (OpenAI's `presence_penalty`, `frequency_penalty`,
`logit_bias`): per-row device state, and the logits they give at one position or at every node of a
verify tree.

A row's logit of token t is shifted by  bias[t] - frequency * c - presence * (c > 0),  c the times t was
generated so far (prompt tokens do not count, as in OpenAI's API and vLLM). At a verify tree's node, c also
counts the draft tokens on the node's path (its ancestors below the root, and itself): the node's logits are
the ones autoregressive decoding would see after emitting that path, so speculative decoding stays lossless.
A row with no penalty and no bias gets its logits back (x + 0.0 == x), so rows without them pick the
tokens they would in a batch without penalties. In the captured "filter" / "logprobs" graphs this runs for
every row, penalised or not (two [B, N, V] fp32 temporaries besides the sort those modes do anyway).
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

    @classmethod
    def allocate(cls, batch: int, vocab: int, device) -> Penalties:
        f = torch.zeros(batch, dtype=torch.float32, device=device)
        bias = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
        return cls(f, f.clone(), bias, torch.zeros(batch, vocab, dtype=torch.int32, device=device))

    def set_row(
        self, b: int, frequency: float, presence: float, logit_bias: tuple[tuple[int, float], ...]
    ) -> None:
        """Row b's parameters for a new request, its counts zeroed (a slot's previous request leaves
        nothing behind)."""
        self.frequency[b], self.presence[b] = float(frequency), float(presence)
        self.bias[b].zero_()
        self.counts[b].zero_()
        if logit_bias:
            dev = self.bias.device
            ids = torch.tensor([i for i, _ in logit_bias], dtype=torch.long, device=dev)
            self.bias[b, ids] = torch.tensor([v for _, v in logit_bias], dtype=torch.float32, device=dev)

    def count(self, rows: list[int], tokens: list[int]) -> None:
        """Token tokens[i] was generated once more by row rows[i] (repeats add up)."""
        if rows:
            dev = self.counts.device
            index = (torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev))
            self.counts.index_put_(
                index, torch.ones(len(rows), dtype=torch.int32, device=dev), accumulate=True
            )

    def rows(self, index: torch.Tensor) -> Penalties:
        """The sub-batch of rows `index` (the first token of newly admitted rows)."""
        return Penalties(self.frequency[index], self.presence[index], self.bias[index], self.counts[index])


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
        return out
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
    return out.scatter_(2, idx, val)
