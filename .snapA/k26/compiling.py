"""torch.compile for bodies that are compiled once per graph bucket (fixed shapes, no graph breaks).

Dynamo keeps at most `recompile_limit` (default 8) compiled versions per code object, and with
`fullgraph=True` the next one is a hard failure (`FailOnRecompileLimitHit`), not a fallback. One compiled
version per bucket shape — and, for a method, per owner object — reaches 8 as soon as a server holds more
than a few batch sizes and DDTree budgets. The limits are raised around the calls of these bodies only, not
for the process (other code keeps torch's defaults).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RECOMPILE_LIMIT = 512  # compiled versions per body: buckets x layer kinds (or owners), with room


def compile_static(
    fn: Callable, recompile_limit: int = RECOMPILE_LIMIT, dynamic: bool | None = False
) -> Callable:
    """`torch.compile(fn, fullgraph=True, dynamic=dynamic)` whose calls may compile up to `recompile_limit`
    versions (one per input shape / guard set) instead of failing at the ninth. `dynamic=None`: torch's
    automatic dynamic shapes (a dimension seen with a second size is compiled symbolic once), for bodies
    whose cost is compiling, not running (one version serves every batch size past the first)."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    limits = {
        "recompile_limit": recompile_limit,
        "accumulated_recompile_limit": max(256, 2 * recompile_limit),
    }

    def call(*args, **kw):
        with torch._dynamo.config.patch(limits):
            return compiled(*args, **kw)

    return call
