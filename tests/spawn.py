"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

Ranks rendezvous through a FileStore in a temporary directory, so tests never pick ports.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store_path: str, out_dir: str, fn, args, timeout_s: float, spawned: bool) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        # Every rank done before any tears down: a rank that closes its gloo connections while a
        # peer's background threads still use them can abort that peer ("terminate called without
        # an active exception", about one run in 20 without this).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if spawned:
        # Done: end in os._exit, as a "fork" rank's process does, not through the interpreter's
        # finalization, which gloo threads still alive can abort (zerodp.distributed.teardown). Here they
        # are: after destroy_process_group() something outside zerodp's Comm still references the group
        # in a spawned rank (refcount 14, where a forked rank has 3), so zerodp's exit hook cannot free it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(fn, world: int, *args, timeout_s: float = 300, start_method: str = "fork") -> list:
    """fn(rank, world, *args) on `world` spawned gloo ranks; returns every rank's result in order.

    fn must be importable (module level). A rank that raises fails the call with its traceback.
    timeout_s bounds each collective: a rank left waiting for a peer fails instead of hanging.
    start_method "fork" (the default): the ranks inherit this process's imports instead of importing torch
    (and transformers) again, ~2-6 s of CPU per fresh rank; test_accumulation.py took 55 s of CPU with
    "spawn" and 22 s with "fork". Callers must hold no process group when they call (fork copies it).
    """
    if dist.is_initialized() or torch.cuda.is_initialized():
        start_method = "spawn"  # a forked rank would inherit this process's group, or a CUDA context it cannot use
    if start_method == "fork":
        # An earlier in-process test's process group, destroyed but left in a reference cycle (an error's
        # traceback), is collected here: collected in a forked rank, its destructor would wait forever for
        # gloo threads that the fork did not copy. What survives is frozen: a rank's own collections then
        # skip the ~500k objects of this process's imports (~0.5 s each, and a copy of every page they touch).
        gc.collect()
        gc.freeze()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), tmp, fn, args, timeout_s,
                                         start_method == "spawn"), nprocs=world, join=True, start_method=start_method)
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world)]
