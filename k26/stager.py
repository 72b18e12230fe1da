"""Byte ranges of files into a device buffer through a ring of pinned host buffers: one asynchronous
host-to-device copy per full buffer, the next read overlapping it; a file that changes (its `stamp`)
while it is read raises. The staging half of the planned checkpoint reads (`shard_reader`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

CHUNK = 256 << 20  # bytes per staging buffer (and per coordinated round of shard_reader)
PIECE = 8 << 20  # bytes per read request: large enough to stream, small enough to spread over the threads
THREADS = 8  # reads in flight per stager: enough to fill an NVMe / virtio queue


class ShardChangedError(ValueError):
    """A shard changed on disk while it was being read: the weights would mix two versions. (A ValueError,
    as the other checkpoint errors: a situation the user causes, said in one line by the CLI.)"""


Stamp = tuple[int, int, int, int]


def stamp(st: os.stat_result) -> Stamp:
    """A file's (size, mtime_ns, ctime_ns, inode): what says it is unchanged. Size and mtime alone can be
    put back after an in-place edit (`touch -d`, os.utime, a tool that keeps times); the kernel sets ctime
    on every change, with no call to set it back, and a replaced file has another inode."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def open_random(f: Path) -> int:
    """A descriptor without readahead: the kernel's window (8 MB on some disks) around every small read
    would pull in bytes nobody asked for (measured: 1.7 GB of 8.4 GB for the weight_shape checks alone)."""
    fd = os.open(f, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):  # (macOS has none: there the reads keep the default readahead)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def read_at(fd: int, view: memoryview, offset: int) -> int:
    """Bytes read at `offset` into `view` (preadv: no copy; where os has none, as on macOS, pread + copy)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


class Stager:
    """Reads byte ranges into a device buffer through a ring of pinned host buffers: one asynchronous
    host-to-device copy per full buffer, the next read overlapping it. On a CPU device it reads straight
    into the destination. Checks each file's `stamp` before the first and after the last read."""

    def __init__(
        self,
        device: torch.device,
        chunk: int = CHUNK,
        ring: int = 2,
        stamps: dict[Path, Stamp] | None = None,
    ):
        self.device = device
        self.stamps = stamps or {}  # each file's `stamp` when its header was read
        self.cuda = device.type == "cuda"
        self.chunk = chunk
        n = ring if self.cuda else 0
        self.bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
        self.events: list[torch.cuda.Event | None] = [None] * ring
        self.i = self.fill = 0
        self.fds: dict[Path, tuple[int, Stamp]] = {}
        self.bytes_read = 0
        self.pool: ThreadPoolExecutor | None = None

    def _fd(self, f: Path) -> int:
        if f not in self.fds:
            fd = open_random(f)  # the reads are large already; readahead would add other ranks' rows
            self.fds[f] = (fd, stamp(os.fstat(fd)))
            if self.stamps.get(f, self.fds[f][1]) != self.fds[f][1]:
                raise ShardChangedError(f"shard {f.name} changed since its header was read: load again")
        return self.fds[f][0]

    def _pread(self, fd: int, view: memoryview, offset: int, f: Path) -> int:
        done = 0
        while len(view):
            n = read_at(fd, view, offset)
            if n <= 0:
                raise ShardChangedError(f"shard {f.name} ended at byte {offset} while loading: it changed")
            view, offset, done = view[n:], offset + n, done + n
        return done

    def _run(self, jobs: list[tuple[int, memoryview, int, Path]]) -> None:
        """The reads of `jobs` (descriptor, destination, offset, file), in pieces of at most PIECE bytes
        on THREADS threads: one sequential stream leaves a disk's queue nearly empty (measured on the
        H200 machine's disk: a rank's scattered 1 MB row slices read at 59 % of dd in one stream)."""
        pieces = [
            (fd, view[k : k + PIECE], off + k, f)
            for fd, view, off, f in jobs
            for k in range(0, len(view), PIECE)
        ]
        if len(pieces) <= 1:
            self.bytes_read += sum(self._pread(*p) for p in pieces)
            return
        if self.pool is None:  # the GIL is released in the reads
            self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="k26-pread")
        self.bytes_read += sum(self.pool.map(lambda p: self._pread(*p), pieces))

    def read(self, ranges: list[tuple[Path, int, int]]) -> torch.Tensor:
        total = sum(b - a for _, a, b in ranges)
        out = torch.empty(total, dtype=torch.uint8, device=self.device)
        if not self.cuda:
            view, pos, jobs = memoryview(out.numpy()), 0, []
            for f, a, b in ranges:
                jobs.append((self._fd(f), view[pos : pos + b - a], a, f))
                pos += b - a
            self._run(jobs)
            return out
        pos, jobs = 0, []  # bytes of `out` already sent; reads planned into the current buffer
        for f, a, b in ranges:
            fd = self._fd(f)
            while a < b:
                if self.fill == 0 and self.events[self.i] is not None:
                    self.events[self.i].synchronize()  # this buffer's previous copy is done
                n = min(b - a, self.chunk - self.fill)
                jobs.append((fd, memoryview(self.bufs[self.i].numpy())[self.fill : self.fill + n], a, f))
                self.fill, a = self.fill + n, a + n
                if self.fill == self.chunk:
                    self._run(jobs)
                    jobs, pos = [], self._send(out, pos)
        self._run(jobs)
        self._send(out, pos)
        return out

    def _send(self, out: torch.Tensor, pos: int) -> int:
        if self.fill:
            out[pos : pos + self.fill].copy_(self.bufs[self.i][: self.fill], non_blocking=True)
            self.events[self.i] = torch.cuda.Event()
            # the stream of this device (a reader thread's current device may be another)
            self.events[self.i].record(torch.cuda.current_stream(self.device))
            pos += self.fill
            self.i, self.fill = (self.i + 1) % len(self.bufs), 0
        return pos

    def close(self) -> None:
        """Close every file, raising if one changed (its `stamp`) since it was opened."""
        if self.pool is not None:  # no read is in flight between calls: this only ends the threads
            self.pool.shutdown()
            self.pool = None
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        changed = []
        for f, (fd, before) in self.fds.items():
            now = stamp(os.fstat(fd))
            os.close(fd)
            if now != before:
                changed.append(f.name)
        self.fds.clear()
        if changed:
            names = ", ".join(changed)
            raise ShardChangedError(f"shard(s) {names} changed on disk while loading; load again")
