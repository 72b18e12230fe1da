"""Graph buckets: (batch size, verify tokens per sequence N). A step is served by the smallest bucket that
holds it; missing batch rows are dummy sequences in spare cache rows, missing tree nodes are padding
nodes that see only themselves and are never accepted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    nodes: int  # 1 for AR decode, block for a DFlash chain, budget + 1 (padded up) for DDTree

    def __post_init__(self) -> None:
        if self.batch < 1 or self.nodes < 1:
            raise ValueError(f"bucket {self}: batch and nodes must be >= 1")


def pick_bucket(buckets: list[Bucket], batch: int, nodes: int) -> Bucket:
    fits = [b for b in buckets if b.batch >= batch and b.nodes >= nodes]
    if not fits:
        have = ", ".join(f"(batch {b.batch}, nodes {b.nodes})" for b in sorted(buckets))
        raise ValueError(
            f"no graph bucket holds batch {batch} with {nodes} verify tokens; buckets are {have}"
        )
    return min(fits, key=lambda b: (b.batch * b.nodes, b.batch))


def default_batches(max_batch: int) -> list[int]:
    sizes = [1]
    while sizes[-1] * 2 <= max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes
