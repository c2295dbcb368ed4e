"""Stage 3: parameters partitioned; each unit's parameters gathered just before it runs.

A unit is a block of modules (units.py): by default each repeated child of the model (a transformer
block) and the model itself for the rest. Its buckets (flat.lay_out) hold whole units, several small
ones coalesced up to `stage3_prefetch_bucket_size`. A gathered buffer keeps its tensor and storage
objects for life; between uses its storage holds no bytes (pool.py: the memory is lent from a pool of
host slots, or the storage resized), so any autograd graph that saved views of it stays valid and sees
the data again once it is gathered back. While released, the parameters point at an empty tensor, so
stray reads fail loudly instead of reading freed memory (a view of freed storage would crash the process).

Each bucket has one record (`BucketRecord`, FSDP2's FSDPParamGroup): its `BucketState` and the counts
its transitions read (`holds`, `unfinished`, `done`). The rules:
  RELEASED -> GATHERING   `_start`: memory for its storage, its parameters on their views, its all_gather
                          launched (`work`); `unfinished` := every unit that reads it. Forward pre-hook:
                          the unit's buckets, then prefetch of the next ones in the first forward's order
                          (`place`); in the backward, the ones before (a `done` bucket is not prefetched).
  GATHERING -> GATHERED   `_wait`, before its parameters are read (a timeout names where this rank was).
  GATHERED -> GATHERING   its values refreshed in place: after a step (persistent or held buckets), or
                          another rank's gather joined (UnevenForwards); nothing else about it changes.
  -> RELEASED             `release` (waiting first), unless the bucket is persistent (kept whole, no
                          hooks: under `stage3_param_persistence_threshold` the collectives would cost
                          more than the memory) or `holds` > 0 (gathered_parameters blocks): when a unit's
                          forward ends and `unfinished` empties (forward post-hook), when all its
                          gradients are in (reducer, gradients_done) or every unit reading it is through
                          the backward (frozen buckets: `done`), and at the end of the backward
                          (release_all, which clears `done`).
A `gathered_parameters` block holds its buckets (`holds`) against all of these until it exits, then
gives each bucket new storage: the old one stays with any view a script kept of it, or is freed or pooled.
The model's own unit stays gathered into the backward, which needs it first (FSDP2's root), and so
does the last unit of the forward when it fits in the prefetch budget (FSDP2's
reshard_after_forward=False for the last block): a 6.7B GPT's 0.4 GB block would otherwise add to the
peak at the start of the backward. A bucket shared with a unit that does not run stays gathered
until the end of the backward.
Every forward's gathers are collectives, so every rank must run the same forwards; an `uneven_forwards`
block (UnevenForwards) lets ranks run different numbers (generate() of different lengths): each unit's
gather is agreed first, and a rank that has left the block answers the others' until none is left. A
gather that times out names what this rank was doing (whereabouts.py) and where the other ranks are
(Comm.peer_failure). The hot path does no Python work per parameter: the views are made once and
swapped in and out by C-level maps.
"""
from __future__ import annotations

import bisect
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import Bucket, local_setter
from zerodp.engine.layout.layout import Layout
# (unit_buckets, planned_gathers, kept_last: the units' facts stage 3 gathers by, imported from here too)
from zerodp.engine.layout.units import Units, kept_last, planned_gathers, unit_buckets  # noqa: F401
from zerodp.engine.sharding.on_disk import ShardsOnDisk
from zerodp.engine.sharding.pool import gather_memory
from zerodp.engine.sharding.whereabouts import GatherTags, Whereabouts
from zerodp.monitor.timers import TimedGathers, gather_phase


class BucketState(Enum):
    """Where a bucket's gathered copy is; what `Gatherer.watch` reports at each change."""

    RELEASED = "released"    # its storage holds no bytes; its parameters point at empty tensors
    GATHERING = "gathering"  # parameters point at their views; the all_gather is in flight
    GATHERED = "gathered"    # whole on this rank


@dataclass(eq=False)
class BucketRecord:
    """One gathered bucket's state and the few counts its transitions read (FSDP2's FSDPParamGroup)."""

    bucket: Bucket
    users: frozenset[int]  # the units whose forward reads it
    params: list[nn.Parameter]  # its parameters, pointed at its views while gathered
    point: Callable  # flat.set_local for these parameters (C-level when none is a DTensor)
    empty: list[torch.Tensor]  # what its parameters point at while it is released
    state: BucketState = BucketState.RELEASED
    work: object | None = None  # its all_gather, while in flight
    holds: int = 0  # gathered_parameters blocks holding it gathered
    unfinished: set[int] = field(default_factory=set)  # while gathered: its units yet to finish this forward
    done: bool = False  # this backward is done with it (gradients all in, or its units gone through)
    place: int | None = None  # its place in the first forward's gather order (prefetch)

    @property
    def releasable(self) -> bool:
        return self.state is not BucketState.RELEASED and not self.bucket.persistent and not self.holds


class Gatherer(TimedGathers):
    def __init__(self, units: Units, layout: Layout, comm: Comm, prefetch_numel: int,
                 host_shards: bool = False, unit_names: list[str] | None = None, on_disk: ShardsOnDisk | None = None):
        self.comm = comm
        buckets = layout.gathered  # trained and frozen (Bucket.frozen): gathered alike, index = position
        self.buckets = buckets
        self.host_shards = host_shards  # offload_param: b.owned is in host memory
        self.on_disk = on_disk  # offload_param "nvme": the shards in a file, read ahead of their gathers
        self.prefetch_numel = prefetch_numel
        # where a gathered bucket's memory comes from: a pool of host slots, or storage resize_ (pool.py)
        self.memory = gather_memory(buckets[0].data.device, comm.is_fake(), buckets)
        self.watcher: Callable[[Bucket, BucketState], None] | None = None  # see watch()
        self.unit_buckets = unit_buckets(units, buckets)  # unit -> the buckets its forward reads
        users: dict[int, set[int]] = {}
        for u, bs in enumerate(self.unit_buckets):
            for b in bs:
                users.setdefault(b.index, set()).add(u)
        params = [[s.param for s in b.slots] for b in buckets]
        # bucket index -> its record: one state per bucket (the rules: the module's docstring)
        self.records = [BucketRecord(b, frozenset(users.get(b.index, ())), ps, local_setter(ps),
                                     [b.data.new_empty(0)] * len(b.slots)) for b, ps in zip(buckets, params)]
        self.order: list[Bucket] = []       # first-forward gather order, for prefetch
        self.prefix = [0]                   # prefix[i]: elements of order[:i], for the prefetch window
        self.window = (-1, 0)               # (place of the last prefetch, end of the window it covered)
        self.back_window = (len(buckets) + 1, len(buckets) + 1)  # the same, walking back in the backward
        self.through: set[int] = set()      # units this backward has gone through (frozen buckets)
        self.outer = units.outer  # the model's own unit (None when the model is no unit's root)
        self.unit_order: dict[int, None] = {}  # units in the order of their first forward
        self.traced = False                 # a whole forward and backward have run: the order is known
        self.last_unit: int | None = None   # then: the forward's last unit, if kept gathered (kept_last)
        # what the gathers are for, named if one times out (unit_names: each unit's root module's name)
        self.whereabouts = Whereabouts(unit_names or [""] * len(units.roots))
        # each gather's tag agreed first, where reading it costs the host nothing (whereabouts.GatherTags)
        self.tags = (GatherTags(comm.shard, self.whereabouts) if comm.shard.world_size > 1 and not comm.is_fake()
                     and buckets[0].data.device.type == "cpu" else None)
        self.uneven: UnevenForwards | None = None  # inside an uneven_forwards block: its gathers are agreed
        self._handles = []
        for u, (root, bs) in enumerate(zip(units.roots, self.unit_buckets)):
            if not all(b.persistent for b in bs):  # a unit always gathered needs no hooks
                self._handles.append(root.register_forward_pre_hook(self._pre_hook(u, bs), with_kwargs=True))
                self._handles.append(root.register_forward_hook(self._post_hook(u, bs)))
        for r in self.records:
            self._free(r)
        self.refresh_persistent()

    def is_gathered(self, b: Bucket) -> bool:
        """Whether b's parameters point at its gathered buffer (whole, or its all_gather in flight)."""
        return self.records[b.index].state is not BucketState.RELEASED

    def gathered_bytes(self) -> tuple[int, int]:
        """(bytes of the buckets gathered now, bytes held for gathers that none uses now: the pool's idle slots)."""
        held = sum(r.bucket.data.untyped_storage().nbytes() for r in self.records
                   if r.state is not BucketState.RELEASED)
        return held, self.memory.idle_bytes()

    # ---- hooks ----------------------------------------------------------------------------------
    # torch.compile must not trace these hooks: a storage resize, a `p.data` swap and an async
    # collective are not graph ops, and a gather traced into a module's graph rewrites the bucket that
    # graph saved for backward ("modified by an inplace operation"). Disabled, each hook runs eagerly
    # between the compiled pieces of the forward (one graph break per unit).
    def _pre_hook(self, unit: int, buckets: list[Bucket]):
        frozen = [b for b in buckets if b.frozen and not b.persistent]

        @torch.compiler.disable
        def hook(module, args, kwargs):
            if not self.traced:
                self.unit_order.setdefault(unit)
            self.whereabouts.forward(unit, module.training)
            if self.uneven is not None:  # every rank gathers what any rank's unit needs; no prefetch
                self.uneven.request(buckets)
                return self.gather(buckets)
            self.gather(buckets)
            self._prefetch_after(buckets[-1])
            self._read_ahead(buckets[-1], forward=True)
            if frozen and torch.is_grad_enabled():
                self._after_unit_backward(unit, frozen, (args, kwargs))
        return hook

    def _after_unit_backward(self, unit: int, frozen: list[Bucket], inputs) -> None:
        """Release a unit's frozen buckets once the backward has gone through every unit that reads them:
        a unit is through when the gradients of its inputs are computed (FSDP2's post-backward). A unit
        whose inputs need no gradient (the first, on token ids) never is, and keeps its frozen buckets,
        and those it shares with other units, to the end of the backward (release_all)."""
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: self._backward_done(unit, frozen), mode="all")

    def _backward_done(self, unit: int, frozen: list[Bucket]) -> None:
        self.through.add(unit)
        done = [b for b in frozen if self.records[b.index].users <= self.through]
        for b in done:
            self.records[b.index].done = True
        self.release(done)

    def _post_hook(self, unit: int, buckets: list[Bucket]):
        @torch.compiler.disable
        def hook(module, args, output):
            tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            # The backward starts with the model's own unit and the last unit: keep them gathered. So
            # does a unit recomputed inside the backward (activation checkpointing), which runs its
            # backward next; the reducer releases its buckets once their gradients are in.
            keep = tensors and (unit in (self.outer, self.last_unit) or torch._C._current_graph_task_id() != -1)
            self._finished(unit, buckets, keep)
            if tensors:  # backward through this unit needs its parameters again
                register_multi_grad_hook(tensors, lambda grads: self._backward_gather(unit, buckets), mode="any")
        return hook

    def _finished(self, unit: int, units: list[Bucket], keep: bool) -> None:
        """A unit's forward ended: release each of its buckets that no other unit still needs."""
        for b in units:
            r = self.records[b.index]
            if r.state is not BucketState.RELEASED:
                r.unfinished.discard(unit)
                if not r.unfinished and not keep:
                    self.release([b])

    def _backward_gather(self, unit: int, units: list[Bucket]) -> None:
        self.whereabouts.doing = ("backward", unit, 0)
        self.gather(units)
        self._prefetch_before(units[0])
        self._read_ahead(units[0], forward=False)

    # ---- gather / release -----------------------------------------------------------------------
    @gather_phase
    def gather(self, units: list[Bucket]) -> None:
        if (self.tags is not None and self.uneven is None  # (an uneven block agrees on its gathers itself)
                and any(self.records[b.index].state is BucketState.RELEASED for b in units)):
            self.tags.check(units[0].index)  # where this rank waits for them anyway; none for held buckets
        for b in units:
            r = self.records[b.index]
            if r.place is None:
                r.place = len(self.order)
                self.order.append(b)
                self.prefix.append(self.prefix[-1] + b.numel)
            if r.state is BucketState.RELEASED:
                self._start(r)
        for b in units:
            self._wait(self.records[b.index])

    def _start(self, r: BucketRecord) -> None:
        """RELEASED (or GATHERED, refreshed) -> GATHERING: memory, the parameters on their views, the all_gather."""
        b = r.bucket
        self.memory.fill(b)
        deque(map(r.point, r.params, b.views), maxlen=0)
        r.unfinished = set(r.users)
        self._launch(r)
        if self.watcher is not None:
            self.watcher(b, BucketState.GATHERING)

    def regather(self, b: Bucket) -> None:
        """Join a gather of a bucket this rank holds gathered already (UnevenForwards: another rank needs
        it): into its buffer in place, the same values, nothing else about it changed."""
        r = self.records[b.index]
        self._wait(r)
        self._launch(r)

    def _launch(self, r: BucketRecord) -> None:
        b, source = r.bucket, r.bucket.owned
        if self.host_shards:  # the host shard goes to its own place in the device bucket, gathered in place
            source = b.shard(b.data, self.comm.shard_rank)
            if self.on_disk is None:
                source.copy_(b.owned, non_blocking=True)
            else:  # (from a buffer that is reused at once: a copy done before it is given back)
                with self.on_disk.reading(b) as shard:
                    source.copy_(shard)
        r.work = self.comm.shard_gather(b.data, source, async_op=True)
        r.state = BucketState.GATHERING

    def _wait(self, r: BucketRecord) -> None:
        """GATHERING -> GATHERED once its all_gather is done (a timeout names where this rank was)."""
        work, r.work = r.work, None
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as e:  # a timeout names this rank's forward and where the others are
            failure = self.comm.shard.peer_failure(e, *self.whereabouts.where())
            if failure is None:
                raise
            raise failure from e
        r.state = BucketState.GATHERED
        if self.watcher is not None:
            self.watcher(r.bucket, BucketState.GATHERED)

    def _prefetch_after(self, last: Bucket) -> None:
        """Start gathering the buckets that came next in the first forward, up to the prefetch size."""
        start = self.records[last.index].place
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
            if self.records[b.index].state is BucketState.RELEASED:
                self._start(self.records[b.index])
        self.window = (start, max(end, first))

    def _prefetch_before(self, first: Bucket) -> None:
        """In the backward: start gathering the buckets that came just before in the forward, which the
        backward reaches next, up to the prefetch size."""
        end = self.records[first.index].place
        if self.prefetch_numel <= 0 or end is None:
            return
        begin = bisect.bisect_left(self.prefix, self.prefix[end] - self.prefetch_numel)
        last_end, covered = self.back_window  # as in _prefetch_after, only the part not yet looked at
        stop = end if end > last_end else min(end, covered)
        for b in reversed(self.order[begin:stop]):
            r = self.records[b.index]
            if r.state is BucketState.RELEASED and not r.done:
                self._start(r)
        self.back_window = (end, min(begin, stop))

    def _read_ahead(self, last: Bucket, forward: bool) -> None:
        """offload_param "nvme": the shards on disk of the buckets gathered next after `last` in the first
        forward's order (before it, in a backward), beyond those being gathered, are read ahead (on_disk.py).
        The first forward, whose order is being recorded, guesses the buckets' own order."""
        place = self.records[last.index].place
        if self.on_disk is None or place is None:
            return
        order, records, released = self.order, self.records, BucketState.RELEASED
        if forward and not self.traced:
            nxt = (b for b in self.buckets[last.index + 1:] if records[b.index].state is released)
        elif forward:
            nxt = (order[i] for i in range(place + 1, len(order)) if records[order[i].index].state is released)
        else:
            nxt = (order[i] for i in range(place - 1, -1, -1)
                   if records[order[i].index].state is released and not records[order[i].index].done)
        self.on_disk.ahead(nxt)

    def release(self, units: list[Bucket]) -> None:
        for b in units:
            r = self.records[b.index]
            if r.releasable:
                self._wait(r)
                self._free(r)

    def release_gathered(self) -> None:
        """Every bucket gathered now and held by no gathered_parameters block is released (persistent ones
        stay whole: no hook would gather them again). Between steps: DeepSpeed's empty_partition_cache."""
        self.release([r.bucket for r in self.records if r.state is not BucketState.RELEASED])

    def remove_hooks(self) -> None:
        """No unit gathers any more (the engine is being destroyed); what is gathered is released first."""
        self.release_gathered()
        for h in self._handles:
            h.remove()
        self._handles = []

    def gradients_done(self, b: Bucket) -> None:
        """(reducer) All of b's gradients of this backward are in: release it, and prefetch it no more."""
        self.records[b.index].done = True
        self.release([b])

    def release_all(self) -> None:
        """At the end of a backward (and before a step): nothing stays gathered but persistent buckets."""
        for r in self.records:
            r.done = False
        self.through.clear()
        self.release_gathered()
        self.memory.trim()
        if self.unit_order and not self.traced:  # the first forward is over: its order is known
            self.traced = True
            last = next(reversed(self.unit_order))
            self.last_unit = kept_last(last, self.unit_buckets[last], self.prefetch_numel)

    def _free(self, r: BucketRecord) -> None:
        """-> RELEASED: its memory back (to the pool), its parameters on empty tensors."""
        self.memory.empty(r.bucket)
        deque(map(r.point, r.params, r.empty), maxlen=0)
        r.state, r.unfinished = BucketState.RELEASED, set()
        if self.watcher is not None:
            self.watcher(r.bucket, BucketState.RELEASED)

    def _free_detached(self, r: BucketRecord) -> None:
        """As _free, but the gathered storage is left to whoever still holds a view of it, and the
        bucket gets a new one. A script may keep what it read inside a gathered_parameters block
        (`p.data.cpu()` is p's storage itself on a CPU); freed in place, that view would read freed
        memory (a crash). Without such a view the old storage is freed (or pooled) here all the same."""
        self._wait(r)
        deque(map(r.point, r.params, r.empty), maxlen=0)
        self.memory.renew(r.bucket)
        self._free(r)

    def watch(self, watcher: Callable[[Bucket, BucketState], None]) -> None:
        """watcher(bucket, state) now for every bucket, then at each change of a bucket's state."""
        self.watcher = watcher
        for r in self.records:
            watcher(r.bucket, r.state)

    @contextmanager
    def gathered_parameters(self, buckets: list[Bucket] | None = None):
        """These buckets' (default: every) parameters whole inside the block, whatever runs in it (a
        forward's hooks, a nested block, a step: it refreshes them); released after."""
        buckets = self.buckets if buckets is None else buckets
        if self.uneven is not None:
            raise RuntimeError("engine.gathered_parameters() inside engine.uneven_forwards(): a rank that left "
                               "the uneven block would not join its gathers; use one of the two")
        self.whereabouts.doing = "entering engine.gathered_parameters()"
        self.gather(buckets)
        records = [self.records[b.index] for b in buckets]
        for r in records:
            r.holds += 1
        try:
            yield
        finally:
            for r in records:
                r.holds -= 1
            for r in records:
                if r.releasable:
                    self._free_detached(r)

    @gather_phase
    def refresh_persistent(self) -> None:
        """After a step (and at start): persistent buckets, and those a gathered_parameters block holds,
        hold the new weights of every rank."""
        self.whereabouts.doing = "refreshing the parameters kept whole, in engine.step()"
        for r in self.records:
            self._wait(r)
        stale = [r for r in self.records if r.bucket.persistent or r.holds]
        for r in stale:
            self._start(r)
        for r in stale:
            self._wait(r)

    @contextmanager
    def uneven_forwards(self):
        """Forwards inside may differ in number between ranks (see UnevenForwards). Collective at exit:
        every rank waits there until every rank has left its block."""
        if any(r.holds for r in self.records) or self.uneven is not None:
            raise RuntimeError("engine.uneven_forwards() inside engine.gathered_parameters() or inside itself: "
                               "a rank that left the block would not join the gathers of the other; use one")
        self.uneven = UnevenForwards(self)
        try:
            yield
            self.uneven.answer_until_all_done()
        finally:
            self.uneven = None

    def stepped(self, steps: int) -> None:
        """(engine) A step was taken: forwards are counted from here (Whereabouts)."""
        self.whereabouts.stepped(steps)
        if self.tags is not None:
            self.tags.stepped()
        if self.on_disk is not None:  # the next forward's first shards, read while the caller prepares it
            self.on_disk.ahead(b for b in (self.order or self.buckets) if not self.is_gathered(b))


class UnevenForwards:
    """Stage-3 forwards that ranks run different numbers of times: generate() stopping at different
    lengths, an eval loop over data that does not divide the ranks.

    Before each unit's forward every rank says which buckets it needs, in one all_reduce of a 0/1 per
    bucket plus a count of the ranks still in the block; a rank that has left the block says "none" in a
    loop. Every rank then gathers the union (one that holds a bucket gathered already joins its gather in
    place: the same values) and releases what it did not ask for. The loop ends on every rank at once,
    when the count is 0. It costs one small all_reduce per unit and gives up prefetching: for forwards
    without backward (the block runs under torch.no_grad()), where FSDP's users run dummy forwards."""

    def __init__(self, gatherer: Gatherer):
        self.gatherer = gatherer
        self.n = len(gatherer.buckets)
        self.device = gatherer.buckets[0].data.device

    def request(self, buckets: list[Bucket]) -> None:
        """Before a unit's forward on a rank still in the block: every rank gathers what any rank needs."""
        self._gather(self._agree([b.index for b in buckets], running=1), mine={b.index for b in buckets})

    def answer_until_all_done(self) -> None:
        """At the end of this rank's block: join the others' gathers until no rank is left in its block."""
        self.gatherer.whereabouts.doing = "answering other ranks' gathers at the end of engine.uneven_forwards()"
        while (need := self._agree([], running=0))[0] > 0:
            self._gather(need, mine=set())

    def _agree(self, indices: list[int], running: int) -> list[float]:
        g = self.gatherer
        need = torch.zeros(self.n + 1, device=self.device)
        need[0] = running
        need[[i + 1 for i in indices if not g.buckets[i].persistent]] = 1
        try:
            g.comm.shard.all_reduce(need)
        except RuntimeError as e:
            where, _, _ = g.whereabouts.where()
            failure = g.comm.shard.peer_failure(e, f"{where} (engine.uneven_forwards()'s agreement)", "all_reduce",
                                                "every rank must enter and leave engine.uneven_forwards() alike")
            if failure is None:
                raise
            raise failure from e
        return need.tolist()

    def _gather(self, need: list[float], mine: set[int]) -> None:
        g = self.gatherer
        wanted = [g.buckets[i] for i, n in enumerate(need[1:]) if n > 0]
        before = {b.index for b in wanted if g.is_gathered(b)}
        for b in wanted:
            if b.index in before:
                g.regather(b)
            else:
                g._start(g.records[b.index])
        for b in wanted:
            g._wait(g.records[b.index])
        g.release([b for b in wanted if b.index not in mine and b.index not in before])
