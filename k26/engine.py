"""`LLM`: load a checkpoint directory, score token sequences, and generate autoregressively.

Prompts of one call are prefilled together (right-padded: a causal query never sees the padding) and
then decoded one token per step for the whole batch, each sequence in its own cache row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .config import ModelConfig
from .kv_cache import DrafterCache, LatentCache
from .loader import load_drafter, load_model
from .model import AttnBatch, KimiK2
from .sampling import SamplingParams, sample
from .spec.step import SpecConfig, speculative_step
from .tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass
class SpecStats:
    accepted_per_step: list[int] = field(default_factory=list)  # tokens emitted per target verify
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tau(self) -> float:
        """Tokens per target forward (accepted drafts + the bonus), prefill excluded."""
        return sum(self.accepted_per_step) / len(self.accepted_per_step) if self.accepted_per_step else 1.0


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated, without the stop token
    text: str = ""  # decoded token_ids, special tokens left out
    finish_reason: str | None = None  # "stop" | "length"
    stats: SpecStats = field(default_factory=SpecStats)


class LLM:
    def __init__(
        self,
        model_path: str | Path,
        *,
        drafter: str | Path | None = None,
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
        self.drafter, self.dcache = None, None
        if drafter is not None:
            self.drafter = load_drafter(drafter, self.config, device=self.device, dtype=self.dtype)
            self.dcache = DrafterCache.allocate(self.drafter.cfg, max_batch, self.max_model_len, self.dtype, self.device)

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
    def _prefill(self, prompts: list[list[int]], rows: torch.Tensor, aux_layers: tuple[int, ...] = ()):
        """Write each prompt into its cache row; returns the last-position hidden state [B, D] and the
        drafter features of every prompt position [B, T, X] (None without aux_layers)."""
        B, T = len(prompts), max(map(len, prompts))
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        batch = AttnBatch.causal(torch.zeros(B, dtype=torch.long, device=self.device), T, rows)
        h, aux = self.model(ids.to(self.device), batch, self.cache.kv_LRTC, aux_layers=aux_layers, absorb=self.absorb)
        return h[torch.arange(B, device=self.device), lens - 1], aux

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [T, vocab] of every position of one sequence, computed in a single forward."""
        ids = self._check_ids(token_ids, "token_ids")
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        batch = AttnBatch.causal(torch.zeros(1, dtype=torch.long, device=self.device), len(ids), rows)
        h, _ = self.model(torch.tensor([ids], device=self.device), batch, self.cache.kv_LRTC, absorb=self.absorb)
        return self.model.logits(h[0])

    @torch.inference_mode()
    def generate(
        self, prompts: Prompt | list[Prompt], sampling: SamplingParams | None = None, spec: SpecConfig | None = None
    ) -> list[RequestOutput]:
        """One output per prompt; a single string or id list counts as one prompt. `spec` picks the decoding
        method (default: DDTree with a drafter loaded, else autoregressive)."""
        sp = sampling or SamplingParams()
        spec = spec or SpecConfig(method="ddtree" if self.drafter is not None else "ar")
        if not isinstance(spec, SpecConfig):
            raise TypeError(f"spec must be a k26.SpecConfig, got {type(spec).__name__}")
        if spec.method != "ar" and self.drafter is None:
            raise ValueError(f"spec method {spec.method!r} needs a drafter: LLM(..., drafter=DIR)")
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling must be a k26.SamplingParams, got {type(sp).__name__}")
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        outs: list[RequestOutput] = []
        for start in range(0, len(encoded), self.cache.rows):
            outs += self._generate_batch(encoded[start : start + self.cache.rows], sp, spec)
        return outs

    def _generate_batch(self, prompts: list[list[int]], sp: SamplingParams, spec: SpecConfig) -> list[RequestOutput]:
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
        use_spec = spec.method != "ar"
        aux_layers = self.drafter.cfg.target_layer_ids if use_spec else ()
        h, aux = self._prefill(prompts, rows, aux_layers)
        if use_spec:
            T = aux.shape[1]
            pos = torch.arange(T, device=dev).expand(B, T)
            self.drafter.append_context(self.dcache.k, self.dcache.v, aux, pos, rows, valid_BC=pos < lens[:, None])
        bonus = sample(self.model.logits(h), sp, gen)
        live = list(range(B))
        self._emit(outs, live, [[t] for t in bonus.tolist()], stops, sp)
        timer = _Timer(dev) if use_spec else None
        while live:
            alive = torch.zeros(B, dtype=torch.bool)
            alive[live] = True
            alive = alive.to(dev)
            if use_spec:
                n_nodes = 1 + (self.drafter.cfg.block_size - 1 if spec.method == "dflash" else spec.budget or self.drafter.cfg.block_size - 1)
                room = min(self.max_model_len - n_nodes, self.dcache.k.shape[2] - self.drafter.cfg.block_size)
                if max(len(outs[b].prompt_token_ids) + len(outs[b].token_ids) for b in live) > room:
                    for b in live:  # no room for another verify tree: stop where AR would need the context
                        outs[b].finish_reason = "length"
                    break
                r = speculative_step(self.model, self.drafter, self.cache.kv_LRTC, self.dcache, rows, lens, bonus,
                                     alive, spec, sp, gen, self.absorb, timer)
                emitted, counts = r.emitted.tolist(), r.n_emitted.tolist()  # the step's one host read
                for b in live:
                    outs[b].stats.accepted_per_step.append(counts[b])
                self._emit(outs, live, [e[: counts[b]] for b, e in enumerate(emitted)], stops, sp)
                lens = lens + r.n_emitted
                bonus = r.bonus
            else:
                batch = AttnBatch.causal(lens, 1, rows)
                h, _ = self.model(bonus[:, None], batch, self.cache.kv_LRTC, absorb=self.absorb)
                bonus = sample(self.model.logits(h[:, 0]), sp, gen)
                lens = lens + alive.long()  # finished rows stay frozen and only rewrite their own last slot
                self._emit(outs, live, [[t] for t in bonus.tolist()], stops, sp)
        for o in outs:
            o.text = self.tokenizer.decode(o.token_ids, skip_special=True)
            if timer is not None:
                o.stats.draft_s, o.stats.verify_s = timer.total("draft"), timer.total("verify")
        return outs

    def _emit(self, outs, live: list[int], new: list[list[int]], stops: set[int], sp: SamplingParams) -> None:
        """Append each live sequence's new tokens, stopping at a stop id, max_tokens or the context end."""
        for b in list(live):
            o = outs[b]
            for t in new[b]:
                if t in stops:
                    o.finish_reason = "stop"
                    break
                o.token_ids.append(t)
                if len(o.token_ids) >= sp.max_tokens or len(o.prompt_token_ids) + len(o.token_ids) >= self.max_model_len:
                    o.finish_reason = "length"
                    break
            if o.finish_reason:
                live.remove(b)


class _Timer:
    """Phase times without a sync per step: CUDA events on GPU (read at the end), wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    def __call__(self, name: str):
        return _Span(self, name)

    def total(self, name: str) -> float:
        spans = self.spans.get(name, [])
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return sum(spans)


class _Span:
    def __init__(self, timer: _Timer, name: str):
        self.t, self.name = timer, name

    def __enter__(self):
        if self.t.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.a = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.t.cuda:
            b = torch.cuda.Event(enable_timing=True)
            b.record()
            self.t.spans.setdefault(self.name, []).append((self.a, b))
        else:
            self.t.spans.setdefault(self.name, []).append(time.perf_counter() - self.a)
        return False
