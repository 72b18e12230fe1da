"""`LLM`: load a checkpoint directory (and its drafter) onto one device or a TP group, plan the memory,
compile and capture; its calls are mixins.

Prompts of one call are prefilled together (a chunk of positions per forward, from where a cache row
already holds their prefix: `prefix_cache.py`) and then decoded a step at a time for the whole batch, each
sequence in its own cache row. The one-shot calls (`score`, `generate`, `stream`) are one_shot.py's, the
continuous-batching calls (`open_batch`, `admit`, `step`, `release`) continuous_batching.py's.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from .batch_state import BatchState
from .cache_dir import check_cache_dir
from .call_guard import CallGuard, one_at_a_time
from .chat import ChatFormat, Message, render
from .checks import (
    check_device,
    check_dtype,
    check_flags,
    check_gpus,
    check_ids,
    check_pair,
    check_path,
    check_precision,
    check_prefill,
)
from .continuous_batching import ContinuousBatching
from .decode import Decoder
from .decode_context import DecodeContext
from .dist import (
    builtin_values,
    check_allreduce,
    check_world,
    checkpoint_digest,
    init_from_env,
    same_setup_on_every_rank,
    tp_info,
)
from .graphs.buckets import Bucket, default_batches
from .kv_cache import DrafterCache, LatentCache
from .load_cache import compile_cache_file, load_compile_cache, save_compile_cache
from .loader import load_drafter, load_model
from .memory_plan import check_host_caches, check_memory, plan_memory
from .model import CompiledLayers, KimiK2
from .model.drafter import CompiledDrafter
from .one_shot import OneShotCalls
from .sampling import MODES
from .spec.prefill import MAX_CHUNK
from .spec.step import SpecConfig, verify_nodes
from .startup import StartupReport, phase_bar
from .tp_driver import RankGroup, group_found, releasing_ranks_on_failure, surfacing_rank_errors


class LLM(OneShotCalls, ContinuousBatching):
    """A loaded Kimi K2.x checkpoint (default: the embedded tiny pair) with its drafter, caches and graphs.

    `LLM(model_path, drafter=..., device=..., dtype=..., tp=..., max_model_len=..., max_batch=...)`; then
    `generate(prompts, SamplingParams, SpecConfig)`, `stream(prompt, ...)`, `score(token_ids)`, the batch API
    (`open_batch`, `admit`, `step`, `release`), `chat_ids(messages)` and `close()`. One call at a time; every
    argument is checked before any weights load (README, "Use")."""

    @releasing_ranks_on_failure
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
        capture: bool = False,
        allreduce: str = "fused",
        prefix_cache: bool = True,
        prefill_chunk: int = MAX_CHUNK,
        prefill_budget: int = 2 * MAX_CHUNK,
    ):
        # Ranks 1..tp-1 build this same LLM: every keyword argument travels (a new one too), see below.
        rank_kw = {k: v for k, v in locals().items() if k not in ("self", "model_path")}
        self._calls = CallGuard()  # one call at a time, none after close()
        check_world(tp)
        check_allreduce(allreduce)
        check_device(device)
        check_gpus(device, tp)
        check_prefill(prefill_chunk, prefill_budget)
        check_flags(absorb=absorb, progress=progress, cuda_kernels=cuda_kernels, graphs=graphs)
        check_flags(compile=compile, capture=capture, prefix_cache=prefix_cache)
        self.prefix_cache, self.prefill_chunk = prefix_cache, prefill_chunk
        self.prefill_budget, self.capture_at_start = prefill_budget, capture
        for name, value in (("model_path", model_path), ("drafter", drafter), ("cache_dir", cache_dir)):
            check_path(value, name)
        check_cache_dir(cache_dir)
        if model_path is None:  # the embedded pair
            from .embedded import default_drafter_dir, default_model_dir

            model_path, drafter = default_model_dir(), drafter or default_drafter_dir()
        self.path = Path(model_path)
        # The group belongs to whoever made it: an LLM that found one (torchrun + the user's own
        # init_process_group, or an earlier LLM) must not destroy it on close().
        self._owns_group = tp > 1 and not group_found()
        self._ranks: RankGroup | None = None
        dtype = check_dtype(dtype)
        pair = check_pair(self.path, drafter, tp, dtype, max_model_len, max_batch, buckets)
        self.config, self.tokenizer, self.max_model_len = pair.config, pair.tokenizer, pair.max_model_len
        self.user_buckets, dcfg = pair.buckets, pair.drafter  # (_load reuses the drafter's config)
        if tp > 1 and not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
            rank_kw.update(drafter=drafter, progress=False)  # the pair as resolved; rank 0 draws
            self._start_ranks(tp, device, rank_kw)
        self.rank, _, dist_dev = init_from_env(str(device) if device else None) if tp > 1 else (0, 1, None)
        self.tp_size, self.allreduce = tp, allreduce
        self.device = dist_dev or torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.graphs = check_precision(self.device, self.dtype, graphs)
        self.absorb = absorb
        self.progress = progress and self.rank == 0  # one set of progress lines, whatever the ranks were told
        self._load(drafter, dcfg, max_batch, self.progress, cuda_kernels, cache_dir)
        # torch.compile of the decoder layers and the drafter's block forward: fixed shapes per bucket,
        # lengths and positions as tensors, so decode never recompiles; it runs (and autotunes) in the
        # warm-ups before each graph capture.
        self.compiled = compile
        self.model_fwd = CompiledLayers(self.model) if compile else self.model
        self.drafter_fwd = CompiledDrafter(self.drafter) if compile and self.drafter is not None else None
        self._compile_cache = None  # torch.compile's artifacts (the body, the budget policies) for restarts
        if self.graphs and cache_dir is not None:
            self._compile_cache = compile_cache_file(cache_dir, self.path, self.device)
            load_compile_cache(self._compile_cache)
        self.decoder = Decoder(self._decode_context())
        self.batch: BatchState | None = None  # open_batch's
        self._streaming = False  # a stream() generator is suspended mid-way
        if capture and self.graphs:
            with self._surface_rank_errors(), torch.inference_mode():  # as every later capture runs
                self._capture(self._prepare([[0]], None, None)[2], MODES)
        if self._ranks is not None:
            self._ranks.wait_ready()  # a rank that failed to build raises its own error here

    def _start_ranks(self, tp: int, device, kw: dict) -> None:
        """Ranks 1..tp-1 build this same LLM (`kw`) in their own processes and mirror its calls; this one
        joins as 0. The arguments go as built-in values (paths as strings): a caller's own classes need not
        unpickle in a rank."""
        kw = {k: builtin_values(v) for k, v in kw.items()}
        self._ranks = RankGroup(tp, type(self), (str(self.path),), kw, str(device) if device else None)
        weakref.finalize(self, self._ranks.close)  # also at exit; an LLM whose __init__ fails frees its ranks

    def _load(self, drafter, dcfg, max_batch: int, progress: bool, cuda_kernels: bool, cache_dir) -> None:
        """The target (and drafter) weights, each rank its TP shard, and their caches."""
        tp = self.tp_size
        self._check_memory(dcfg, max_batch, cuda_kernels)
        if tp > 1:
            with self._surface_rank_errors():
                settings = self._settings(drafter, max_batch, cuda_kernels, cache_dir)
                same_setup_on_every_rank(self.path, settings)
        with self._surface_rank_errors():  # a rank failing mid-load (all-to-all) raises its own error
            self.model: KimiK2 = self._load_target(progress, cuda_kernels, cache_dir)
            self.startup = StartupReport.gather(self.model.load_stats, tp)  # every rank's bytes, here
        self.cache = LatentCache.allocate(self.config, max_batch, self.max_model_len, self.dtype, self.device)
        self.drafter, self.dcache = None, None
        if drafter is not None:
            with self._surface_rank_errors():
                self.drafter = load_drafter(
                    drafter,
                    self.config,
                    cfg=dcfg,
                    device=self.device,
                    dtype=self.dtype,
                    tp=self.model.tp,
                    cuda_kernels=cuda_kernels,
                )
            self.dcache = DrafterCache.allocate(
                self.drafter.cfg, max_batch, self.max_model_len, self.dtype, self.device, tp_size=tp
            )

    def _settings(self, drafter, max_batch: int, cuda_kernels: bool, cache_dir) -> dict:
        """What every TP rank must agree on besides the checkpoint (torchrun starts each from its own
        arguments)."""
        return {
            "max_model_len": self.max_model_len,
            "max_batch": max_batch,
            "dtype": str(self.dtype),
            "drafter": None if drafter is None else checkpoint_digest(drafter),
            "absorb": self.absorb,
            "cuda_kernels": cuda_kernels,
            "graphs": self.graphs,
            "capture": self.capture_at_start,
            "load_cache": cache_dir is not None,  # (its own collectives in the load; the path may differ)
            "allreduce": self.allreduce,
            "prefix_cache": self.prefix_cache,
            "prefill_chunk": self.prefill_chunk,
            "prefill_budget": self.prefill_budget,
            "buckets": self.user_buckets,  # (Buckets: k26's own class, compared as values)
        }

    def _check_memory(self, dcfg, max_batch: int, cuda_kernels: bool) -> None:
        """On CUDA, this rank's weights, caches and activations against its GPU's free memory, before any
        weight is read (memory_plan.py; every rank at once under TP); on the CPU its KV caches only."""
        if self.device.type != "cuda":
            args = (self.config, dcfg, max_batch, self.max_model_len, self.dtype, self.tp_size)
            return check_host_caches(*args)
        kernels = cuda_kernels and self.dtype == torch.bfloat16  # (the loader's condition for their layouts)
        plan = plan_memory(
            self.config,
            dcfg,
            self.dtype,
            self.tp_size,
            graphs=self.graphs,
            kernels=kernels,
            chunk=self.prefill_chunk,
            buckets=self.user_buckets,
        )
        with self._surface_rank_errors():
            check_memory(plan, max_batch, self.max_model_len, self.device, self.rank, self.tp_size)

    def _load_target(self, progress: bool, cuda_kernels: bool, cache_dir) -> KimiK2:
        tp = self.tp_size
        return load_model(
            self.path,
            self.config,
            device=self.device,
            dtype=self.dtype,
            progress=progress and self.rank == 0,
            cuda_kernels=cuda_kernels,
            tp=tp_info(self.rank, tp, allreduce=self.allreduce, device=self.device),
            group=torch.distributed.group.WORLD if tp > 1 else None,  # each shard read once across the ranks
            cache_dir=cache_dir,  # the optional load cache (k26/load_cache.py)
        )

    @one_at_a_time
    @torch.inference_mode()
    @surfacing_rank_errors
    def capture(self, spec: SpecConfig | None = None, greedy: bool = True, sampled: bool = True):
        """Capture the graphs of every batch size's bucket of `spec` (default: DDTree with a drafter, else
        AR) now rather than on first use, with one progress line; returns their `CaptureRecord`s (also in
        `self.startup.captures`). `LLM(..., capture=True)` does this at start-up."""
        if not self.graphs or not (greedy or sampled):  # (neither: no sampling mode, nothing to capture)
            return []
        kinds = tuple(m for m in MODES if (m == "greedy" and greedy) or (m != "greedy" and sampled))
        checked = self._prepare([[0]], None, spec)[2]  # a bad spec refused here, before the ranks run it
        self._check_bucket(checked, max(b.batch for b in self.buckets_for(checked)))
        # warm-ups and budget timings run on the caches as scratch
        self._overwriting_rows("capture()", "capture", checked, greedy, sampled)
        return self._capture(checked, kinds)

    def _capture(self, spec: SpecConfig, kinds: tuple[str, ...]):
        """Every batch size's buckets of `spec` (checked: `_prepare`'s), one progress line."""
        batches = sorted({b.batch for b in self.buckets_for(spec)})
        per_batch = (len(spec.candidates) if spec.auto else 1) * len(kinds)
        ctx, runners, t0 = self.decoder.ctx, self.decoder.runners, time.perf_counter()
        seen = {key: len(r.report) for key, r in runners.items()}
        ctx.progress, shown = False, ctx.progress  # one line for the whole set instead of one per batch
        try:
            with phase_bar("capture", len(batches) * per_batch, "graph", shown) as bar:
                for b in batches:
                    before = sum(len(r.report) for r in runners.values())
                    self.decoder.open(spec, b, kinds)
                    bar.update(sum(len(r.report) for r in runners.values()) - before)
        finally:
            ctx.progress = shown
        new = [
            rec._replace(kind=f"{s.method} {mode}")
            for (s, mode), r in runners.items()
            for rec in r.report[seen.get((s, mode), 0) :]
        ]
        self.startup.captures += new
        self.startup.phases["capture"] = self.startup.phases.get("capture", 0.0) + time.perf_counter() - t0
        if self._compile_cache is not None:
            save_compile_cache(self._compile_cache)
        return new

    def _decode_context(self) -> DecodeContext:
        """What the decoder needs of this LLM (the decoder never sees the LLM itself)."""
        return DecodeContext(
            self.model,
            self.model_fwd,
            self.drafter,
            self.cache,
            self.dcache,
            self.tokenizer,
            self.max_model_len,
            self.device,
            self.buckets_for,
            self.tp_size,
            self.absorb,
            self.graphs,
            self.progress,
            drafter_fwd=self.drafter_fwd,
            compiled=self.compiled,
            prefix_cache=self.prefix_cache,
            chunk=self.prefill_chunk,
            prefill_budget=self.prefill_budget,
        )

    # -- tensor parallel driven from one Python process -------------------------------------------
    def _mirror(self, name: str, *args, **kw) -> None:
        if self._ranks is not None:
            self._ranks.mirror(name, *args, **kw)

    def _surface_rank_errors(self):
        """A collective that failed because a rank died raises that rank's own error instead."""
        return self._ranks.surface() if self._ranks is not None else contextlib.nullcontext()

    def close(self, wait: float | None = None) -> None:
        """Destroy this LLM's CUDA graphs, then the process group (graphs first: NCCL teardown with live
        graphs hangs), and stop the ranks it started; every later call is refused. A call running in another
        thread is waited for (its graphs are not freed under its replay), at most `wait` seconds if given."""
        with self._calls.closing(wait) if hasattr(self, "_calls") else contextlib.nullcontext():
            self._close()

    def _close(self) -> None:
        if hasattr(self, "decoder"):
            for runner in self.decoder.runners.values():
                runner.graphs.clear()  # an open batch's stepper holds the same runners: free their graphs
            self.decoder.runners.clear()
        self.batch = None
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if getattr(self, "model", None) is not None:
            self.model.tp.close()  # after the sync: no kernel of ours still reads a peer's memory
        if getattr(self, "_ranks", None) is not None:
            self._ranks.close()
        if getattr(self, "_owns_group", False) and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self._owns_group = False

    @property
    def broken(self) -> str | None:
        """Why this LLM can run no further call (closed; its TP ranks failed or fell out of step), else None:
        a server's engine ends on it instead of stepping a batch that can only fail."""
        if self._calls.closed:
            return "this LLM is closed"
        why = self._ranks.broken if self._ranks is not None else None
        return f"its tensor-parallel ranks {why}" if why else None

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
    def _check_ids(self, ids: Sequence[int], what: str, generating: bool = True) -> list[int]:
        return check_ids(ids, what, self.config.vocab_size, self.max_model_len, generating)

    def chat_ids(self, messages: list[Message | dict], tools: list | None = None, thinking=None) -> list[int]:
        """A conversation's prompt ids in this model's chat format (`chat.render`; `thinking`: K2.5 / K2.6's
        think block, None its default). The answer's ids read back: `chat_parser.ChatParser`. A conversation
        too long for the context whatever its text encodes to is refused before it is encoded (PromptTooLong,
        a ValueError naming its largest part); others too long are refused by the call they are passed to."""
        fmt = ChatFormat.of_checkpoint(self.path, self.config.model_type).with_thinking(thinking)
        return render(self.tokenizer, messages, fmt, tools, max_tokens=self.max_model_len - 1)
