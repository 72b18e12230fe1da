"""What a user passes to `LLM` (and the CLI, before loading anything), checked: every refusal one line that
names the argument and says what to change; and the speculative method fitted to the context."""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from .call_guard import user_stacklevel
from .config import ModelConfig
from .dist import as_exact, local_rank
from .drafter_config import DrafterConfig
from .graphs.buckets import Bucket
from .loader import check_drafter_files
from .sampling import SamplingParams
from .spec.prefill import MAX_CHUNK
from .spec.step import MAX_BUDGET, SpecConfig, verify_nodes
from .tokenizer import Tokenizer


def check_device(device) -> None:
    """A device the user names must exist here: found before any loading, said in one line."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda' or 'cuda:N' ({e})") from None
    if dev.type not in ("cpu", "cuda"):  # (torch knows 'mps', 'meta', 'xpu'...: k26 runs on neither)
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda' or 'cuda:N'; k26 runs on no other")
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


def check_gpus(device, tp: int) -> None:
    """LLM(tp=N) on CUDA starts N ranks from this process, rank r on cuda:r: N GPUs must be visible, found
    before any rank starts (under torchrun each process brings its own), and a device index is refused (no
    rank would honour it) — under torchrun or in a group already made, one other than the rank's own
    cuda:LOCAL_RANK. `device` already checked."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    index = None if device is None else torch.device(device).index
    if tp > 1 and cuda and index is not None:  # (init_group puts each rank on cuda:local_rank())
        if "WORLD_SIZE" not in os.environ and not torch.distributed.is_initialized():
            raise ValueError(
                f"device={device!r} with tp={tp}: rank r runs on cuda:r; pass device='cuda' and choose the "
                "GPUs with CUDA_VISIBLE_DEVICES"
            )
        if index != (own := local_rank()):
            raise ValueError(
                f"device={device!r} with tp={tp}: this rank runs on cuda:{own} (LOCAL_RANK); pass "
                f"device='cuda' or 'cuda:{own}'"
            )
    if tp > 1 and cuda and tp > torch.cuda.device_count() and "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"tp={tp}: only {torch.cuda.device_count()} CUDA device(s) are visible (one per rank)"
        )


def check_dtype(dtype) -> torch.dtype:
    """The model's dtype (None: bf16), refused by name before anything is built with it (a drafter's meta
    model or the TP ranks were: a string such as "bf16" reached torch.empty, a TypeError naming nothing)."""
    dtype = torch.bfloat16 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype={dtype!r}: expected torch.bfloat16, torch.float16 or torch.float32")
    return dtype


def check_precision(device: torch.device, dtype: torch.dtype, graphs: bool | None) -> bool:
    """The dtype, and whether to decode with CUDA graphs: by default for bf16 on CUDA (other dtypes run the
    reference ops, which read lengths back to the host and so cannot be captured)."""
    dtype = check_dtype(dtype)
    graphs = (device.type == "cuda" and dtype == torch.bfloat16) if graphs is None else graphs
    if graphs and device.type != "cuda":
        raise ValueError("graphs=True needs a CUDA device")
    if graphs and dtype != torch.bfloat16:
        raise ValueError(
            f"graphs=True needs dtype=torch.bfloat16 (got {dtype}): the CUDA kernels take bf16, "
            "and the reference ops other dtypes run read lengths back to the host, which a CUDA "
            "graph cannot capture; pass graphs=False"
        )
    return graphs


def check_tokenizer(tokenizer: Tokenizer, config: ModelConfig) -> None:
    if tokenizer.num_base + 256 != config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.num_base} base tokens + 256 specials, but config vocab_size is "
            f"{config.vocab_size}: tiktoken.model does not belong to this checkpoint"
        )


def default_max_model_len(cfg: ModelConfig) -> int:
    """The context when none is given: 4K (the caches are allocated up front), or less if the model has
    less."""
    return min(cfg.max_position_embeddings, 4096)


def check_lengths(config: ModelConfig, max_model_len: int | None, max_batch: int) -> int:
    """The context length (`default_max_model_len` when None), checked with the batch size."""
    for name, v in (("max_model_len", max_model_len), ("max_batch", max_batch)):
        if (v is not None or name == "max_batch") and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{name}={v!r}: expected an integer")
    max_model_len = default_max_model_len(config) if max_model_len is None else max_model_len
    if not 1 < max_model_len <= config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len}: must lie in (1, max_position_embeddings="
            f"{config.max_position_embeddings}]"
        )
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: expected a positive integer")
    return max_model_len


def check_prefill(chunk: int, budget: int) -> None:
    """The prefill's positions per row and forward (1 up to the attention kernel's largest query) and per
    decode step of deferred prefills (positive)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"prefill_chunk={chunk!r}: expected an integer in [1, {MAX_CHUNK}]")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"prefill_budget={budget!r}: expected a positive integer")


def check_drafter(drafter, config: ModelConfig, dtype: torch.dtype, tp: int) -> DrafterConfig | None:
    """The drafter directory's config (None: no drafter) against the target's, and its files planned at this
    TP size (`loader.check_drafter_files`), before any of the target's weights is read."""
    if drafter is None:
        return None
    cfg = DrafterConfig.from_dir(drafter)
    cfg.check_target(config)
    check_drafter_files(drafter, cfg, dtype, tp)
    return cfg


@dataclass(frozen=True)
class Pair:
    """What `LLM` checks of its checkpoint pair before any rank starts or any weight is read."""

    config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    buckets: list[Bucket] | None
    drafter: DrafterConfig | None


def check_pair(path, drafter, tp: int, dtype: torch.dtype, max_model_len, max_batch: int, buckets) -> Pair:
    """The target's config at this TP size, its tokenizer, the lengths and buckets, and the drafter's config
    and files (`check_drafter`)."""
    config = ModelConfig.from_dir(path)
    config.check_tp(tp)
    tokenizer = Tokenizer.from_dir(path)
    check_tokenizer(tokenizer, config)
    lengths, user = check_lengths(config, max_model_len, max_batch), check_buckets(buckets, max_batch)
    return Pair(config, tokenizer, lengths, user, check_drafter(drafter, config, dtype, tp))


def check_flags(**flags) -> None:
    """LLM's on / off arguments are bools (graphs may also be None: the default): a string such as "no" or
    "0" (an environment variable's) would be taken for True, silently."""
    for name, v in flags.items():
        if not isinstance(v, bool) and not (name == "graphs" and v is None):
            raise TypeError(
                f"{name}={v!r}: expected True or False" + (" (or None)" if name == "graphs" else "")
            )


def check_path(value, name: str) -> None:
    """A directory argument: None, or a str or path."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}={value!r}: expected a path (str or os.PathLike)")
    if value == "":  # (Path("") is the current directory: an unset variable would read or write there)
        raise ValueError(f"{name}='': an empty path; pass a directory (or None)")


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_buckets(buckets: Sequence[tuple[int, int]] | None, max_batch: int) -> list[Bucket] | None:
    """The user's graph buckets (batch, verify tokens), each within max_batch; None: the default ones."""
    if buckets is not None and (isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence)):
        raise ValueError(f"buckets={buckets!r}: expected a list of (batch, verify tokens) pairs")
    for b in buckets or []:
        if not (isinstance(b, Sequence) and len(b) == 2 and all(_int(x) and x >= 1 for x in b)):
            raise ValueError(f"bucket {b!r}: expected (batch, verify tokens), two positive integers")
    user = [Bucket(*b) for b in buckets] if buckets else None
    for b in user or []:
        if b.batch > max_batch:
            raise ValueError(f"bucket {b}: batch {b.batch} exceeds max_batch={max_batch}")
        if b.nodes > MAX_BUDGET + 1:  # (else found only at its graph capture, after the whole load)
            raise ValueError(
                f"buckets: {b} has {b.nodes} verify tokens; at most {MAX_BUDGET + 1} (the tree-attention "
                f"kernel's maximum, a DDTree budget of {MAX_BUDGET})"
            )
    return user


def check_ids(
    ids: Sequence[int], what: str, vocab: int, max_model_len: int, generating: bool = True
) -> list[int]:
    """Token ids as a list of ints in the vocabulary, leaving room to generate (`generating`; else, for
    `LLM.score`, fitting the context)."""
    if isinstance(ids, str):  # a str is a Sequence too: its characters would pass for token ids
        raise TypeError(
            f"{what} is a str; expected token ids: encode the text first, llm.tokenizer.encode(text)"
        )
    if isinstance(ids, (bytes, bytearray)):  # iterating bytes yields ints: they would be taken for token ids
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
    if isinstance(ids, (AbstractSet, Mapping)):  # (their order is not the prompt's; a dict gave its keys)
        raise TypeError(f"{what} is a {type(ids).__name__}; expected a list of token ids, in order")
    try:
        ids = list(ids)
    except TypeError:  # (an int or None: Python's "'int' object is not iterable" named no argument)
        raise TypeError(f"{what} is a {type(ids).__name__}; expected a list of token ids") from None
    if not ids:
        raise ValueError(f"{what} is empty")
    for pos, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(
                f"{what}: token id {t!r} at position {pos} is a {type(t).__name__}; expected an int"
            )
        if not 0 <= t < vocab:
            raise ValueError(
                f"{what}: token id {t!r} at position {pos} is outside the vocabulary [0, {vocab})"
            )
    ids = [int(t) for t in ids]
    if not generating and len(ids) > max_model_len:
        raise ValueError(f"{what} has {len(ids)} tokens; the context holds {max_model_len} (max_model_len)")
    if generating and len(ids) >= max_model_len:
        raise ValueError(
            f"{what} has {len(ids)} tokens; the context holds {max_model_len} (max_model_len), "
            "leaving no room to generate"
        )
    return ids


def prompt_list(prompts) -> list:
    """The prompts of one call as a list: a single string, byte string, tensor or id list is one prompt (a
    NumPy array: its rows' lists)."""
    if hasattr(prompts, "__array__") and not isinstance(prompts, torch.Tensor):  # NumPy: no truth value
        prompts = prompts.tolist()
    if prompts is None or not isinstance(prompts, (Sequence, torch.Tensor)):
        raise TypeError(
            f"prompts is {type(prompts).__name__ if prompts is not None else 'None'}; expected a string, a "
            "list of token ids, or a list of those"
        )
    if isinstance(prompts, memoryview):  # (a Sequence of ints: its bytes were taken for token ids)
        raise TypeError("prompts is a memoryview; expected a str or token ids: decode it, bytes(m).decode()")
    # One prompt: a string, a tensor, or ids (a float among them is then named as one, not as a prompt)
    if isinstance(prompts, (str, bytes, bytearray, torch.Tensor)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Real)
    ):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts is empty")
    return prompts


def encode_prompts(prompts, tokenizer: Tokenizer, vocab: int, max_model_len: int) -> list[list[int]]:
    """The prompts of one call (`prompt_list`) as checked id lists: strings encoded, id sequences checked."""
    out = []
    for i, prompt in enumerate(prompt_list(prompts)):
        if hasattr(prompt, "__array__") and not isinstance(prompt, torch.Tensor):  # NumPy ids
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            try:
                prompt = tokenizer.encode(prompt)
            except ValueError as e:  # (a lone surrogate)
                raise ValueError(f"prompt {i}: {e}") from None
        elif not isinstance(prompt, (Sequence, torch.Tensor)):
            raise TypeError(
                f"prompt {i} is a {type(prompt).__name__}; expected a string or a list of token ids"
            )
        out.append(check_ids(prompt, f"prompt {i}", vocab, max_model_len))
    return out


def check_sampling(sp: SamplingParams, vocab: int) -> SamplingParams:
    """What SamplingParams cannot check alone: its logit_bias and stop_token_ids ids lie in the vocabulary."""
    if not isinstance(sp, SamplingParams):
        raise TypeError(f"sampling must be a k26.SamplingParams, got {type(sp).__name__}")
    sp = as_exact(sp, SamplingParams)
    for name, ids in (
        ("logit_bias", [i for i, _ in sp.logit_bias]),
        ("stop_token_ids", sp.stop_token_ids or ()),
    ):
        if bad := [i for i in ids if i >= vocab]:
            raise ValueError(
                f"SamplingParams.{name}: token id {bad[0]} is not below the vocabulary size {vocab}"
            )
    return sp


def check_request(
    sampling: SamplingParams | None,
    spec: SpecConfig | None,
    block: int | None,
    max_model_len: int,
    vocab: int,
) -> tuple[SamplingParams, SpecConfig]:
    """A call's sampling and speculative method (defaults: SamplingParams(); DDTree with a drafter of
    `block` tokens per block, else autoregressive), checked and fitted to the context."""
    # (None, not any falsy value: {} or "" are wrong types to name, not a request for the defaults)
    sp = SamplingParams() if sampling is None else sampling
    spec = SpecConfig(method="ddtree" if block is not None else "ar") if spec is None else spec
    if not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be a k26.SpecConfig, got {type(spec).__name__}")
    spec = as_exact(spec, SpecConfig)
    if spec.method != "ar" and block is None:
        raise ValueError(f"spec method {spec.method!r} needs a drafter: LLM(..., drafter=DIR)")
    sp = check_sampling(sp, vocab)
    return sp, spec if spec.method == "ar" else fit_spec(spec, max_model_len, block)


def fit_spec(spec: SpecConfig, max_model_len: int, block_size: int) -> SpecConfig:
    """The speculative method as it fits the context. A step writes its whole verify tree past the sequence
    (the drafter its block), and the adaptive budget times its largest candidate at start-up, so a budget B
    needs max_model_len >= B + block_size + 1. "auto" keeps the candidates that fit (AR if none; said once);
    a fixed budget or DFlash chain refused when not even one step fits (later steps without room decode
    AR)."""
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
                stacklevel=user_stacklevel(),
            )
            return SpecConfig("ar")
        n = len(fit)
        costs = spec.costs[: n + 1] if spec.costs else None
        per_token = spec.cost_per_token[:n] if spec.cost_per_token else None
        warnings.warn(
            f"max_model_len={max_model_len}: DDTree budgets limited to {fit} of {spec.candidates} "
            f"(a budget B needs B + drafter block {block_size} + 1 context tokens)",
            stacklevel=user_stacklevel(),
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


def check_rows_free(what: str, streaming: bool, batch) -> None:
    """`score` / `generate` / `stream` / `open_batch` write cache rows: refused while a suspended `stream()`
    or (`batch`) an open batch's live or still prefilling rows need theirs, which would go on from what the
    call wrote, silently wrong (a new open batch would drop them, their slots then naming its rows)."""
    if streaming:
        raise RuntimeError(
            f"{what}: a stream() of this LLM is still being iterated; exhaust it or call its close() first"
        )
    if batch is not None and (batch.live or batch.pending):
        rows = len(batch.live) + sum(len(adm.todo) for adm in batch.pending)  # (an admission: its prompts)
        raise RuntimeError(
            f"{what}: the open batch has {rows} unfinished row(s); step them to the end or release() them "
            "first"
        )
