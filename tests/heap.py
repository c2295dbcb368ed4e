"""gc.freeze() for test modules whose libraries make a large heap (torch with transformers, TRL, Lightning)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """What is alive now (torch, transformers, TRL: ~450k objects) is left out of every later collection.
    accelerate's free_memory() runs gc.collect() at each Trainer's set-up and end: ~0.5 CPU s each over that
    heap, ~1 ms without it (the TRL runs on 2 ranks: 19 -> 9 s of wall time). What the tests make is collected
    as before. Not unfrozen after: that would also unfreeze the heap conftest.py froze after collection, for
    every later test. Forked ranks inherit it."""
    gc.collect()
    gc.freeze()
    yield
