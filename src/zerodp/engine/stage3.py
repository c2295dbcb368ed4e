"""Stage 3: parameters partitioned; each module's parameters gathered just before it runs.

Every bucket holds one module's parameters (see flat.lay_out's `unit_of`). Its gathered buffer keeps
its tensor object but its storage is resized to zero between uses, so any autograd graph that
saved views of it stays valid and sees the data again once it is gathered back. While released,
the parameters themselves point at an empty tensor, so stray reads fail loudly instead of reading
freed memory:
  forward pre-hook   gather the module's buckets (and start prefetching the next ones);
  forward post-hook  release them, and arrange for a gather when backward reaches the module;
  gradient hook      (reducer) once all of a bucket's gradients are reduced, release it;
  end of backward    release whatever is still gathered.
A parameter is gathered when a module that registers it runs (as in FSDP): code outside those
modules that reads it first (a parent's forward calling F.linear on a child's weight) sees the empty
tensor and fails; such a parameter can be registered on, or made persistent with, the module using it.
Buckets smaller than `stage3_param_persistence_threshold` stay gathered: the collectives for them
would cost more than their memory.
"""

from __future__ import annotations

import bisect
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from zerodp.distributed.comm import Comm
from zerodp.engine.flat import Bucket
from zerodp.monitor.timers import gather_phase


def owning_modules(module: nn.Module) -> dict[int, int]:
    """id(param) -> id of the first module that registers it (a tied weight has one owner)."""
    owner: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), id(m))
    return owner


class Gatherer:
    def __init__(self, module: nn.Module, buckets: list[Bucket], comm: Comm, persistence_threshold: int,
                 prefetch_numel: int, host_shards: bool = False):
        self.comm = comm
        self.gather_span: Callable[[], AbstractContextManager] = nullcontext  # time_gathers
        self.host_shards = host_shards  # offload_param: b.owned is in host memory
        self.prefetch_numel = prefetch_numel
        bucket_of = {id(s.param): b for b in buckets for s in b.slots}
        self.persistent = {b.index for b in buckets if b.numel < persistence_threshold}
        self.gathered: set[int] = set()
        self.pending: dict[int, object] = {}        # bucket index -> async all_gather in flight
        self.order: list[Bucket] = []       # first-forward gather order, for prefetch
        self.position: dict[int, int] = {}  # bucket index -> place in self.order
        self.prefix = [0]                   # prefix[i]: elements of order[:i], for the prefetch window
        self.window = (-1, 0)               # (place of the last prefetch, end of the window it covered)
        self.buckets = buckets
        self.views = {b.index: [(s.param, s.param.data) for s in b.slots] for b in buckets}
        self._empty = {b.index: b.data.new_empty(0) for b in buckets}
        self._handles = []
        for m in module.modules():
            units = list({id(b): b for p in m.parameters(recurse=False)
                          if (b := bucket_of.get(id(p))) is not None}.values())
            if units:
                self._handles.append(m.register_forward_pre_hook(self._pre_hook(units)))
                self._handles.append(m.register_forward_hook(self._post_hook(units)))
        for b in buckets:
            self._free(b)
        self.refresh_persistent()

    # ---- hooks ----------------------------------------------------------------------------------
    # torch.compile must not trace these hooks: a storage resize, a `p.data` swap and an async
    # collective are not graph ops, and a gather traced into a module's graph rewrites the bucket that
    # graph saved for backward ("modified by an inplace operation"). Disabled, each hook runs eagerly
    # between the compiled pieces of the forward (one graph break per module).
    def _pre_hook(self, units: list[Bucket]):
        @torch.compiler.disable
        def hook(module, args):
            self.gather(units)
            self._prefetch_after(units[-1])
        return hook

    def _post_hook(self, units: list[Bucket]):
        @torch.compiler.disable
        def hook(module, args, output):
            self.release(units)
            tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:  # backward through this module needs its parameters again
                register_multi_grad_hook(tensors, lambda grads: self.gather(units), mode="any")
        return hook

    # ---- gather / release -----------------------------------------------------------------------
    def time_gathers(self, span: Callable[[], AbstractContextManager]) -> None:
        """Run the parameter gathers inside span() (wall_clock_breakdown's 'gather' phase)."""
        self.gather_span = span

    @gather_phase
    def gather(self, units: list[Bucket]) -> None:
        for b in units:
            if b.index not in self.position:
                self.position[b.index] = len(self.order)
                self.order.append(b)
                self.prefix.append(self.prefix[-1] + b.numel)
            if b.index not in self.gathered:
                self._start(b)
        for b in units:
            self._wait(b)

    def _start(self, b: Bucket) -> None:
        b.data.untyped_storage().resize_(b.numel * b.data.element_size())
        for p, view in self.views[b.index]:
            p.data = view
        self.gathered.add(b.index)
        source = b.owned
        if self.host_shards:  # the host shard goes to its own place in the device bucket, gathered in place
            source = b.shard(b.data, self.comm.shard_rank)
            source.copy_(b.owned, non_blocking=True)
        self.pending[b.index] = self.comm.shard_gather(b.data, source, async_op=True)

    def _wait(self, b: Bucket) -> None:
        work = self.pending.pop(b.index, None)
        if work is not None:
            work.wait()

    def _prefetch_after(self, last: Bucket) -> None:
        """Start gathering the buckets that came next in the first forward, up to the prefetch size."""
        start = self.position.get(last.index)
        if self.prefetch_numel <= 0 or start is None:
            return
        # The window: the buckets after `start` whose sizes fit in the prefetch budget. It only moves
        # forward during a forward pass, so only the part not covered by the last call is looked at
        # (walking the whole window at every module was O(modules^2) per step with small parameters).
        # A new pass (start moves back) looks at its whole window again.
        end = bisect.bisect_right(self.prefix, self.prefix[start + 1] + self.prefetch_numel) - 1
        last_start, covered = self.window
        first = start + 1 if start < last_start else max(start + 1, covered)
        for b in self.order[first:end]:
            if b.index not in self.gathered:
                self._start(b)
        self.window = (start, max(end, first))

    def release(self, units: list[Bucket]) -> None:
        for b in units:
            if b.index in self.gathered and b.index not in self.persistent:
                self._wait(b)
                self._free(b)

    def release_all(self) -> None:
        self.release([self.buckets[i] for i in list(self.gathered)])

    def _free(self, b: Bucket) -> None:
        b.data.untyped_storage().resize_(0)
        for p, _ in self.views[b.index]:
            p.data = self._empty[b.index]
        self.gathered.discard(b.index)

    @contextmanager
    def gathered_parameters(self, buckets: list[Bucket] | None = None):
        """These buckets' (default: every) parameters whole inside the block; released after."""
        buckets = self.buckets if buckets is None else buckets
        self.gather(buckets)
        try:
            yield
        finally:
            self.release(buckets)

    @gather_phase
    def refresh_persistent(self) -> None:
        """After a step (and at start): persistent buckets hold the new weights of every rank."""
        for w in self.pending.values():
            w.wait()
        self.pending.clear()
        stale = [b for b in self.buckets if b.index in self.persistent]
        for b in stale:
            self.gathered.discard(b.index)
            self._start(b)
        for b in stale:
            self._wait(b)
