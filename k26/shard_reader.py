"""Fast checkpoint reads: byte ranges planned from the safetensors headers, large sequential reads through
pinned staging buffers (`stager.Stager`: one host-to-device copy per buffer), TP slicing on the device.

Two modes, both filling a model the loader has already planned and checked (`loader.plan_load`):
- alone (`group=None`): this rank reads only its bytes where the layout allows (row slices, i.e. TP dim
  0, are contiguous) and whole tensors where it does not (column slices), slicing them on the device;
- coordinated (`group` = the TP process group): every shard file is read by one rank (files balanced by
  bytes), and each round an all-to-all hands every rank its slices (NCCL on GPU tensors, gloo on host
  tensors), so the host reads each checkpoint byte once.

Reading the next buffer overlaps the previous buffer's copy to the device (the copy is asynchronous from
pinned memory). A shard whose stamp (size, mtime, ctime, inode) changes while it is read raises instead
of loading a mix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .safetensors_file import DTYPES, tensor_spans
from .stager import CHUNK, Stager


@dataclass
class ReadStats:
    """What a load read: `bytes_read` by the loader's own count, `disk_bytes` from /proc/self/io (bytes
    this process made the kernel fetch from storage; page-cache hits are free), per-phase seconds."""

    bytes_read: int = 0
    disk_bytes: int | None = None
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    from_cache: bool = False

    @property
    def gbps(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 1e9

    def summary(self) -> str:
        disk = "n/a" if self.disk_bytes is None else f"{self.disk_bytes / 1e9:.2f} GB"
        src = "the load cache" if self.from_cache else "the checkpoint"
        line = f"read {self.bytes_read / 1e9:.2f} GB of {src} in {self.seconds:.1f} s ({self.gbps:.2f} GB/s"
        line += f"; from disk {disk})"
        return line + "".join(f", {k} {v:.2f} s" for k, v in self.phases.items() if k != "read")


def io_read_bytes() -> int | None:
    """This process's storage reads so far (Linux /proc/self/io read_bytes), None where unavailable."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def staged_read(fill, pieces, stager: Stager, progress: bool, t0: float, io0: int | None, **kw) -> ReadStats:
    """`fill(bar)` the pieces through `stager` under the read phase's progress bar, close both however it
    ends, and count what was read since `t0` / `io0` (`kw`: more `ReadStats` fields)."""
    from .startup import phase_bar  # lazily: tqdm only when a load runs

    bar = phase_bar("read", sum(p.nbytes for p in pieces), "B", progress)
    try:
        fill(bar)
    finally:
        bar.close()
        stager.close()
    io1 = io_read_bytes()
    disk = None if io0 is None or io1 is None else io1 - io0
    dt = time.perf_counter() - t0
    return ReadStats(stager.bytes_read, disk, dt, {"read": dt}, **kw)


@dataclass(frozen=True)
class Piece:
    """One byte range this rank reads and where it goes: `param` (expert `expert`) gets the tensor of
    `shape`/`dtype` stored in [start, end) of `file`, narrowed on the device to [lo, hi) along `dim`."""

    param: str
    expert: int | None
    file: Path
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int | None = None
    lo: int = 0
    hi: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def part(self, rank: int, size: int) -> tuple[int | None, int, int, tuple[int, ...]]:
        """Rank `rank`'s slice of this whole tensor: (dim, lo, hi, sliced shape)."""
        if self.dim is None or size == 1:
            return None, 0, 0, self.shape
        n = self.shape[self.dim] // size
        shape = list(self.shape)
        shape[self.dim] = n
        return self.dim, rank * n, (rank + 1) * n, tuple(shape)


def whole_pieces(items, infos, spans) -> list[Piece]:
    """One piece per planned item: the whole checkpoint tensor, with its TP dim (not yet narrowed)."""
    out = []
    for it in items:
        info = infos[it.hf]
        a, b = info.span if info.span is not None else spans[info.file, info.key]
        out.append(Piece(it.param, it.expert, info.file, a, b, DTYPES[info.dtype], info.shape, it.dim))
    return out


def own_pieces(pieces: list[Piece], rank: int, size: int) -> list[Piece]:
    """This rank's bytes alone: a row slice (dim 0) is one contiguous range, read as such; any other
    slice needs the whole tensor, narrowed on the device."""
    out = []
    for p in pieces:
        dim, lo, hi, shape = p.part(rank, size)
        if dim == 0:
            row = p.nbytes // p.shape[0]
            a, b = p.start + lo * row, p.start + hi * row
            out.append(Piece(p.param, p.expert, p.file, a, b, p.dtype, shape))
        elif dim is None:
            out.append(p)
        else:
            out.append(Piece(p.param, p.expert, p.file, p.start, p.end, p.dtype, p.shape, dim, lo, hi))
    return out


def batches(pieces: list[Piece], chunk: int = CHUNK) -> list[list[Piece]]:
    """Pieces in file order, grouped into batches of at most `chunk` bytes (a bigger piece goes alone)."""
    out: list[list[Piece]] = []
    size = chunk
    for p in sorted(pieces, key=lambda p: (str(p.file), p.start)):
        if not out or size + p.nbytes > chunk:  # (`not out`: a first piece of zero bytes opens a batch too)
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.nbytes
    return out


def reads(batch: list[Piece]) -> list[tuple[Path, int, int]]:
    """The batch's byte ranges, adjacent ones merged into one sequential read."""
    out: list[tuple[Path, int, int]] = []
    for p in batch:
        if out and out[-1][0] == p.file and out[-1][2] == p.start:
            out[-1] = (p.file, out[-1][1], p.end)
        else:
            out.append((p.file, p.start, p.end))
    return out


def _view(buf: torch.Tensor, pos: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes at `pos` as a tensor; an unaligned offset costs one small device copy."""
    n = torch.Size(shape).numel() * dtype.itemsize
    b = buf[pos : pos + n]
    if pos % dtype.itemsize:
        b = b.clone()
    return b.view(dtype).view(shape)


def _store(params: dict[str, torch.Tensor], param: str, expert: int | None, t: torch.Tensor) -> None:
    dst = params[param] if expert is None else params[param][expert]
    dst.copy_(t)  # converts the dtype where the model's differs from the checkpoint's


def fill_alone(params, pieces: list[Piece], stager: Stager, bar=None) -> None:
    """Independent mode: read this rank's pieces batch by batch and narrow them on the device. One reader
    thread reads the next batch (the GIL is released in pread) while this one places the current batch's
    pieces (a few thousand small launches per MoE layer: ~20 % of the read time if done in turn)."""
    from concurrent.futures import ThreadPoolExecutor

    todo = batches(pieces, stager.chunk)
    with ThreadPoolExecutor(1, thread_name_prefix="k26-read") as pool:
        ahead = pool.submit(stager.read, reads(todo[0])) if todo else None
        for k, batch in enumerate(todo):
            buf, pos = ahead.result(), 0
            if k + 1 < len(todo):
                ahead = pool.submit(stager.read, reads(todo[k + 1]))
            for p in batch:
                t = _view(buf, pos, p.dtype, p.shape)
                _store(params, p.param, p.expert, t if p.dim is None else t.narrow(p.dim, p.lo, p.hi - p.lo))
                pos += p.nbytes
            if bar is not None:
                bar.update(sum(p.nbytes for p in batch))


def assign_files(pieces: list[Piece], size: int) -> dict[Path, int]:
    """Each shard file to one rank, largest first to the least-loaded rank (balances bytes read)."""
    per_file: dict[Path, int] = {}
    for p in pieces:
        per_file[p.file] = per_file.get(p.file, 0) + p.nbytes
    load, owner = [0] * size, {}
    for f in sorted(per_file, key=lambda f: (-per_file[f], str(f))):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[f], load[r] = r, load[r] + per_file[f]
    return owner


def _part_bytes(p: Piece, rank: int, size: int) -> int:
    shape = p.part(rank, size)[3]
    return torch.Size(shape).numel() * p.dtype.itemsize


def _send_buffer(buf: torch.Tensor, batch: list[Piece], rank: int, size: int, total: int) -> torch.Tensor:
    """Destination-major bytes of a batch of whole tensors: every rank's slices, written straight into one
    buffer (no per-slice temporaries)."""
    send = torch.empty(total, dtype=torch.uint8, device=buf.device)
    whole, pos = [], 0
    for p in batch:
        whole.append(_view(buf, pos, p.dtype, p.shape))
        pos += p.nbytes
    off = 0
    for d in range(size):
        for p, t in zip(batch, whole, strict=True):
            dim, lo, hi, shape = p.part(d, size)
            src = t if dim is None else t.narrow(dim, lo, hi - lo)
            n = _part_bytes(p, d, size)
            if off % p.dtype.itemsize == 0:
                send[off : off + n].view(p.dtype).view(shape).copy_(src)
            else:
                send[off : off + n].copy_(src.contiguous().view(-1).view(torch.uint8))
            off += n
    return send


def fill_coordinated(
    params, pieces: list[Piece], stager: Stager, rank: int, size: int, group, device: torch.device, bar=None
) -> None:
    """Coordinated mode: round k, rank s reads its k-th batch of whole tensors and an all-to-all sends
    every rank its slice of each; the stager's device is the exchange's (the GPU for NCCL, the host for
    gloo), `device` the model's. Every rank derives the whole schedule from the same headers. A reader
    thread reads round k+1's batch while round k is sliced and exchanged (the disk never waits on the
    interconnect)."""
    from concurrent.futures import ThreadPoolExecutor

    owner = assign_files(pieces, size)
    sched = [batches([p for p in pieces if owner[p.file] == s], stager.chunk) for s in range(size)]
    rounds = max(len(b) for b in sched)
    with ThreadPoolExecutor(1, thread_name_prefix="k26-read") as pool:
        ahead = pool.submit(stager.read, reads(sched[rank][0])) if sched[rank] else None
        for k in range(rounds):
            buf = ahead.result() if k < len(sched[rank]) else None
            if k + 1 < len(sched[rank]):
                ahead = pool.submit(stager.read, reads(sched[rank][k + 1]))
            _exchange(params, sched, k, buf, rank, size, group, stager.device, device)
            if bar is not None:
                bar.update(sum(p.nbytes for b in sched for p in (b[k] if k < len(b) else [])))


def _exchange(params, sched, k: int, buf, rank: int, size: int, group, xdev, device) -> None:
    """Round `k` of the coordinated schedule: this rank's batch (`buf`, read) sliced for every rank, one
    all-to-all, and this rank's slices of every rank's batch stored."""
    import torch.distributed as dist

    mine = sched[rank][k] if k < len(sched[rank]) else []
    send = torch.empty(0, dtype=torch.uint8, device=xdev)
    in_splits = [sum(_part_bytes(p, d, size) for p in mine) for d in range(size)]
    if mine:
        send = _send_buffer(buf, mine, rank, size, sum(in_splits))
    theirs = [sched[s][k] if k < len(sched[s]) else [] for s in range(size)]
    out_splits = [sum(_part_bytes(p, rank, size) for p in b) for b in theirs]
    recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=xdev)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    recv, pos = recv.to(device), 0
    for b in theirs:
        for p in b:
            shape = p.part(rank, size)[3]
            _store(params, p.param, p.expert, _view(recv, pos, p.dtype, shape))
            pos += _part_bytes(p, rank, size)


def read_into(
    model: torch.nn.Module,
    items,
    infos,
    *,
    rank: int = 0,
    size: int = 1,
    group=None,
    device: torch.device | str = "cpu",
    progress: bool = False,
    chunk: int = CHUNK,
) -> ReadStats:
    """Fill `model`'s parameters from the planned `items` (see `loader.plan_load`); returns what was read.
    `progress`: the "read" line (bytes, GB/s, ETA; in coordinated mode the bytes of every rank)."""
    device = torch.device(device)
    t0, io0 = time.perf_counter(), io_read_bytes()
    # The index's spans, read with the stamps the stager checks: a header read again here raised a bare
    # ValueError naming no file for a shard cut short or overwritten since (only span-less infos need it).
    spans = tensor_spans(sorted({infos[it.hf].file for it in items if infos[it.hf].span is None}, key=str))
    pieces = whole_pieces(items, infos, spans)
    coordinated = group is not None and size > 1
    if not coordinated:
        pieces = own_pieces(pieces, rank, size)
    params = dict(model.named_parameters())
    xdev = device
    if coordinated:
        import torch.distributed as dist

        if dist.get_world_size(group) != size:
            raise ValueError(f"TP size {size} but the process group has {dist.get_world_size(group)} ranks")
        # gloo exchanges host tensors: read into host memory and copy only this rank's slices to the device
        xdev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    stamps = {infos[it.hf].file: infos[it.hf].stamp for it in items if infos[it.hf].stamp is not None}
    stager = Stager(xdev, chunk, stamps=stamps)

    def fill(bar) -> None:
        if coordinated:
            fill_coordinated(params, pieces, stager, rank, size, group, device, bar)
        else:
            fill_alone(params, pieces, stager, bar)

    return staged_read(fill, pieces, stager, progress, t0, io0)
