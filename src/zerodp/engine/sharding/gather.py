"""Stage 3: parameters partitioned; each unit's parameters gathered just before it runs.

A unit is a block of modules (units.py): by default each repeated child of the model (a transformer
block) and the model itself for the rest. Its buckets (flat.lay_out) hold whole units, several small
ones coalesced up to `stage3_prefetch_bucket_size`. A gathered buffer keeps its tensor object but
its storage is resized to zero between uses, so any autograd graph that saved views of it stays
valid and sees the data again once it is gathered back. While released, the parameters point at an
empty tensor, so stray reads fail loudly instead of reading freed memory (a view of freed storage
would crash the process):
  forward pre-hook   gather the unit's buckets (and start prefetching the next ones);
  forward post-hook  release each bucket once every unit sharing it has run, and arrange for a
                     gather when backward reaches the unit (prefetching the ones before it);
  gradient hook      (reducer, gradients_done) once all of a bucket's gradients are in, release it;
  end of backward    release whatever is still gathered.
A `gathered_parameters` block holds its buckets gathered against all of these until it exits, then
gives each bucket new storage: the old one stays with any view a script kept of it, or is freed.
Every forward's gathers are collectives, so every rank must run the same forwards; an `uneven_forwards`
block (UnevenForwards) lets ranks run different numbers (generate() of different lengths): each unit's
gather is agreed first, and a rank that has left the block answers the others' until none is left. A
gather that times out names what this rank was doing (`Whereabouts`: the forward's number, the unit,
the phase and the step) and where the other ranks are (Comm.peer_failure).
The model's own unit stays gathered into the backward, which needs it first (FSDP2's root), and so
does the last unit of the forward when it fits in the prefetch budget (FSDP2's
reshard_after_forward=False for the last block): a 6.7B GPT's 0.4 GB block would otherwise add to the
peak at the start of the backward. A bucket shared with a unit that does not run stays gathered
until the end of the backward. Buckets of units under `stage3_param_persistence_threshold` elements
stay gathered, with no hooks: the collectives for them would cost more than their memory. The hot
path does no Python work per parameter: the views are made once and swapped in and out by C-level
maps.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from contextlib import contextmanager
from enum import Enum
from typing import Callable

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from zerodp.distributed.comm import Comm
from zerodp.distributed.failures import DIVERGENCE
from zerodp.engine.layout.flat import Bucket, local_setter
from zerodp.engine.layout.layout import Layout
from zerodp.engine.layout.units import Units
from zerodp.monitor.timers import TimedGathers, gather_phase


def kept_last(last: int | None, last_buckets: list[Bucket], prefetch_numel: int) -> int | None:
    """The forward's last unit stays gathered into the backward when its gathered elements fit in the
    prefetch budget (keeping it is prefetching it for the backward): `last`, else None."""
    moving = sum(b.numel for b in last_buckets if not b.persistent)
    return last if last is not None and moving <= prefetch_numel else None


def unit_buckets(units: Units, buckets: list[Bucket]) -> list[list[Bucket]]:
    """Each unit's buckets: those of every parameter its modules register, in index order."""
    bucket_of = {id(s.param): b for b in buckets for s in b.slots}
    return [sorted({id(b): b for p in used if (b := bucket_of.get(id(p))) is not None}.values(),
                   key=lambda b: b.index) for used in units.uses]


def planned_gathers(units: Units, buckets: list[Bucket], last_unit: int | None) -> tuple[int, int]:
    """All-gathers per micro-step, and their elements, once the forward's order is known: each bucket
    that is not persistent once in the forward, and once more in the backward unless the model's own
    unit or the last unit kept gathered (`last_unit`, see kept_last) reads it."""
    of_unit = unit_buckets(units, buckets)
    kept = {b.index for u in (units.outer, last_unit) if u is not None for b in of_unit[u]}
    moving = [b for b in buckets if not b.persistent]
    again = [b for b in moving if b.index not in kept]
    return len(moving) + len(again), sum(b.numel for b in moving + again)


# What a divergence of stage-3 forwards looks like, and what to do instead (a timed-out forward gather says it).
FORWARDS_DIVERGED = (
    "ranks that run different numbers of forwards (an eval loop over data that does not divide the ranks, "
    "generate() stopping at different lengths) diverge at stage 3, where each forward gathers every unit "
    "from every rank: run them inside `with engine.gathered_parameters():` (the whole model gathered once, "
    "where it fits) or `with engine.uneven_forwards():` (ranks that finish early answer the others' gathers)")


class Whereabouts:
    """What this rank's gathers are for, named when one times out: each unit's forwards counted per phase
    ("forward": training, with gradients; "eval": no gradients or module.eval()) since the last step."""

    def __init__(self, unit_names: list[str]):
        self.unit_names = unit_names  # unit -> its root module's name, for the message
        self.forwards: Counter[tuple[str, int]] = Counter()  # (phase, unit) -> forwards since the last step
        self.steps = 0  # optimizer steps taken (engine.global_steps)
        self.doing: tuple[str, int, int] | str = "a gather"  # (phase, unit, forward number), or what else

    def forward(self, unit: int, training: bool) -> None:
        phase = "forward" if training and torch.is_grad_enabled() else "eval"
        self.forwards[phase, unit] += 1
        self.doing = (phase, unit, self.forwards[phase, unit])

    def stepped(self, steps: int) -> None:
        self.steps = steps
        self.forwards.clear()

    def where(self) -> tuple[str, str, str]:
        """(where, the collective, what a divergence looks like) for Comm.peer_failure."""
        if isinstance(self.doing, str):
            return f"{self.doing} after step {self.steps}", "all_gather", DIVERGENCE
        phase, unit, n = self.doing
        name = f"unit {unit} ({repr(self.unit_names[unit]) if self.unit_names[unit] else 'the model'})"
        if phase == "backward":
            return f"for the backward of {name} at step {self.steps + 1}", "all_gather", DIVERGENCE
        when = f"at step {self.steps + 1}" if phase == "forward" else f"after step {self.steps}"
        return f"for forward {n} of {name} in {phase} {when}", "all_gather", FORWARDS_DIVERGED


class BucketState(Enum):
    """Where a bucket's gathered copy is; what `Gatherer.watch` reports at each change."""

    RELEASED = "released"    # storage freed; its parameters point at empty tensors
    GATHERING = "gathering"  # parameters point at their views; the all_gather is in flight
    GATHERED = "gathered"    # whole on this rank


class Gatherer(TimedGathers):
    def __init__(self, units: Units, layout: Layout, comm: Comm, prefetch_numel: int,
                 host_shards: bool = False, unit_names: list[str] | None = None):
        self.comm = comm
        buckets = layout.gathered  # trained and frozen (Layout.frozen): gathered alike
        # Frozen buckets get no gradient that would tell the backward is done with them: a hook on the
        # unit's inputs' gradients does (_after_unit_backward).
        self.frozen = {b.index for b in layout.frozen_buckets if not b.persistent}
        self.host_shards = host_shards  # offload_param: b.owned is in host memory
        self.prefetch_numel = prefetch_numel
        self.persistent = {b.index for b in buckets if b.persistent}
        self.gathered: set[int] = set()
        self.pending: dict[int, object] = {}        # bucket index -> async all_gather in flight
        self.held: Counter[int] = Counter()         # bucket index -> gathered_parameters blocks holding it
        self.watcher: Callable[[Bucket, BucketState], None] | None = None  # see watch()
        self.order: list[Bucket] = []       # first-forward gather order, for prefetch
        self.position: dict[int, int] = {}  # bucket index -> place in self.order
        self.prefix = [0]                   # prefix[i]: elements of order[:i], for the prefetch window
        self.window = (-1, 0)               # (place of the last prefetch, end of the window it covered)
        self.back_window = (len(buckets) + 1, len(buckets) + 1)  # the same, walking back in the backward
        self.buckets = buckets
        self.params = {b.index: [s.param for s in b.slots] for b in buckets}
        self._set = {k: local_setter(params) for k, params in self.params.items()}  # flat.set_local, per bucket
        self._empty = {b.index: [b.data.new_empty(0)] * len(b.slots) for b in buckets}
        self.unit_buckets = unit_buckets(units, buckets)  # unit -> the buckets its forward reads
        self.users: dict[int, set[int]] = {}                # bucket index -> the units whose forward reads it
        for u, bs in enumerate(self.unit_buckets):
            for b in bs:
                self.users.setdefault(b.index, set()).add(u)
        self.unfinished: dict[int, set[int]] = {}   # gathered bucket -> its units yet to finish this forward
        self.reduced: set[int] = set()              # buckets this backward is done with (gradients all in)
        self.through: set[int] = set()              # units this backward has gone through (frozen buckets)
        self.outer = units.outer  # the model's own unit (None when the model is no unit's root)
        self.unit_order: dict[int, None] = {}  # units in the order of their first forward
        self.traced = False                 # a whole forward and backward have run: the order is known
        self.last_unit: int | None = None   # then: the forward's last unit, if kept gathered (kept_last)
        # what the gathers are for, named if one times out (unit_names: each unit's root module's name)
        self.whereabouts = Whereabouts(unit_names or [""] * len(units.roots))
        self.uneven: UnevenForwards | None = None  # inside an uneven_forwards block: its gathers are agreed
        self._handles = []
        for u, (root, bs) in enumerate(zip(units.roots, self.unit_buckets)):
            if any(b.index not in self.persistent for b in bs):  # a unit always gathered needs no hooks
                self._handles.append(root.register_forward_pre_hook(self._pre_hook(u, bs), with_kwargs=True))
                self._handles.append(root.register_forward_hook(self._post_hook(u, bs)))
        for b in buckets:
            self._free(b)
        self.refresh_persistent()

    # ---- hooks ----------------------------------------------------------------------------------
    # torch.compile must not trace these hooks: a storage resize, a `p.data` swap and an async
    # collective are not graph ops, and a gather traced into a module's graph rewrites the bucket that
    # graph saved for backward ("modified by an inplace operation"). Disabled, each hook runs eagerly
    # between the compiled pieces of the forward (one graph break per unit).
    def _pre_hook(self, unit: int, buckets: list[Bucket]):
        frozen = [b for b in buckets if b.index in self.frozen]

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
        done = [b for b in frozen if self.users[b.index] <= self.through]
        self.reduced.update(b.index for b in done)
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
            left = self.unfinished.get(b.index)
            if left is not None:
                left.discard(unit)
                if not left and not keep:
                    self.release([b])

    def _backward_gather(self, unit: int, units: list[Bucket]) -> None:
        self.whereabouts.doing = ("backward", unit, 0)
        self.gather(units)
        self._prefetch_before(units[0])

    # ---- gather / release -----------------------------------------------------------------------
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
        storage, nbytes = b.data.untyped_storage(), b.numel * b.data.element_size()
        if storage.nbytes() != nbytes:  # (a resize reallocates and copies, even to the same size)
            storage.resize_(nbytes)
        deque(map(self._set[b.index], self.params[b.index], b.views), maxlen=0)
        self.gathered.add(b.index)
        self.unfinished[b.index] = set(self.users.get(b.index, ()))
        self._launch(b)
        if self.watcher is not None:
            self.watcher(b, BucketState.GATHERING)

    def regather(self, b: Bucket) -> None:
        """Join a gather of a bucket this rank holds gathered already (UnevenForwards: another rank needs
        it): into its buffer in place, the same values, nothing else about it changed."""
        self._wait(b)
        self._launch(b)

    def _launch(self, b: Bucket) -> None:
        source = b.owned
        if self.host_shards:  # the host shard goes to its own place in the device bucket, gathered in place
            source = b.shard(b.data, self.comm.shard_rank)
            source.copy_(b.owned, non_blocking=True)
        self.pending[b.index] = self.comm.shard_gather(b.data, source, async_op=True)

    def _wait(self, b: Bucket) -> None:
        work = self.pending.pop(b.index, None)
        if work is not None:
            try:
                work.wait()
            except RuntimeError as e:  # a timeout names this rank's forward and where the others are
                failure = self.comm.shard.peer_failure(e, *self.whereabouts.where())
                if failure is None:
                    raise
                raise failure from e
            if self.watcher is not None:
                self.watcher(b, BucketState.GATHERED)

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

    def _prefetch_before(self, first: Bucket) -> None:
        """In the backward: start gathering the buckets that came just before in the forward, which the
        backward reaches next, up to the prefetch size."""
        end = self.position.get(first.index)
        if self.prefetch_numel <= 0 or end is None:
            return
        begin = bisect.bisect_left(self.prefix, self.prefix[end] - self.prefetch_numel)
        last_end, covered = self.back_window  # as in _prefetch_after, only the part not yet looked at
        stop = end if end > last_end else min(end, covered)
        for b in reversed(self.order[begin:stop]):
            if b.index not in self.gathered and b.index not in self.reduced:
                self._start(b)
        self.back_window = (end, min(begin, stop))

    def release(self, units: list[Bucket]) -> None:
        for b in units:
            if b.index in self.gathered and b.index not in self.persistent and b.index not in self.held:
                self._wait(b)
                self._free(b)

    def release_gathered(self) -> None:
        """Every bucket gathered now and held by no gathered_parameters block is released (persistent ones
        stay whole: no hook would gather them again). Between steps: DeepSpeed's empty_partition_cache."""
        self.release([self.buckets[i] for i in sorted(self.gathered)])

    def remove_hooks(self) -> None:
        """No unit gathers any more (the engine is being destroyed); what is gathered is released first."""
        self.release_gathered()
        for h in self._handles:
            h.remove()
        self._handles = []

    def gradients_done(self, b: Bucket) -> None:
        """(reducer) All of b's gradients of this backward are in: release it, and prefetch it no more."""
        self.reduced.add(b.index)
        self.release([b])

    def release_all(self) -> None:
        """At the end of a backward (and before a step): nothing stays gathered but persistent buckets."""
        self.reduced.clear()
        self.through.clear()
        self.release([self.buckets[i] for i in list(self.gathered)])
        if self.unit_order and not self.traced:  # the first forward is over: its order is known
            self.traced = True
            last = next(reversed(self.unit_order))
            self.last_unit = kept_last(last, self.unit_buckets[last], self.prefetch_numel)

    def _free(self, b: Bucket) -> None:
        b.data.untyped_storage().resize_(0)
        deque(map(self._set[b.index], self.params[b.index], self._empty[b.index]), maxlen=0)
        self.gathered.discard(b.index)
        self.unfinished.pop(b.index, None)
        if self.watcher is not None:
            self.watcher(b, BucketState.RELEASED)

    def _free_detached(self, b: Bucket) -> None:
        """As _free, but the gathered storage is left to whoever still holds a view of it, and the
        bucket gets a new one. A script may keep what it read inside a gathered_parameters block
        (`p.data.cpu()` is p's storage itself on a CPU); freed in place, that view would read freed
        memory (a crash). Without such a view the old storage is freed here all the same."""
        self._wait(b)
        dtype, device = b.data.dtype, b.data.device
        deque(map(self._set[b.index], self.params[b.index], self._empty[b.index]), maxlen=0)
        b.data, b.views = None, []  # the last references this engine holds to the old storage
        b.data = torch.empty(b.numel, dtype=dtype, device=device)  # views are made while it is whole
        b.views = [b.data[s.offset:s.offset + s.numel].view(s.shape) for s in b.slots]
        self._free(b)

    def watch(self, watcher: Callable[[Bucket, BucketState], None]) -> None:
        """watcher(bucket, state) now for every bucket, then at each change of a bucket's state."""
        self.watcher = watcher
        for b in self.buckets:
            watcher(b, BucketState.RELEASED if b.index not in self.gathered else
                    BucketState.GATHERING if b.index in self.pending else BucketState.GATHERED)

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
        self.held.update(b.index for b in buckets)
        try:
            yield
        finally:
            self.held.subtract(b.index for b in buckets)
            self.held = +self.held  # drops the buckets no block holds any more
            for b in buckets:
                if b.index in self.gathered and b.index not in self.persistent and b.index not in self.held:
                    self._free_detached(b)

    @gather_phase
    def refresh_persistent(self) -> None:
        """After a step (and at start): persistent buckets, and those a gathered_parameters block holds,
        hold the new weights of every rank."""
        self.whereabouts.doing = "refreshing the parameters kept whole, in engine.step()"
        for i in list(self.pending):
            self._wait(self.buckets[i])
        stale = [b for b in self.buckets if b.index in self.persistent or b.index in self.held]
        for b in stale:
            self.gathered.discard(b.index)
            self._start(b)
        for b in stale:
            self._wait(b)

    @contextmanager
    def uneven_forwards(self):
        """Forwards inside may differ in number between ranks (see UnevenForwards). Collective at exit:
        every rank waits there until every rank has left its block."""
        if self.held or self.uneven is not None:
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
        need[[i + 1 for i in indices if i not in g.persistent]] = 1
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
        before = set(g.gathered)
        for b in wanted:
            if b.index in before:
                g.regather(b)
            else:
                g._start(b)
        for b in wanted:
            g._wait(b)
        g.release([b for b in wanted if b.index not in mine and b.index not in before])
