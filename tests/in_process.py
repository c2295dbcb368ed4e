"""Measuring runs in the test's own process: `zerodp estimate`'s children, and a fake world of one rank.

`zerodp estimate` measures in a child (`python -m zerodp.plan.peak SPECS` or `zerodp.plan.measure`:
plan/measure.py's run_child), which imports torch (and transformers) afresh: 3-8 s of CPU per command
on the project's 2-core machine, and the fake-tensor work is often less. `children_here` runs the same
`_measure_here` on the same JSON here and hands back what the child would print, parsed. The child as a
subprocess keeps one test each: test_estimate.py's model that nothing initialises (peak.py) and
test_memory.py's `--measure real` (measure.py).
"""

from __future__ import annotations

import importlib
import json
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

from zerodp.distributed.comm import init_fake
from zerodp.plan import measure


def _run_here(module_argv: list[str], what: str, timeout: float | None) -> Any:
    """run_child's answer without the child: module_argv is [module, the specs' JSON]."""
    module = importlib.import_module(module_argv[0])
    # The child's warnings (slow bf16, fake tensors' data_ptr) went to its stderr, unread on success.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = [module._measure_here(spec) for spec in json.loads(module_argv[1])]
    return json.loads(json.dumps(results))  # as the child's stdout parses: tuples lists, keys strings


@contextmanager
def children_here() -> Iterator[None]:
    """`zerodp estimate`'s measuring children, run in this process while in the block."""
    saved = measure.run_child
    measure.run_child = _run_here
    try:
        yield
    finally:
        measure.run_child = saved


@contextmanager
def fake_group(world: int) -> Iterator[None]:
    """This process as rank 0 of `world` ranks on torch's fake process group (zerodp.distributed.comm.
    init_fake); the group is destroyed at the end."""
    init_fake(world)
    try:
        yield
    finally:
        dist.destroy_process_group()
