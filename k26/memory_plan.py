"""The device memory an `LLM` rank will hold, planned from the configs before any weight is read, and checked
on CUDA against what the rank's GPU has free (`check_memory`): at K2.6 scale a context or batch too large
for the KV caches would otherwise surface as a CUDA out-of-memory traceback after minutes of loading.

Per rank: its weights at this TP size and dtype (the meta model the loader fills, so exactly what it
allocates: int4 experts stay packed int32 words and bf16 scales), the KV caches (`cache_bytes`; the MLA
latent cache is replicated on every rank, the drafter's K/V split by heads) and a bound on the activations
and CUDA graph pools (`MemoryPlan.activations`). Host memory (CPU devices) is not planned: only the KV
caches, allocated whole after the load, are checked against it (`check_host_caches`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ModelConfig
from .drafter_config import DrafterConfig
from .graphs.buckets import Bucket
from .kv_cache import DrafterCache, LatentCache
from .model import KimiK2, TPInfo
from .model.drafter import DFlashDrafter
from .model.moe import Int4Experts
from .sampling import MODES
from .spec.step import SpecConfig, verify_nodes
from .stager import CHUNK

GiB = 1 << 30
# Device memory outside the planned tensors: cuBLAS workspaces, the kernel library's module, the attention
# kernel's per-shape split workspaces, allocator rounding, and under TP the fused all-reduce's buffers
# (mapped after the check). (The CUDA context and NCCL's communicator, made with the group before the check,
# are already outside the free memory measured.)
# Checked on one H100 (2026-12-06, TP 1: a K2.6-width target of 2 layers, one of 384 int4 experts, and a
# 1-layer drafter of K2.5-DFlash width; every sampling mode's graphs captured, 8 and 16 rows of 600-token
# prompts with prompt logprobs, top-p and plain sampling and greedy): the plan's weights and caches were
# the allocated bytes exactly; the peak was 25.4 / 29.9 GiB against 26.8 / 36.2 GiB planned, with 0.2 GiB
# outside torch's allocator. TP > 1 (NCCL) was not measured: hence the rounding up.
FIXED = 3 * GiB // 2
# A load holds, beside the weights, the stager's device batch, a coordinated round's send and receive
# buffers and a whole tensor read for a column slice (shard_reader.py): a few CHUNKs, before any cache —
# unless one tensor is larger than a CHUNK (`load_buffer_bytes`).
LOAD_BUFFERS = 4 * CHUNK
# Per position of a decode step, the sampler's full-vocabulary fp32 work (every rank gathers the logits,
# `VocabHead.forward`): the gathered logits and the gather's buffer, the noise, the sort's values and int64
# order, the softmax and its cumulative sums (sampling.py's "filter" / "logprobs" modes): 32 bytes a logit.
SAMPLER_BYTES_PER_LOGIT = 32


def cache_bytes(
    config: ModelConfig,
    dcfg: DrafterConfig | None,
    rows: int,
    max_model_len: int,
    dtype: torch.dtype,
    tp: int = 1,
) -> int:
    """Bytes `LLM(max_batch=rows)` allocates up front per rank for its caches (kv_cache.py): the target's
    latent cache (MLA: one latent per token, the same on every rank) and, with a drafter, its K/V (its
    heads split over the `tp` ranks; the extra trash row counted), every row at the full context."""
    per_position = LatentCache.bytes_per_token(config, dtype) * rows
    if dcfg is not None:
        per_position += DrafterCache.bytes_per_token(dcfg, dtype, tp) * (rows + 1)
    return per_position * max_model_len


def cache_rows_that_fit(
    config: ModelConfig,
    dcfg: DrafterConfig | None,
    max_model_len: int,
    dtype: torch.dtype,
    free: int,
    tp: int = 1,
) -> int:
    """The most rows (`max_batch`) whose caches (`cache_bytes`) take at most `free` bytes; 0: not one."""
    fixed = cache_bytes(config, dcfg, 0, max_model_len, dtype, tp)
    per_row = cache_bytes(config, dcfg, 1, max_model_len, dtype, tp) - fixed
    return max(0, (free - fixed) // per_row)


def free_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take now: the GPU's free memory, or the host's MemAvailable
    (Linux; elsewhere its physical memory, an upper bound); None where neither is known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # (kB)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def usable_memory(device: torch.device) -> int:
    """What this process can allocate on a CUDA `device`: the GPU's free memory plus the blocks torch's
    allocator holds unused (an earlier, closed LLM's: it reuses them; the GPU counts them as taken)."""
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free_memory(device) + cached


def check_score_logits(tokens: int, vocab: int, device: torch.device) -> None:
    """`LLM.score` returns float32 logits for every position ([tokens, vocab]: 21 GiB at K2.6's vocabulary and
    32K tokens), outside the start-up plan: refused, naming the sizes, before any forward when they (with the
    head's output they are gathered from) cannot fit what `device` has free."""
    need = 2 * tokens * vocab * 4
    have = usable_memory(device) if device.type == "cuda" else free_memory(device)
    if have is not None and need > have:
        most = max(0, have // (2 * vocab * 4))
        raise ValueError(
            f"score() of {tokens} tokens returns [{tokens}, {vocab}] float32 logits ({_gib(need)} with the "
            f"head's output they come from); {device} has {_gib(have)} free: "
            f"score at most {most} tokens at once"
        )


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


@dataclass(frozen=True)
class Weights:
    """One rank's weights as the loader allocates them, and what a load holds beside them for a while."""

    target: int
    drafter: int
    transient: int  # during the load only: read buffers, one MoE layer's experts repacked beside the old

    @property
    def total(self) -> int:
        return self.target + self.drafter


def weight_bytes(
    config: ModelConfig, dcfg: DrafterConfig | None, dtype: torch.dtype, tp: int, kernels: bool
) -> Weights:
    """The target and drafter built on the meta device at this TP size, as `loader.load_model` /
    `load_drafter` build them before `to_empty` allocates every parameter and buffer. `kernels`: the CUDA
    kernels' layouts follow (bf16 on CUDA): the int4 experts repacked a layer at a time (same bytes, the new
    layout beside the old), and each MLA's W_UK^T laid out as a copy (`MLA.fuse_`)."""
    with torch.device("meta"):
        target = KimiK2(config, dtype=dtype, tp=TPInfo(0, tp))
        drafter = DFlashDrafter(dcfg, dtype, TPInfo(0, tp)) if dcfg is not None else None
    repack, w_uk_t = 0, 0
    if kernels:
        repack = max((_tensor_bytes(m) for m in target.modules() if isinstance(m, Int4Experts)), default=0)
        heads = config.num_attention_heads // tp
        per_layer = heads * config.kv_lora_rank * config.qk_nope_head_dim * dtype.itemsize
        w_uk_t = per_layer * config.num_hidden_layers
    return Weights(
        _tensor_bytes(target) + w_uk_t,
        _tensor_bytes(drafter) if drafter is not None else 0,
        load_buffer_bytes(config, dtype, tp) + repack,
    )


def load_buffer_bytes(config: ModelConfig, dtype: torch.dtype, tp: int) -> int:
    """The read buffers a load holds beside the weights (shard_reader.py). Batches are at most a CHUNK, but a
    larger tensor goes alone and whole — the embedding and the head, vocab x hidden (2.2 GiB at K2.6) — as the
    stager's batch and the batch read ahead (the other of the two may be next), and under TP (coordinated
    reads) as the round's send buffer too (every rank's slices: the whole tensor again) beside this rank's
    slices received. The checkpoint's element size taken as at least bf16's (a float32 model's: its own)."""
    largest = max(config.vocab_size, config.intermediate_size) * config.hidden_size * max(2, dtype.itemsize)
    if largest <= CHUNK:
        return LOAD_BUFFERS
    held = 2 * largest + (largest + largest // tp if tp > 1 else 0)
    return max(LOAD_BUFFERS, held + CHUNK)


def layer_bytes_per_token(
    config: ModelConfig, dcfg: DrafterConfig | None, tp: int, dtype: torch.dtype
) -> int:
    """Activations one position holds at a decoder layer's peak (a forward frees a layer's before the next):
    a few hidden-state copies (the residual, the normed input, the attention and MoE outputs, the
    all-reduce's) and the target-layer states the drafter keeps; MLA's q, q absorbed into the latent, the
    latent output and its W_UV projection; per routed (token, expert) pair the fp32 down output before the
    combine and the gate / up activations (or a dense layer's MLP, whichever is larger)."""
    s, D = dtype.itemsize, config.hidden_size
    heads = config.num_attention_heads // tp
    hidden = (8 + (len(dcfg.target_layer_ids) if dcfg is not None else 0)) * D * s
    attention = heads * (config.qk_head_dim + 2 * config.kv_lora_rank + config.v_head_dim) * s
    attention += (config.q_lora_rank + config.latent_dim) * s
    moe = config.num_experts_per_tok * (4 * D + 2 * config.moe_intermediate_size // tp * s)
    moe += 4 * config.n_routed_experts
    return hidden + attention + max(moe, 2 * config.intermediate_size // tp * s)


def _gib(n: int) -> str:
    return f"{n / GiB:,.1f} GiB"


def _largest(lo: int, hi: int, fits) -> int:
    """The largest x in [lo, hi] with fits(x) (monotone: true up to some x); 0 if none."""
    if hi < lo or not fits(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's device memory for `rows` cache rows (`max_batch`) at a context of `length` positions."""

    config: ModelConfig
    drafter: DrafterConfig | None
    dtype: torch.dtype
    tp: int
    weights: Weights
    chunk: int  # prefill positions per row and forward (LLM's prefill_chunk)
    nodes: int  # verify positions per row of the widest default decode bucket (1: AR)
    buckets: tuple[Bucket, ...]  # the user's graph buckets (none: one per batch size at `nodes`)
    graphs: bool

    def caches(self, rows: int, length: int) -> int:
        return cache_bytes(self.config, self.drafter, rows, length, self.dtype, self.tp)

    def activations(self, rows: int) -> int:
        """A bound from the widest forwards (`FIXED` on top). Prefill: `rows` x `chunk` positions, each with
        a layer's activations and this rank's fp32 logits twice over (prompt logprobs: the logits and the
        log-sum-exp's work). A decode step: its bucket's positions, each with a layer's activations and the
        sampler's full-vocabulary work. With CUDA graphs every sampling mode's captured graphs keep a pool
        of their own, sized by their widest bucket (graphs/runner.py), for the speculative method and for
        the AR steps near the context end; the eager prefill's blocks are apart from them. Without graphs
        the eager steps reuse the prefill's blocks: the larger of the two."""
        cfg, layer = self.config, layer_bytes_per_token(self.config, self.drafter, self.tp, self.dtype)
        prefill = rows * self.chunk * (layer + 2 * 4 * (cfg.vocab_size // self.tp))
        per_step_token = layer + SAMPLER_BYTES_PER_LOGIT * cfg.vocab_size
        widest = max((b.batch * b.nodes for b in self.buckets), default=rows * self.nodes)
        if not self.graphs:
            return FIXED + max(prefill, widest * per_step_token)
        # A speculative decoder steps AR near the context end: its runners have pools of their own, sized by
        # the same user buckets or by one position a row.
        ar = (widest if self.buckets else rows) * per_step_token if self.drafter is not None else 0
        return FIXED + prefill + len(MODES) * (widest * per_step_token + ar)

    def need(self, rows: int, length: int) -> int:
        """The rank's peak: the weights, then the larger of the load's transient buffers (before any cache
        exists) and the caches with the activations."""
        transient = self.weights.transient
        return self.weights.total + max(transient, self.caches(rows, length) + self.activations(rows))

    def refusal(self, rows: int, length: int, free: int, where: str) -> str | None:
        """None if the plan fits `free` bytes; else one line naming what to change (`where`: the device)."""
        if self.need(rows, length) <= free:
            return None
        w, drafter = self.weights, self.drafter is not None
        weights = f"the weights' {_gib(w.total)}" + (f" (drafter {_gib(w.drafter)})" if drafter else "")
        have = f"{where} has {_gib(free)} free"
        batch = _largest(1, rows - 1, lambda b: self.need(b, length) <= free)
        context = _largest(2, length - 1, lambda n: self.need(rows, n) <= free)
        alone = _largest(2, length - 1, lambda n: self.need(1, n) <= free)
        if not (batch or context or alone):
            # (the load's transient buffers count too: the line must add up when they alone break it)
            load = f", the load {_gib(w.transient)} more for a while" if w.total + w.transient > free else ""
            return (
                f"tp={self.tp}: the weights need {_gib(w.total)} a rank"
                + (f" (drafter {_gib(w.drafter)})" if drafter else "")
                + f"{load} and activations and graph pools {_gib(self.activations(1))}: {have}, no room for "
                f"the KV caches of even max_batch=1 (asked: max_batch={rows}, max_model_len={length}); raise "
                "tp (each rank holds 1/tp of the weights) or free GPU memory"
            )
        # (user buckets larger than the batch suggested would be refused with it: said here, not found next)
        within = " with buckets within it" if batch and any(b.batch > batch for b in self.buckets) else ""
        if batch and context:
            fits = (
                f"at most max_batch={batch}{within} fits at this length (or max_model_len={context} at this "
                "batch)"
            )
        elif batch:
            fits = f"at most max_batch={batch}{within} fits at this length"
        elif context:
            fits = f"not even max_batch=1 fits at this length; at most max_model_len={context} at this batch"
        else:
            fits = (
                "neither a smaller max_batch at this length nor a shorter max_model_len at this batch fits; "
                f"max_batch=1 fits up to max_model_len={alone}"
            )
        return (
            f"max_model_len={length}, max_batch={rows}: the KV caches need {_gib(self.caches(rows, length))}"
            f" a rank on top of {weights} and {_gib(self.activations(rows))} of activations and graph "
            f"pools; {have}; {fits}"
        )


def plan_memory(
    config: ModelConfig,
    drafter: DrafterConfig | None,
    dtype: torch.dtype,
    tp: int,
    *,
    graphs: bool,
    kernels: bool,
    chunk: int,
    buckets: list[Bucket] | None,
) -> MemoryPlan:
    """The plan of `LLM`'s arguments (`kernels`: the CUDA kernels' layouts, bf16 with cuda_kernels=True).
    Default buckets verify the default method's widest tree (DDTree "auto" with a drafter, else AR): `LLM`
    does not know the specs it will be asked for, so wider trees asked later (a larger DDTree budget, more
    candidates) are outside the plan — their graphs' pools grow with the tree (README, memory plan)."""
    block = drafter.block_size if drafter is not None else None
    nodes = 1 if block is None else max(verify_nodes(SpecConfig("ddtree"), block), block)
    weights = weight_bytes(config, drafter, dtype, tp, kernels)
    return MemoryPlan(config, drafter, dtype, tp, weights, chunk, nodes, tuple(buckets or ()), graphs)


def check_memory(plan: MemoryPlan, rows: int, length: int, device: torch.device, rank: int, tp: int) -> None:
    """Refuse, in one line naming max_batch / max_model_len and the values that fit, a plan that does not
    fit the rank's GPU, before any weight is read. Run on every rank at the same point (LLM._load's start):
    under TP the ranks share what each has free and every rank refuses with the tightest GPU's line, so rank
    0 (the user's process) raises it itself, without waiting for another rank's failure to reach it. CPU:
    nothing (host memory is not the engine's to plan)."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    where = f"cuda:{index}" + (f" (tensor-parallel rank {rank})" if tp > 1 else "")
    mine = (usable_memory(device), where)
    if tp > 1:
        everyone: list = [None] * tp
        dist.all_gather_object(everyone, mine)
        mine = min(everyone)  # the least free memory decides
    if why := plan.refusal(rows, length, *mine):
        raise ValueError(why)


def check_host_caches(
    config: ModelConfig, dcfg: DrafterConfig | None, rows: int, length: int, dtype: torch.dtype, tp: int
) -> None:
    """CPU: refuse, before any weight is read, KV caches (`cache_bytes`, every local rank's) larger than the
    host's free memory, naming max_batch / max_model_len and the max_batch that fits; they would otherwise
    fail to allocate after the load, with a traceback. (The weights and activations are not planned.)"""
    free = free_memory(torch.device("cpu"))
    need = tp * cache_bytes(config, dcfg, rows, length, dtype, tp)
    if free is None or need <= free:
        return
    fit = cache_rows_that_fit(config, dcfg, length, dtype, free // tp, tp)
    fits = (
        f"at most max_batch={fit} fits at this length" if fit else "not even max_batch=1 fits at this length"
    )
    raise ValueError(
        f"max_model_len={length}, max_batch={rows}: the KV caches need {_gib(need)}"
        + (f" over {tp} ranks" if tp > 1 else "")
        + f" and this machine has {_gib(free)} free; {fits}"
    )
