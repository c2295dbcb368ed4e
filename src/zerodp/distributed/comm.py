"""The few collectives zerodp uses, on one process group, with a tally of the bytes each moves.

`Comm` is the single owner of distributed state: the engine holds one and every other module
receives it. How its reduce-scatters and all-gathers are carried out on the backend (natively, or through
an all-reduce) is its `plan`, chosen by measurement at set-up (plan.py, `choose_collectives`).

It also owns the two ways a problem on one rank reaches every rank instead of hanging the others:
`Comm.agree` (every rank reports ok or its error in one small collective, before the collectives that
a local error would leave half-entered) and `Comm.peer_failure` (a collective that timed out because a
peer stalled, died or went elsewhere, named by where each rank waited: on a timeout every rank that waits
in a zerodp collective writes where to the store, so the line says where the others are).

And the bound on every wait: `Comm.bound` makes zerodp's collectives wait at most `comm_timeout_s`
whoever created the process group. A group the script created keeps its own timeout for the script's
own collectives; zerodp's run on a twin of it (the same ranks, `dist.new_group(..., timeout=)`), which
also keeps a collective of the script's from ever pairing with one of zerodp's.
"""

from __future__ import annotations

import itertools
import os
import re
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from zerodp.distributed import plan as collective_plan
from zerodp.distributed import said_once, teardown
from zerodp.distributed.device import backend as device_backend
from zerodp.distributed.device import set_device
from zerodp.distributed.failures import DIVERGENCE, PEER_GRACE_S, Failure, PeerFailure, message, ranks_text
from zerodp.distributed.groups import (
    bounded_group,
    group_timeout_s,
    mpu_groups,
    named_mesh_dp_group,
    names_roles,
    subgroup,
)
from zerodp.distributed.plan import CollectivePlan
from zerodp.distributed.traffic import Done, NoticedWork, Traffic, WatchedWork, Watcher
from zerodp.distributed.waits import WaitNotice


# gloo's own default is 30 minutes: a stalled peer would hold every other rank that long.
DEFAULT_TIMEOUT_S = 600.0


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialise torch.distributed from torchrun's environment, or as a world of one without it.

    timeout_s bounds every collective of the group zerodp creates: a peer that stops responding ends
    the job after it. A group that already exists (the user's own) keeps its own timeout. The group
    zerodp creates is destroyed at exit if the script does not do it (teardown.py says why).
    """
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if backend is None:
        backend = device_backend()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend != "gloo" and backend == device_backend():  # the accelerator's own: one device per rank
            set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    else:
        # No launcher: a world of one needs no rendezvous, so no socket is opened.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    teardown.register(created_default=True)


def init_fake(world_size: int) -> None:
    """Initialise torch.distributed as rank 0 of `world_size` ranks that send nothing (torch's "fake"
    backend): one process plans or measures one rank's share of a larger job. Comm gives its
    collectives the values of a world whose every rank holds this rank's data (see Comm)."""
    # Importing it registers the backend; only a planning or measuring process needs it.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


_BOUNDS = itertools.count()  # bound() calls of this process, numbered alike on every rank: their store keys


class Comm:
    """One data-parallel process group: rank, world size, and the collectives on it.

    In a world of one every collective is a local copy at most, done here without calling
    torch.distributed: the same engine code, no kernel launches or stream waits for nothing.

    On the fake backend (init_fake) every collective is computed here too, as in a world whose every
    rank holds this rank's data: a sum is N x the input, a gather N copies of it. torch's fake group
    leaves outputs unwritten (2.11) or copies a chunk without summing (2.13): a gradient shard or a
    gathered stage-3 bucket would hold whatever the allocator last kept there, on a GPU often nan,
    and every step would be skipped. With these values every number is finite and deterministic: the
    gradients of stages 0-2 are a world of one's; stage 3 gathers rank 0's chunk into every place.
    `is_fake` is the one place the rest of the package asks about it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, mesh=None, name: str = "world",
                 traffic: Traffic | None = None, watchers: list[Watcher] | None = None, mpu=None):
        """mesh: a 2-D DeviceMesh (replicate, shard) whose groups are used for hierarchical
        sharding instead of the ones `split` would build; its ranks must be the whole group's. Or a
        mesh whose dimension names give the roles (MESH_ROLES): then it covers the world, `group`
        must be None, and the data-parallel group is its "dp" dimension (or "dp_replicate" x "dp_shard").
        mpu: Megatron's / DeepSpeed's model-parallel unit instead of a mesh (mpu_groups): its
        data-parallel group is this one, its tensor-parallel group `tp`."""
        tp_group = None
        if mpu is not None:
            group, tp_group = mpu_groups(mpu, group, mesh)
        if names_roles(mesh):
            group = named_mesh_dp_group(mesh, group)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)
        self.name = name
        self.traffic = traffic if traffic is not None else Traffic()
        # Called around each of the four collectives (comms_logger, monitor/comms.py); shared with
        # the shard and replica groups, like the traffic tally. Empty: nothing is called.
        self.watchers: list[Watcher] = watchers if watchers is not None else []
        # How reduce_scatter and all_gather are carried out (plan.py): native until choose_collectives
        self.plan = CollectivePlan(self.backend)
        self.last_op = "collective"  # the kind issued last: names a timed-out collective (peer_failure)
        # comm_timeout_s when the config gives it (bound): every zerodp collective waits at most this long;
        # None: the groups' own timeouts
        self.timeout_s: float | None = None
        self._bound_tag = ""  # this engine's keys in the store, where a timed-out rank says where it waits
        self.notice: WaitNotice | None = None  # says a wait longer than wait_notice_s (notify_waits); None: silent
        self.shard: Comm = self            # where model states are partitioned
        self.replica: Comm | None = None   # the ranks holding the same shard (None: flat)
        self.mesh = mesh
        # Tensor parallelism (a mesh with a "tp" dimension): the tp group, and the whole world of
        # dp x tp ranks, where the step's decisions (norm, skip, used bits) and set-up agreements are
        # made. Without tp, `everyone` is this group itself.
        self.tp: Comm | None = None
        self.tp_mesh = None
        self.everyone: Comm = self
        if mesh is not None:
            self._adopt(mesh)
        if tp_group is not None:
            self._tensor_parallel(tp_group)
        teardown.register(self)  # at exit, the group goes while its gloo threads can still finish

    def release_groups(self) -> None:
        """Drop this Comm's references to its process group and mesh: called at the process's exit
        (teardown.release_at_exit), after which it runs no collective."""
        self.group = None
        self.mesh = None

    def is_fake(self, value: torch.Tensor | None = None) -> bool:
        """Whether this group is the fake backend's (init_fake: one process stands for rank 0 of N, so
        there is no peer to agree with); given `value`, whether it is also a fake tensor, a shape with
        no data that the host cannot read (plan/peak.py runs a step on them, always on this backend)."""
        if self.backend != "fake":
            return False
        return value is None or torch._subclasses.fake_tensor.is_fake(value)

    # ---- hierarchical sharding ------------------------------------------------------------------
    @property
    def shard_rank(self) -> int:
        """Which shard of every bucket this rank owns."""
        return self.shard.rank

    @property
    def shard_size(self) -> int:
        """Partitions of every bucket: S (N when flat)."""
        return self.shard.world_size

    @property
    def replica_rank(self) -> int:
        """Which copy of its shard this rank holds (0 when flat)."""
        return 0 if self.replica is None else self.replica.rank

    def split(self, shard_size: int) -> None:
        """Collective (every rank, the same S, already validated): shard groups of S consecutive
        ranks, replica groups of the ranks with the same place in theirs. S = N stays flat."""
        if self.mesh is not None or shard_size == self.world_size:
            return
        ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        shard = [ranks[i:i + shard_size] for i in range(0, self.world_size, shard_size)]
        replica = [ranks[j::shard_size] for j in range(shard_size)]
        # torch's own default for a new group is 30 minutes on gloo, whatever the world's timeout
        timeout = timedelta(seconds=self.timeout_s or group_timeout_s(self.group) or DEFAULT_TIMEOUT_S)
        self._use(subgroup(shard, timeout), subgroup(replica, timeout))
        self.shard.timeout_s = self.replica.timeout_s = self.timeout_s
        self.shard._bound_tag = self.replica._bound_tag = self._bound_tag

    def bound(self, timeout_s: float | None) -> list[str]:
        """Collective over this Comm's groups' ranks (after the set-up agreement, so every rank has the
        same config): from now on every collective of zerodp's waits at most `timeout_s` (the config's
        comm_timeout_s, given explicitly; None keeps the groups' own timeouts). Returns, for the groups
        torch cannot bound, one sentence each for initialize to print."""
        comms = {id(c): c for c in (self, self.shard, self.replica, self.tp, self.everyone) if c}.values()
        tag = f"zerodp/waiting/{next(_BOUNDS)}"
        for comm in comms:
            comm._bound_tag = tag
        if timeout_s is None or self.world_size == 1 and self.everyone is self or self.is_fake():
            return []
        unbound = []
        for comm in comms:
            comm.group, reason = bounded_group(comm.group, timeout_s)
            comm.timeout_s = timeout_s
            if reason is not None:
                unbound.append(f"the {comm.name} group ({comm.backend}): {reason}")
        return unbound

    def notify_waits(self, notice_s: float) -> None:
        """(set-up, every rank alike) From now on a collective of this Comm's groups that keeps this rank waiting
        over `notice_s` says so in one line, again at doubling intervals (waits.py). Not in a world of one."""
        if self.everyone.world_size == 1 or self.is_fake():
            return
        comms = [c for c in (self, self.shard, self.replica, self.tp, self.everyone) if c]
        ranks = sorted({dist.get_global_rank(c.group, r) for c in comms for r in range(c.world_size)})
        notice = WaitNotice(notice_s, dist.get_rank(), ranks, f"{self._bound_tag or 'zerodp/waiting'}/notice")
        for comm in comms:
            comm.notice = notice

    def choose_collectives(self, choice: str, sharded_numel: int) -> CollectivePlan:
        """Collective (every rank, after split; a probe on gloo): how this Comm's shard group runs its
        reduce-scatters and all-gathers of the `sharded_numel` elements' buckets from now on, the config's
        `collectives` (plan.py). Returns the plan."""
        chosen = collective_plan.decide(self, choice, sharded_numel)
        self.plan = self.shard.plan = chosen
        return chosen

    def _adopt(self, mesh) -> None:
        names = mesh.mesh_dim_names
        if not names_roles(mesh):
            if mesh.ndim != 2 or mesh.size() != self.world_size:
                raise ValueError(f"the device mesh must be 2-D (replicate, shard) over all {self.world_size} "
                                 f"ranks of the data-parallel group, got shape {tuple(mesh.shape)}")
            self._use(mesh.get_group(1), mesh.get_group(0))
            return
        if "dp_shard" in names and "dp_replicate" in names:
            self._use(mesh.get_group("dp_shard"), mesh.get_group("dp_replicate"))
        if "tp" in names:
            self.tp_mesh = mesh["tp"]
            self._tensor_parallel(mesh.get_group("tp"))

    def _tensor_parallel(self, tp_group: dist.ProcessGroup) -> None:
        self.tp = Comm(tp_group, name="tp", traffic=self.traffic, watchers=self.watchers)
        self.everyone = Comm(dist.group.WORLD, name="dp x tp", traffic=self.traffic, watchers=self.watchers)

    def _use(self, shard: dist.ProcessGroup, replica: dist.ProcessGroup) -> None:
        self.shard = Comm(shard, name="shard", traffic=self.traffic, watchers=self.watchers)
        self.replica = Comm(replica, name="replica", traffic=self.traffic, watchers=self.watchers)

    def shard_reduce(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Sum `inp` over every rank and keep this rank's shard-group chunk in `out`: reduce_scatter
        inside the shard group, then all_reduce of the chunk across the replica group."""
        work = self.shard.reduce_scatter(out, inp, async_op=async_op)
        if self.replica is None:
            return work
        if work is not None:
            work.wait()  # NCCL: the current stream waits, not the host; gloo: it is done
        return self.replica.all_reduce(out, async_op=async_op)

    def shard_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Every rank of the shard group's chunk `inp` concatenated into `out`."""
        return self.shard.all_gather(out, inp, async_op=async_op)

    def agree(self, error: BaseException | None, what: str, payload=None,
              raise_for: Callable[[list[Failure]], BaseException] | None = None) -> list:
        """Collective: every rank reports ok or its error (and a payload); returns the payloads.

        If any rank failed, every rank raises: the failing rank its own exception, the others
        `Failure.exception` (the same class, naming the rank and its message), or whatever
        `raise_for(failures)` builds. Call it after the local work that may fail and before the
        collectives it guards, so a rank that failed never leaves the others waiting.
        """
        if self.everyone is not self:  # a tensor-parallel peer's error must reach this dp group too
            return self.everyone.agree(error, what, payload, raise_for)
        report = None if error is None else (f"{type(error).__module__}:{type(error).__qualname__}",
                                              message(error))
        if self.world_size == 1 or self.is_fake():
            results = [(report, payload)]
        else:
            results = [None] * self.world_size
            self.last_op = "all_gather_object"  # what a PeerFailure names if a peer never joins it
            dist.all_gather_object(results, (report, payload), group=self.group)
        failures = [Failure(r, *rep) for r, (rep, _) in enumerate(results) if rep is not None]
        if failures:
            raised = (raise_for(failures) if raise_for is not None else error if error is not None
                      else failures[0].exception(what))
            # Raised on every rank: rank 0 says it once, at the top, if it ends the process (said_once.py);
            # a rank whose own error is not rank 0's keeps its traceback.
            same_as_rank0 = failures[0].rank == 0 and report is not None and report[1] == failures[0].message
            said_once.mark(raised, self.rank, self.world_size, quiet=error is None or same_as_rank0)
            raise raised
        return [p for _, p in results]

    @contextmanager
    def names_peer_failure(self, where: str, op: str | None = None, divergence: str = DIVERGENCE):
        """Within the block, a collective that timed out or lost its peer raises PeerFailure naming
        `where` (gloo's own error names no zerodp collective). Free unless something raises."""
        notice, before = self.notice, self.notice.where if self.notice is not None else ""
        if notice is not None:
            notice.where = where
        try:
            yield
        except RuntimeError as e:
            failure = self.peer_failure(e, where, op, divergence)
            if failure is None:
                raise
            if failure is e:
                raise
            raise failure from e
        finally:
            if notice is not None:
                notice.where = before

    def peer_failure(self, e: BaseException, where: str, op: str | None = None,
                     divergence: str = DIVERGENCE) -> PeerFailure | None:
        """The error to raise instead of `e` when `e` says a peer stalled, died or went elsewhere; None
        otherwise (and `e` itself when it is one already: the innermost place names it best).

        gloo says only "Timed out waiting 10000ms for recv" or "Connection closed by peer": this adds
        which zerodp collective (`where`, and the kind issued last), where the other ranks wait, and
        what a divergence looks like here (`divergence`).
        """
        if isinstance(e, PeerFailure):
            return e
        text, op = message(e), op or self.last_op
        low = text.lower()
        if "timed out" in low or "timeout" in low:
            peers = self._whereabouts(f"{op} {where}")
            return PeerFailure(f"{op} {where} timed out after {self._timeout_s(text)}: a peer rank stopped "
                               f"responding (stalled or dead) or went elsewhere: {peers}; {divergence}; the limit "
                               "is the config key 'comm_timeout_s' (--timeout in zerodp train)")
        if any(k in low for k in ("connection closed", "connection reset", "broken pipe")):
            # A peer that timed out first closes its connections after writing its place: read it (the
            # later rank of two in mismatched collectives may see the closed connection, not its own timeout).
            peers = self._whereabouts(f"{op} {where}")
            return PeerFailure(f"{op} {where} failed: a peer rank died, or closed its connection after a timeout of "
                               f"its own ({text.splitlines()[0]}): {peers}; {divergence}")
        return None

    def _whereabouts(self, here: str) -> str:
        """After a timeout: this rank's place written to the store, and where the group's other ranks are,
        read from it. A rank that waits in a zerodp collective times out near the same moment and writes
        its own; one that wrote nothing within PEER_GRACE_S is in none (stalled, dead, or in code of its
        own). Ranks in the same place are named together."""
        try:
            store = dist.distributed_c10d._get_default_store()
            ranks = dist.get_process_group_ranks(self.group)
            prefix = f"{self._bound_tag or 'zerodp/waiting'}/{self.group.group_name}/"
            store.set(prefix + str(ranks[self.rank]), here)
        except Exception:  # noqa: BLE001 - no store to ask: the timeout alone is what is known
            return f"rank {self.rank} waited there; where the others are is unknown"
        keys = {r: prefix + str(g) for r, g in enumerate(ranks) if r != self.rank}
        try:  # returns as soon as every rank has written
            store.wait(list(keys.values()), timedelta(seconds=min(PEER_GRACE_S, self.timeout_s or PEER_GRACE_S)))
        except Exception:  # noqa: BLE001 - the store's timeout: some rank wrote nothing
            pass
        places: dict[str, list[int]] = {}
        for r, key in keys.items():
            try:
                there = store.get(key).decode() if store.check([key]) else None
            except Exception:  # noqa: BLE001
                there = None
            places.setdefault("there too" if there == here else f"in {there}" if there else "", []).append(r)
        clauses = [f"{ranks_text(rs)} {'is' if len(rs) == 1 else 'are'} in no zerodp collective (stalled, dead, or "
                   "running code of its own: fewer forwards, a dist.barrier(), its own work)" if not place else
                   f"{ranks_text(rs)} wait{'s' if len(rs) == 1 else ''} {place}" for place, rs in places.items()]
        return ", ".join([f"rank {self.rank} waited there", *clauses])

    def _timeout_s(self, text: str) -> str:
        try:
            seconds = self.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - private API: read the milliseconds gloo printed instead
            ms = re.search(r"(\d+)\s*ms", text)
            return f"{int(ms.group(1)) / 1000:g} s" if ms else "the process group's timeout"
        return f"{seconds:g} s"

    def _ring(self, nbytes: int) -> float:
        return nbytes * (self.world_size - 1) / self.world_size

    def all_reduce(self, t: torch.Tensor, async_op: bool = False):
        return self._watched("all_reduce", (t,), lambda: self._all_reduce(t, async_op))

    def _all_reduce(self, t: torch.Tensor, async_op: bool = False):
        self.last_op = "all_reduce"
        self.traffic.add("all_reduce", 2 * self._ring(t.numel() * t.element_size()), self.name)
        if self.world_size == 1:
            return Done() if async_op else None
        if self.is_fake():
            t.mul_(self.world_size)
            return Done() if async_op else None
        return dist.all_reduce(t, group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Sum `inp` over ranks and keep this rank's 1/N chunk in `out` (which may alias it)."""
        return self._watched("reduce_scatter", (out, inp), lambda: self._reduce_scatter(out, inp, async_op))

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        self.last_op = "reduce_scatter"
        impl = self.plan.implementation("reduce_scatter", inp.numel())
        # tallied as the collective asked for, with the bytes its implementation moves (an all-reduce's: 2x)
        moved = (2 if impl == "all_reduce" else 1) * self._ring(inp.numel() * inp.element_size())
        self.traffic.add("reduce_scatter", moved, self.name)
        if self.world_size == 1:
            return self._local_copy(out, inp, async_op)
        if self.is_fake():  # out may be this rank's chunk of inp itself: mul with out= allows that
            torch.mul(inp.view(self.world_size, -1)[self.rank], self.world_size, out=out)
            return Done() if async_op else None
        return collective_plan.reduce_scatter(impl, self.group, out, inp, self.rank, self.world_size, async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's `inp` into `out` (`inp` may be this rank's chunk of `out`)."""
        return self._watched("all_gather", (out, inp), lambda: self._all_gather(out, inp, async_op))

    def all_gather_tags(self, tag: torch.Tensor) -> torch.Tensor:
        """Every rank's small `tag`, stacked (world, n): a control exchange beside the model's traffic (what each
        stage-3 gather is for, sharding/whereabouts.py), neither in the byte tally nor in comms_logger's records."""
        out = tag.new_empty((self.world_size, tag.numel()))
        if self.world_size == 1 or self.is_fake():
            out[:] = tag
            return out
        self.last_op = "all_gather"
        with self.notice.waiting("all_gather") if self.notice is not None else nullcontext():  # a wait speaks
            collective_plan.all_gather("native", self.group, out.view(-1), tag, self.rank, self.world_size, False)
        return out

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        self.last_op = "all_gather"
        impl = self.plan.implementation("all_gather", out.numel())
        moved = (2 if impl == "all_reduce" else 1) * self._ring(out.numel() * out.element_size())
        self.traffic.add("all_gather", moved, self.name)
        if self.world_size == 1:
            return self._local_copy(out, inp, async_op)
        if self.is_fake():
            self._fake_gather(out, inp)
            return Done() if async_op else None
        return collective_plan.all_gather(impl, self.group, out, inp, self.rank, self.world_size, async_op)

    def _watched(self, op: str, tensors: tuple[torch.Tensor, ...], call: Callable):
        """call(), with every watcher told of it: op and the larger tensor's bytes, then, when it
        completes (at its handle's wait() for an async one), the watcher's `done`."""
        notice, call = self.notice, self.traffic.clocked(call)  # (wall_clock_breakdown: exposed communication)
        if notice is None:
            return self._told(op, tensors, call)
        with notice.waiting(op):  # the host's time blocked in it, for the wait notice (waits.py)
            work = self._told(op, tensors, call)
        return work if work is None else NoticedWork(work, notice, op)

    def _told(self, op: str, tensors: tuple[torch.Tensor, ...], call: Callable):
        if not self.watchers:
            return call()
        nbytes = max(t.numel() * t.element_size() for t in tensors)
        dones = [watch(op, nbytes) for watch in self.watchers]
        work = call()
        if work is None:
            for done in dones:
                done()
            return None
        return WatchedWork(work, dones)

    def _fake_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every chunk of `out` a copy of `inp`, which may be this rank's chunk of `out` already (two
        copies from it, on each side, rather than one from a source that overlaps the destination)."""
        chunks, r = out.view(self.world_size, -1), self.rank
        self._local_copy(chunks[r], inp, False)
        mine = chunks[r:r + 1]
        chunks[:r].copy_(mine.expand(r, -1))
        chunks[r + 1:].copy_(mine.expand(self.world_size - r - 1, -1))

    @staticmethod
    def _local_copy(out: torch.Tensor, inp: torch.Tensor, async_op: bool):
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return Done() if async_op else None

    def broadcast(self, t: torch.Tensor, src_rank: int = 0) -> None:
        self._watched("broadcast", (t,), lambda: self._broadcast(t, src_rank))

    def _broadcast(self, t: torch.Tensor, src_rank: int = 0):
        if self.world_size == 1:
            return
        self.last_op = "broadcast"
        self.traffic.add("broadcast", t.numel() * t.element_size())
        dist.broadcast(t, dist.get_global_rank(self.group, src_rank), group=self.group)

    def all_gather_object(self, obj) -> list:
        """Small control messages (fingerprints, flags); not counted as training traffic."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


