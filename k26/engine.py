"""`LLM`: load a checkpoint directory, score token sequences, and generate autoregressively.

Prompts of one call are prefilled together (right-padded: a causal query never sees the padding) and
then decoded one token per step for the whole batch, each sequence in its own cache row.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import numbers
import os
import warnings
import weakref
from collections.abc import Generator, Sequence
from pathlib import Path

import torch

from .config import ModelConfig
from .decode import BatchState, DecodeContext, Decoder, RequestOutput
from .dist import check_world, init_from_env, same_checkpoint_on_every_rank, tp_info
from .graphs.buckets import Bucket, default_batches
from .kv_cache import DrafterCache, LatentCache
from .loader import load_drafter, load_model
from .model import AttnBatch, KimiK2
from .sampling import SamplingParams
from .spec.step import SpecConfig, verify_nodes
from .tokenizer import Tokenizer
from .tp_driver import RankGroup

Prompt = str | Sequence[int]


def _surfacing_rank_errors(method):
    """Run `method` (a generator: its iteration) so that a collective failing because a TP rank died
    raises that rank's own error text."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def gen(self, *args, **kw):
            with self._surface_rank_errors():
                return (yield from method(self, *args, **kw))

        return gen

    @functools.wraps(method)
    def call(self, *args, **kw):
        with self._surface_rank_errors():
            return method(self, *args, **kw)

    return call


def _releasing_ranks_on_failure(init):
    """An `__init__` that fails after starting TP ranks kills them and destroys the group it made, so the
    process is as before (a retry starts afresh instead of finding a half-made group)."""

    @functools.wraps(init)
    def wrapper(self, *args, **kw):
        try:
            init(self, *args, **kw)
        except BaseException:
            if getattr(self, "_ranks", None) is not None:
                self._ranks.close(kill=True)
            if getattr(self, "_owns_group", False) and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            raise

    return wrapper


class LLM:
    @_releasing_ranks_on_failure
    def __init__(
        self,
        model_path: str | Path | None = None,
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
        graphs: bool | None = None,
        buckets: Sequence[tuple[int, int]] | None = None,
        compile: bool = False,
        cache_dir: str | Path | None = None,
    ):
        check_world(tp)
        check_device(device)
        if model_path is None:  # the embedded pair
            from .embedded import default_drafter_dir, default_model_dir

            model_path, drafter = default_model_dir(), drafter or default_drafter_dir()
        self.path = Path(model_path)
        # The group belongs to whoever made it: an LLM that found one (torchrun + the user's own
        # init_process_group, or an earlier LLM) must not destroy it on close().
        self._owns_group = tp > 1 and not torch.distributed.is_initialized()
        self._ranks: RankGroup | None = None
        if tp > 1 and not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
            # Ranks 1..tp-1 build this same LLM in their own processes and mirror its calls; this one joins as 0.
            self._ranks = RankGroup(
                tp,
                type(self),
                (str(self.path),),
                dict(
                    drafter=drafter,
                    device=device,
                    dtype=dtype,
                    tp=tp,
                    max_model_len=max_model_len,
                    max_batch=max_batch,
                    absorb=absorb,
                    progress=False,
                    cuda_kernels=cuda_kernels,
                    graphs=graphs,
                    buckets=buckets,
                    compile=compile,
                    cache_dir=cache_dir,
                ),
                str(device) if device else None,
            )
            weakref.finalize(
                self, self._ranks.close
            )  # also at exit; an LLM whose __init__ fails frees its ranks
        self.rank, world, dist_dev = (
            init_from_env(str(device) if device else None) if tp > 1 else (0, 1, None)
        )
        self.tp_size = tp
        self.device = dist_dev or torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or torch.bfloat16
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype={self.dtype}: expected torch.bfloat16, torch.float16 or torch.float32")
        # Graphs by default for bf16 on CUDA: other dtypes run the reference ops, which read lengths back
        # to the host and so cannot be captured.
        self.graphs = (
            (self.device.type == "cuda" and self.dtype == torch.bfloat16) if graphs is None else graphs
        )
        if self.graphs and self.device.type != "cuda":
            raise ValueError("graphs=True needs a CUDA device")
        if self.graphs and self.dtype != torch.bfloat16:
            raise ValueError(
                f"graphs=True needs dtype=torch.bfloat16 (got {self.dtype}): the CUDA kernels take bf16, "
                "and the reference ops other dtypes run read lengths back to the host, which a CUDA "
                "graph cannot capture; pass graphs=False"
            )
        self.config = ModelConfig.from_dir(self.path)
        self.tokenizer = Tokenizer.from_dir(self.path)
        if self.tokenizer.num_base + 256 != self.config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.num_base} base tokens + 256 specials, but config vocab_size is "
                f"{self.config.vocab_size}: tiktoken.model does not belong to this checkpoint"
            )
        self.max_model_len = max_model_len or default_max_model_len(self.config)
        if not 1 < self.max_model_len <= self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len}: must lie in (1, max_position_embeddings="
                f"{self.config.max_position_embeddings}]"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: expected a positive integer")
        self.absorb = absorb
        if tp > 1:
            with self._surface_rank_errors():
                same_checkpoint_on_every_rank(self.path)
        self.model: KimiK2 = load_model(
            self.path,
            self.config,
            device=self.device,
            dtype=self.dtype,
            progress=progress and self.rank == 0,
            cuda_kernels=cuda_kernels,
            tp=tp_info(self.rank, tp),
            group=torch.distributed.group.WORLD if tp > 1 else None,  # each shard read once across the ranks
            cache_dir=cache_dir,  # the optional load cache (k26/load_cache.py)
        )
        self.cache = LatentCache.allocate(self.config, max_batch, self.max_model_len, self.dtype, self.device)
        self.drafter, self.dcache = None, None
        if drafter is not None:
            self.drafter = load_drafter(
                drafter,
                self.config,
                device=self.device,
                dtype=self.dtype,
                tp=self.model.tp,
                cuda_kernels=cuda_kernels,
            )
            self.dcache = DrafterCache.allocate(
                self.drafter.cfg, max_batch, self.max_model_len, self.dtype, self.device, tp_size=tp
            )
        self.progress = progress
        self.user_buckets = [Bucket(*b) for b in buckets] if buckets else None
        for b in self.user_buckets or []:
            if b.batch > max_batch:
                raise ValueError(f"bucket {b}: batch {b.batch} exceeds max_batch={max_batch}")
        # torch.compile of the model body: fixed shapes per bucket, lengths and positions as tensors, so
        # decode never recompiles; it runs (and autotunes) in the warm-ups before each graph capture.
        self.model_fwd = torch.compile(self.model, fullgraph=True, dynamic=False) if compile else self.model
        self.decoder = Decoder(
            DecodeContext(
                self.model,
                self.model_fwd,
                self.drafter,
                self.cache,
                self.dcache,
                self.tokenizer,
                self.max_model_len,
                self.device,
                self.buckets_for,
                tp,
                absorb,
                self.graphs,
                progress,
            )
        )
        if self._ranks is not None:
            self._ranks.wait_ready()  # a rank that failed to build raises its own error here

    # -- tensor parallel driven from one Python process -------------------------------------------
    def _mirror(self, name: str, *args, **kw) -> None:
        if self._ranks is not None:
            self._ranks.mirror(name, *args, **kw)

    def _surface_rank_errors(self):
        """A collective that failed because a rank died raises that rank's own error instead."""
        return self._ranks.surface() if self._ranks is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Destroy this LLM's CUDA graphs, then the process group (graphs first: NCCL teardown with live
        graphs hangs), and stop the ranks it started."""
        if hasattr(self, "decoder"):
            self.decoder.runners.clear()
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if getattr(self, "_ranks", None) is not None:
            self._ranks.close()
        if getattr(self, "_owns_group", False) and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self._owns_group = False

    def _check_workers(self) -> None:
        """Raise the error of a rank that reported one."""
        if self._ranks is not None:
            self._ranks.check()

    def buckets_for(self, spec: SpecConfig) -> list[Bucket]:
        """The configured buckets, or one per power-of-two batch size at this method's verify width."""
        if self.user_buckets:
            return self.user_buckets
        block = self.drafter.cfg.block_size if self.drafter is not None else 1
        return [Bucket(b, verify_nodes(spec, block)) for b in default_batches(self.cache.rows)]

    # -- inputs --------------------------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        if isinstance(ids, str):  # a str is a Sequence too: its characters would pass for token ids
            raise TypeError(
                f"{what} is a str; expected token ids: encode the text first, llm.tokenizer.encode(text)"
            )
        if isinstance(
            ids, (bytes, bytearray)
        ):  # iterating bytes yields ints: they would be taken for token ids
            raise TypeError(
                f"{what} is {type(ids).__name__}; expected a str or token ids: decode it first, "
                "data.decode('utf-8')"
            )
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
                raise TypeError(
                    f"{what} is a {ids.dim()}-d {ids.dtype} tensor; expected a 1-d integer tensor of token ids"
                )
            ids = ids.tolist()
        ids = list(ids)
        if not ids:
            raise ValueError(f"{what} is empty")
        V = self.config.vocab_size
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(
                    f"{what}: token id {t!r} at position {pos} is a {type(t).__name__}; expected an int"
                )
            if not 0 <= t < V:
                raise ValueError(
                    f"{what}: token id {t!r} at position {pos} is outside the vocabulary [0, {V})"
                )
        ids = [int(t) for t in ids]
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{what} has {len(ids)} tokens; the context holds {self.max_model_len} (max_model_len), "
                "leaving no room to generate"
            )
        return ids

    def _encode(self, prompt: Prompt, i: int) -> list[int]:
        if isinstance(prompt, str):
            return self._check_ids(self.tokenizer.encode(prompt), f"prompt {i}")
        if isinstance(prompt, (Sequence, torch.Tensor)):
            return self._check_ids(prompt, f"prompt {i}")
        raise TypeError(f"prompt {i} is a {type(prompt).__name__}; expected a string or a list of token ids")

    # -- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    @_surfacing_rank_errors
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [T, vocab] of every position of one sequence, computed in a single forward."""
        ids = self._check_ids(token_ids, "token_ids")
        self._mirror("score", ids)
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        batch = AttnBatch.causal(torch.zeros(1, dtype=torch.long, device=self.device), len(ids), rows)
        h, _ = self.model(
            torch.tensor([ids], device=self.device), batch, self.cache.kv_LRTC, absorb=self.absorb
        )
        return self.model.logits(h[0])

    def _prepare(self, prompts, sampling, spec):
        sp = sampling or SamplingParams()
        spec = spec or SpecConfig(method="ddtree" if self.drafter is not None else "ar")
        if not isinstance(spec, SpecConfig):
            raise TypeError(f"spec must be a k26.SpecConfig, got {type(spec).__name__}")
        if spec.method != "ar" and self.drafter is None:
            raise ValueError(f"spec method {spec.method!r} needs a drafter: LLM(..., drafter=DIR)")
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling must be a k26.SamplingParams, got {type(sp).__name__}")
        if spec.method != "ar":
            spec = fit_spec(spec, self.max_model_len, self.drafter.cfg.block_size)
        if isinstance(prompts, (str, bytes, bytearray, torch.Tensor)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Integral)
        ):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        return [self._encode(p, i) for i, p in enumerate(prompts)], sp, spec

    @torch.inference_mode()
    @_surfacing_rank_errors
    def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecConfig | None = None
    ) -> Generator[str, None, RequestOutput]:
        """Yield text increments of one prompt as tokens are accepted (whole UTF-8 characters only); the
        generator returns the finished `RequestOutput`."""
        encoded, sp, spec = self._prepare(prompt, sampling, spec)
        if len(encoded) != 1:
            raise ValueError(f"stream() takes one prompt, got {len(encoded)}")
        self._mirror("stream", encoded[0], sp, spec)
        sent, o = "", None
        for outs in self.decoder.run(encoded, sp, spec):
            o = outs[0]
            text = (
                o.text
                if o.finish_reason == "stop" and o.text
                else _complete_utf8(self.tokenizer, o.token_ids)
            )
            if len(text) > len(sent):
                yield text[len(sent) :]
                sent = text
        return o  # the finished RequestOutput (stats, finish_reason): StopIteration.value

    @torch.inference_mode()
    @_surfacing_rank_errors
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt; a single string or id list counts as one prompt. `spec` picks the decoding
        method (default: DDTree with a drafter loaded, else autoregressive)."""
        encoded, sp, spec = self._prepare(prompts, sampling, spec)
        self._mirror("generate", encoded, sp, spec)
        outs: list[RequestOutput] = []
        for start in range(0, len(encoded), self.cache.rows):
            last = None
            for last in self.decoder.run(encoded[start : start + self.cache.rows], sp, spec):
                pass
            outs += last
        self._check_workers()
        return outs

    # -- continuous batching: one open batch driven step by step (the server's engine thread) ------
    # Every call is mirrored to the TP ranks in order, so their batches admit, step and retire alike.
    @torch.inference_mode()
    @_surfacing_rank_errors
    def open_batch(self, spec: SpecConfig | None = None, capacity: int | None = None) -> BatchState:
        """An empty batch of `capacity` rows (default: every cache row), its graphs captured and its
        budget costs measured; then `admit`, `step` and `release` move requests through it."""
        spec = self._prepare([[0]], None, spec)[2]
        capacity = capacity or self.cache.rows
        if not 1 <= capacity <= self.cache.rows:
            raise ValueError(f"capacity={capacity}: expected 1..{self.cache.rows} (max_batch)")
        self._mirror("open_batch", spec, capacity)
        self.batch = self.decoder.open(spec, capacity)
        return self.batch

    @torch.inference_mode()
    @_surfacing_rank_errors
    def admit(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
        """Prefill checked token-id prompts into free rows (between steps); returns their slots."""
        if len(prompts) > len(self.batch.free_slots()):
            raise ValueError(f"{len(prompts)} prompts, {len(self.batch.free_slots())} free rows")
        prompts = [self._check_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        self._mirror("admit", prompts, params)
        return self.decoder.admit(self.batch, prompts, params)

    @torch.inference_mode()
    @_surfacing_rank_errors
    def step(self) -> list[int]:
        """One step of every live row of the open batch; returns the rows that stepped."""
        self._mirror("step")
        return self.decoder.step(self.batch)

    @torch.inference_mode()
    def release(self, slot: int) -> RequestOutput | None:
        """Free a row (finished, or its request cancelled); returns its output."""
        self._mirror("release", slot)
        return self.decoder.release(self.batch, slot)


def _complete_utf8(tok: Tokenizer, ids: list[int]) -> str:
    """Text of `ids` up to the last complete UTF-8 character (a token may end mid-character)."""
    data = tok.decode_bytes([i for i in ids if i < tok.num_base])
    for cut in range(4):
        try:
            return data[: len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace")


def default_max_model_len(cfg: ModelConfig) -> int:
    """The context when none is given: 4K (the caches are allocated up front), or less if the model has less."""
    return min(cfg.max_position_embeddings, 4096)


def check_device(device) -> None:
    """A device the user names must exist here: found before any loading, said in one line."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda' or 'cuda:N' ({e})") from None
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA"
            if torch.version.cuda is None
            else "no GPU is visible (driver, CUDA_VISIBLE_DEVICES)"
        )
        raise ValueError(
            f"device={device!r}: CUDA is not available ({why}, torch {torch.__version__}); use device='cpu'"
        )
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def fit_spec(spec: SpecConfig, max_model_len: int, block_size: int) -> SpecConfig:
    """The speculative method as it fits the context. A step writes its whole verify tree past the sequence
    (the drafter its block), and the adaptive budget times its largest candidate at start-up, so a budget B
    needs max_model_len >= B + block_size + 1. "auto" keeps the candidates that fit (AR if none; said once);
    a fixed budget or DFlash chain refused when not even one step fits (later steps without room decode AR)."""
    room = max_model_len - block_size - 1  # the largest budget a step can verify
    if spec.auto:
        fit = tuple(c for c in spec.candidates if c <= room)
        if fit == spec.candidates:
            return spec
        if not fit:
            warnings.warn(
                f"max_model_len={max_model_len} leaves no room for a DDTree step (the smallest candidate "
                f"budget {spec.candidates[0]} + drafter block {block_size} + 1 > {max_model_len}): "
                "decoding autoregressively",
                stacklevel=3,
            )
            return SpecConfig("ar")
        n = len(fit)
        costs = spec.costs[: n + 1] if spec.costs else None
        per_token = spec.cost_per_token[:n] if spec.cost_per_token else None
        warnings.warn(
            f"max_model_len={max_model_len}: DDTree budgets limited to {fit} of {spec.candidates} "
            f"(a budget B needs B + drafter block {block_size} + 1 context tokens)",
            stacklevel=3,
        )
        return SpecConfig("ddtree", "auto", fit, costs, per_token)
    nodes = verify_nodes(spec, block_size)
    need = max(nodes, block_size) + 2  # one prompt token and the bonus, then the step's tree (drafter block)
    if max_model_len < need:
        what = (
            f"a DFlash step ({nodes} verify tokens)"
            if spec.method == "dflash"
            else f"DDTree budget {nodes - 1}"
        )
        raise ValueError(
            f"max_model_len={max_model_len} is too small for {what} with drafter block {block_size}: "
            f"it needs {need}; raise max_model_len, lower the budget, or use spec 'ar'"
        )
    return spec
