"""`LLM`: load a checkpoint directory, score token sequences, and generate autoregressively.

Prompts of one call are prefilled together (right-padded: a causal query never sees the padding) and
then decoded one token per step for the whole batch, each sequence in its own cache row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .config import ModelConfig
from .kv_cache import LatentCache
from .loader import load_model
from .model import AttnBatch, KimiK2
from .sampling import SamplingParams, sample
from .tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated, without the stop token
    text: str = ""  # decoded token_ids, special tokens left out
    finish_reason: str | None = None  # "stop" | "length"


class LLM:
    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        tp: int = 1,
        max_model_len: int | None = None,
        max_batch: int = 8,
        absorb: bool = True,
        progress: bool = True,
        cuda_kernels: bool = True,
    ):
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp={tp!r}: expected a positive integer")
        if tp != 1:
            raise ValueError(f"tp={tp}: tensor-parallel execution is not available in this build yet; use tp=1")
        self.path = Path(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or torch.bfloat16
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype={self.dtype}: expected torch.bfloat16, torch.float16 or torch.float32")
        self.config = ModelConfig.from_dir(self.path)
        self.tokenizer = Tokenizer.from_dir(self.path)
        if self.tokenizer.num_base + 256 != self.config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.num_base} base tokens + 256 specials, but config vocab_size is "
                f"{self.config.vocab_size}: tiktoken.model does not belong to this checkpoint"
            )
        self.max_model_len = max_model_len or min(self.config.max_position_embeddings, 4096)
        if not 1 < self.max_model_len <= self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len}: must lie in (1, max_position_embeddings="
                f"{self.config.max_position_embeddings}]"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: expected a positive integer")
        self.absorb = absorb
        self.model: KimiK2 = load_model(
            self.path, self.config, device=self.device, dtype=self.dtype, progress=progress, cuda_kernels=cuda_kernels
        )
        self.cache = LatentCache.allocate(self.config, max_batch, self.max_model_len, self.dtype, self.device)

    # -- inputs --------------------------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        ids = list(ids)
        if not ids:
            raise ValueError(f"{what} is empty")
        V = self.config.vocab_size
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                raise ValueError(f"{what}: token id {t!r} at position {pos} is outside the vocabulary [0, {V})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{what} has {len(ids)} tokens; the context holds {self.max_model_len} (max_model_len), "
                "leaving no room to generate"
            )
        return ids

    def _encode(self, prompt: Prompt, i: int) -> list[int]:
        if isinstance(prompt, str):
            return self._check_ids(self.tokenizer.encode(prompt), f"prompt {i}")
        if isinstance(prompt, Sequence):
            return self._check_ids(prompt, f"prompt {i}")
        raise TypeError(f"prompt {i} is a {type(prompt).__name__}; expected a string or a list of token ids")

    # -- forward -------------------------------------------------------------------------------
    def _prefill(self, prompts: list[list[int]], rows: torch.Tensor) -> torch.Tensor:
        """Write each prompt into its cache row; returns the last-position hidden state [B, D]."""
        B, T = len(prompts), max(map(len, prompts))
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        batch = AttnBatch.causal(torch.zeros(B, dtype=torch.long, device=self.device), T, rows)
        h, _ = self.model(ids.to(self.device), batch, self.cache.kv_LRTC, absorb=self.absorb)
        return h[torch.arange(B, device=self.device), lens - 1]

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [T, vocab] of every position of one sequence, computed in a single forward."""
        ids = self._check_ids(token_ids, "token_ids")
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        batch = AttnBatch.causal(torch.zeros(1, dtype=torch.long, device=self.device), len(ids), rows)
        h, _ = self.model(torch.tensor([ids], device=self.device), batch, self.cache.kv_LRTC, absorb=self.absorb)
        return self.model.logits(h[0])

    @torch.inference_mode()
    def generate(self, prompts: Prompt | list[Prompt], sampling: SamplingParams | None = None) -> list[RequestOutput]:
        """One output per prompt; a single string or id list counts as one prompt."""
        sp = sampling or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling must be a k26.SamplingParams, got {type(sp).__name__}")
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        outs: list[RequestOutput] = []
        for start in range(0, len(encoded), self.cache.rows):
            outs += self._generate_batch(encoded[start : start + self.cache.rows], sp)
        return outs

    def _generate_batch(self, prompts: list[list[int]], sp: SamplingParams) -> list[RequestOutput]:
        B, dev = len(prompts), self.device
        stops = set(sp.stop_token_ids if sp.stop_token_ids is not None else self.tokenizer.stop_ids)
        gen = torch.Generator(device=dev).manual_seed(sp.seed) if sp.seed is not None else None
        outs = [RequestOutput(prompt_token_ids=p) for p in prompts]
        if sp.max_tokens == 0:
            for o in outs:
                o.finish_reason = "length"
            return outs
        rows = torch.arange(B, device=dev)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        logits = self.model.logits(self._prefill(prompts, rows))
        live = list(range(B))
        while True:
            tok_B = sample(logits, sp, gen)
            toks = tok_B.tolist()  # the one host read of the step: stop checks need it
            for b in list(live):
                o = outs[b]
                if toks[b] in stops:
                    o.finish_reason = "stop"
                else:
                    o.token_ids.append(toks[b])
                    if len(o.token_ids) >= sp.max_tokens or len(o.prompt_token_ids) + len(o.token_ids) >= self.max_model_len:
                        o.finish_reason = "length"
                if o.finish_reason:
                    live.remove(b)
            if not live:
                break
            batch = AttnBatch.causal(lens, 1, rows)
            h, _ = self.model(tok_B[:, None], batch, self.cache.kv_LRTC, absorb=self.absorb)
            logits = self.model.logits(h[:, 0])
            # Finished rows keep stepping (the batch stays rectangular) but stop advancing, so they
            # only ever overwrite their own last slot.
            alive = torch.zeros(B, dtype=torch.long)
            alive[live] = 1
            lens = lens + alive.to(dev)
        for o in outs:
            o.text = self.tokenizer.decode(o.token_ids, skip_special=True)
        return outs
