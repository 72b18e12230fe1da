"""One log line per distinct message and process: a fallback a front door takes on every call (a shape the
kernel does not serve, no peer access) is said once, not once per layer and step."""

from __future__ import annotations

import functools
import logging


@functools.cache  # the cache is the "already said" set
def say_once(logger: str, level: int, msg: str) -> None:
    logging.getLogger(logger).log(level, msg)
