"""Tensor parallelism: the process group and the two collectives the model needs, passed into the model
as a `TPInfo` (the model never owns a group). NCCL on GPU (capturable inside CUDA graphs), gloo on CPU.

Every rank computes identical logits (the vocab-parallel head all-gathers them) and samples with the
same seed, so every rank builds the same tree and accepts the same tokens with no extra broadcast.
"""

from __future__ import annotations

import os
from dataclasses import fields
from datetime import timedelta

import torch
import torch.distributed as dist

from .model.layers import TPInfo
from .ops.allreduce_group import FusedAllReduce  # registers torch.ops.k26.allreduce_add_rmsnorm

# torch >= 2.13 deprecates all_gather_into_tensor (a warning on every TP run, printed mid-line with the
# streamed text) for all_gather_single, the same collective; older torch (2.11 on the GPU loaners) has only
# the first.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def timeout() -> timedelta:
    """A rank that dies makes the others fail within this long instead of hanging (K26_DIST_TIMEOUT s)."""
    raw = os.environ.get("K26_DIST_TIMEOUT", "300")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):  # (float() raised on "abc"; 0, -5 or inf broke the group later)
        raise ValueError(f"K26_DIST_TIMEOUT={raw!r} in the environment: expected a number of seconds > 0")
    return timedelta(seconds=seconds)


ALLREDUCE = ("fused", "calibrate", "nccl")  # LLM(allreduce=...): how the per-layer all-reduces run


def check_allreduce(allreduce: str) -> None:
    if allreduce not in ALLREDUCE:
        raise ValueError(f"allreduce={allreduce!r}: expected one of {', '.join(map(repr, ALLREDUCE))}")


def tp_info(rank: int, size: int, group=None, allreduce: str = "fused", device=None) -> TPInfo:
    """The model's view of the group. On NCCL with `allreduce` "fused" (or "calibrate") the all-reduce +
    residual add + RMSNorm pairs of every layer run as one kernel over peer-mapped memory (`FusedAllReduce`,
    built here collectively: every rank calls this at the same point), its one-shot / two-shot / NCCL
    crossovers from the per-TP-size table or, with "calibrate", measured here; without peer access it says
    so once. "nccl", and gloo always: the three steps (the reference). `device`: this rank's GPU (default:
    the current CUDA device)."""
    check_allreduce(allreduce)
    if size == 1:
        return TPInfo()

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's last-dim shard, in rank order."""
        x = x.contiguous()
        flat = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # rank-major
        _all_gather_flat(flat, x, group=group)
        return flat.view(size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])

    fused_ar = None
    fused = dist.get_backend(group) == "nccl" and allreduce != "nccl"
    calibrate = allreduce == "calibrate"
    # Both choices gate collectives (the workspace exchange, the calibration): a rank asked otherwise (under
    # torchrun every rank passes its own arguments) would wait in one alone. All take the group's answer.
    votes = [None] * size
    dist.all_gather_object(votes, (fused, calibrate), group=group)
    fused, calibrate = all(v[0] for v in votes), all(v[1] for v in votes)
    if fused:
        fused_ar = FusedAllReduce(group, device, timeout_s=timeout().total_seconds())
        if fused_ar.p2p and calibrate:
            fused_ar.calibrate()  # the crossovers measured here instead of the published per-size table
        if not fused_ar.p2p:  # the composition serves this group (said once): release what was set up
            fused_ar.close()
            fused_ar = None
    return TPInfo(rank, size, all_reduce, all_gather, fused_ar)


def init_group(rank: int, world: int, device: str | None = None, store=None, local: int | None = None):
    """Join (or find) the process group: NCCL with a GPU (device cuda:`local`), gloo without. `store`:
    an explicit rendezvous (the rank driver's); None reads MASTER_ADDR / MASTER_PORT (torchrun)."""
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    dev = torch.device("cuda", rank if local is None else local) if use_cuda else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        kw = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
        if use_cuda:
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", device_id=dev, timeout=timeout(), **kw)
        else:
            dist.init_process_group("gloo", timeout=timeout(), **kw)
    return rank, world, dev


def env_int(name: str, default: int) -> int:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK (`default` when unset): a value that is no count (say 'abc',
    or a WORLD_SIZE of 0) is named, not int()'s "invalid literal" nor a group of 0 ranks."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    least = 1 if name == "WORLD_SIZE" else 0
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ValueError(
            f"{name}={raw!r} in the environment: expected an integer >= {least} (torchrun sets it)"
        )
    return value


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: a group already made (by the rank driver or the user) gives
    its own, else torchrun's RANK / WORLD_SIZE (0 and 1 without them)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    if rank >= world:  # (it waited out the store's timeout, then a torch traceback)
        raise ValueError(f"RANK={rank} in the environment: expected below WORLD_SIZE={world}")
    return rank, world


def one_process(what: str, why: str) -> None:
    """`what` runs as one process: under torchrun each rank would run its own whole copy (serve: N servers on
    one port; bench / profile: N reports into one --out, competing for the machine)."""
    if env_int("WORLD_SIZE", 1) > 1:
        raise ValueError(f"{what} under torchrun: run it as one process{why}")


def group_failure(e: BaseException) -> str | None:
    """A line for a tensor-parallel group that failed under torchrun — a peer that never joined (the store's
    timeout), one that left or crashed (gloo / NCCL's transport errors) — else None (not such a failure)."""
    world = os.environ.get("WORLD_SIZE")
    transport = any(w in str(e) for w in ("gloo", "NCCL", "nccl", "Connection closed by peer"))
    if not isinstance(e, dist.DistError) and not (world not in (None, "1") and transport):
        return None
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = f"torchrun rank {os.environ.get('RANK', '?')} of {world}" if world else "this process"
    wait = "K26_DIST_TIMEOUT: how long a peer is waited for"
    return f"the tensor-parallel group failed ({where}): {first[:300]} ({wait})"


def local_rank() -> int:
    """The GPU index this process's rank runs on: torchrun's LOCAL_RANK, else its rank."""
    return env_int("LOCAL_RANK", rank_and_world()[0])


def init_from_env(device: str | None = None) -> tuple[int, int, torch.device]:
    """torchrun: RANK / WORLD_SIZE / LOCAL_RANK from the environment; a group already made (by the rank
    driver or the user) gives its own rank and size."""
    rank, world = rank_and_world()
    return init_group(rank, world, device, local=local_rank())


def same_setup_on_every_rank(path, settings: dict) -> None:
    """Every rank must load the same checkpoint (`checkpoint_digest`) with the same
    settings (context length, batch rows, dtype...): torchrun starts each rank from its own command line,
    and ranks that differ would pair their collectives wrongly (a hang or wrong tokens), not fail."""
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (checkpoint_digest(path), builtin_values(settings)))
    digests = [d for d, _ in seen]
    if len(set(digests)) > 1:  # a user's error (torchrun given another --model per rank): one line, exit 2
        raise ValueError(
            f"tensor-parallel ranks loaded different checkpoints (digests {digests}); rank "
            f"{dist.get_rank()} has {path}"
        )
    for key in settings:
        values = [theirs.get(key) for _, theirs in seen]
        if any(v != values[0] for v in values):
            raise ValueError(
                f"tensor-parallel ranks were started with different {key}: {values} (rank by rank); start "
                "every rank with the same arguments"
            )


def builtin_values(x):
    """`x` (a constructor argument, a setting) as built-in values another rank can unpickle: a caller's own
    subclass of str or int (an IntEnum, a str path type), os.PathLike, or tuple (a namedtuple bucket) exists
    only in the caller's interpreter, and the rank died at the load. Booleans, None, dtypes and devices pass
    as they are."""
    if x is None or isinstance(x, (bool, torch.dtype, torch.device)):
        return x
    if isinstance(x, os.PathLike):
        return str(os.fspath(x))
    for kind in (str, int, float):  # (kind.__str__ etc.: a str Enum's own __str__ says "AR.FUSED")
        if isinstance(x, kind):
            return {str: str.__str__, int: int.__int__, float: float.__float__}[kind](x)
    if isinstance(x, (list, tuple, range)):
        return [builtin_values(v) for v in x]
    if isinstance(x, dict):
        return {builtin_values(k): builtin_values(v) for k, v in x.items()}
    return x


def as_exact(obj, cls):
    """`obj` (of the dataclass `cls` or a subclass) as `cls` itself, same fields: TP ranks unpickle a call's
    arguments in their own interpreter, where the caller's subclass does not exist (the rank died)."""
    if type(obj) is cls:
        return obj
    return cls(**{f.name: getattr(obj, f.name) for f in fields(cls) if f.init})


def checkpoint_digest(path) -> str:
    """A digest of a checkpoint directory that ranks holding their own copies of it agree on: config.json,
    the tensor index, and each weight file's name and size (a single-file checkpoint has no index). Not the
    weights' values: reading them costs minutes at K2.6's size, so two checkpoints of the same shapes and
    config pass as one."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        f = Path(path) / name
        h.update(f.read_bytes() if f.is_file() else b"-")
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()


def shared_seed(device: torch.device) -> int:
    """A fresh seed chosen on rank 0 and broadcast, so every TP rank samples the same tokens."""
    t = (
        torch.randint(0, 2**62, (1,), device=device)
        if dist.get_rank() == 0
        else torch.zeros(1, dtype=torch.long, device=device)
    )
    dist.broadcast(t, src=0)
    return int(t)


def check_world(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tp={size!r}: expected a positive integer")
    if dist.is_initialized() and dist.get_world_size() != size:
        raise ValueError(
            f"tp={size} but the initialised process group has {dist.get_world_size()} ranks (an open "
            "tensor-parallel LLM's, or your own): close that LLM first, or give this one the group's size"
        )
    world = env_int("WORLD_SIZE", 1)
    if size > 1 and not dist.is_initialized() and "WORLD_SIZE" in os.environ and size != world:
        # (torchrun --nproc-per-node 1 ... tp=2: no rank would be started, and no group made)
        raise ValueError(f"tp={size} differs from torchrun's WORLD_SIZE {world} (a rank a process)")
