"""What a logger emits in a block, for tests that check messages (the zerodp logger, transformers')."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def captured(name: str) -> Iterator[list[tuple[str, str]]]:
    """The (level, message) pairs logger `name` emits in the block, on this process, DEBUG and up."""
    lines: list[tuple[str, str]] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: lines.append((r.levelname, r.getMessage()))
    log = logging.getLogger(name)
    old = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
