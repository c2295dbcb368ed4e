"""ZeRO-Infinity's disk tier for the optimizer (offload_optimizer.device "nvme"): this rank's fp32 masters and
optimizer states live in one scratch file of its own under nvme_path, and the step streams them through a
bounded pool of host buffers, one sub-group at a time.

The file: per bucket, in bucket order, 1 + S slots of the bucket's shard (its master, then the optimizer's S
per-element states, S found by stepping a copy of the optimizer once on a probe tensor: `states_per_element`),
each slot rounded up to 4096 bytes so that every transfer is O_DIRECT-aligned. A sub-group is a run of
consecutive buckets of at most sub_group_size elements (one bucket when larger), so its slots are one
contiguous range of the file, read and written in one transfer (aio's block_size requests, split into at most
queue_depth runs on thread_count threads; os.preadv/os.pwritev release the GIL).

The pool: `Buffers`, each one sub-group's master, gradient and S states (2 + S buffers of the largest sub-group,
DeepSpeed's counting: Adam's 4). With pipeline_read the next sub-groups are read while one steps (as many as
the pool has slots for), with pipeline_write one is written back while the next steps; buffer_count bounds the
slots. The page cache is kept out by O_DIRECT; a filesystem that refuses it (some network filesystems) is read
through the cache, with posix_fadvise(DONTNEED) after each transfer.

Between steps the masters are empty tensors (their identity is the optimizer's key) and the per-element states
are not in optimizer.state: `bind` points them at a slot's buffers for the step of their sub-group, `unbind`
takes them out again. `resident()` brings everything into host memory at once, for a checkpoint's save or
load. The file is scratch: made at initialize and unlinked at once, so that its blocks are freed when the tier is
collected or the process ends, however it ends; it is never read as a checkpoint.
"""

from __future__ import annotations

import errno
import os  # noqa: F401 - tests patch os.preadv / os.pwritev through this module
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.optim import Optimizer

# the scratch file itself, shared with stage 3's parameter shards on disk (sharding/on_disk.py)
from zerodp.engine.sharding.scratch import DiskTierError, ScratchFile, aligned_bytes
from zerodp.engine.sharding.scratch import round_up as _round

__all__ = ["DiskSettings", "DiskTier", "DiskTierError", "ScratchFile", "aligned_bytes", "states_per_element"]


@dataclass(frozen=True)
class DiskSettings:
    """The config keys the tier honours (docs/CONFIG.md, "Optimizer states on disk")."""

    nvme_path: str
    buffer_count: int  # sub-group-sized buffers the pool may hold
    pipeline_read: bool
    pipeline_write: bool
    fast_init: bool  # reserve the file's blocks only; false: also write every state slot once at initialize
    block_size: int  # aio: bytes per request
    queue_depth: int  # aio: runs of requests of one transfer in flight at once
    thread_count: int  # aio: threads issuing requests
    single_submit: bool  # aio: one system call per request rather than one per run
    timeout_s: float  # comm_timeout_s: a read not done by then is a stalled disk
    pin: bool  # the pool in pinned memory (a device's copies from and to it are asynchronous)

    @classmethod
    def from_config(cls, config, pin: bool) -> DiskSettings:
        off, aio = config.zero_optimization.offload_optimizer, config.aio
        return cls(off.nvme_path, off.buffer_count, off.pipeline_read, off.pipeline_write, off.fast_init,
                   aio.block_size, aio.queue_depth, aio.thread_count, aio.single_submit, config.comm_timeout_s, pin)


def states_per_element(optimizer: Optimizer) -> int:
    """How many per-element state tensors the optimizer keeps per parameter (Adam 2, SGD with momentum 1):
    a copy of it, with each param group's settings (amsgrad adds one), stepped once on a probe tensor."""
    most = 0
    for group in optimizer.param_groups:
        probe = torch.zeros(64)
        try:
            copy = type(optimizer)([probe])
            copy.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
            probe.grad = torch.zeros(64)
            copy.step()
        except Exception as e:  # noqa: BLE001 - the user's class: any failure means we cannot count its states
            raise ValueError(f"offload_optimizer \"nvme\" sizes each rank's file by the per-element states of "
                             f"{type(optimizer).__name__}, counted by stepping a copy of it built as "
                             f"{type(optimizer).__name__}([tensor]); that failed ({type(e).__name__}: {e}); use "
                             "\"cpu\" offload for this optimizer") from e
        most = max(most, sum(1 for v in copy.state[probe].values() if torch.is_tensor(v) and v.shape == probe.shape))
    return most


class Buffers:
    """One sub-group's buffers in the pool: its masters and states (as laid out in the file) and its gradients."""

    def __init__(self, state_bytes: int, grad_bytes: int, pin: bool):
        self.states = aligned_bytes(state_bytes, pin)
        self.grads = aligned_bytes(grad_bytes, pin)
        self.busy: tuple[str, int, list[Future]] | None = None  # ("reading"/"writing", sub-group, its requests)


class DiskTier:
    """The masters and per-element optimizer states of one rank's buckets, on disk (see the module's doc)."""

    def __init__(self, masters: list[torch.Tensor], sub_group_numel: int, rank: int, settings: DiskSettings):
        self.masters = masters  # the optimizer's keys: empty between steps, a slot's views while stepped
        self.numels = [m.numel() for m in masters]
        self.s, self.rank = settings, rank
        self.groups = _sub_groups(self.numels, sub_group_numel)  # bucket indices stepped together, in order
        self.slot_bytes = [_round(4 * n) for n in self.numels]  # one master or state of bucket k in the file
        self.n_states = 0  # S, set by open()
        self.keys: list[str] = []  # the state names in slot order (learned at the first step)
        self.on_disk: list[set[str]] = [set() for _ in masters]  # the states bucket k has written
        self.file: ScratchFile | None = None
        self.slots: list[Buffers] = []
        self.read_ahead = 0  # sub-groups read while one steps (pipeline_read)
        self.sent = False  # the last step copied its masters to the working shards already
        self._resident = 0  # depth of resident() contexts
        self._empty = torch.empty(0)

    # ---- set-up ---------------------------------------------------------------------------------------
    def open(self, optimizer: Optimizer) -> None:
        """Count the optimizer's states, check and reserve the disk, size the pool, write the masters out."""
        self.n_states = states_per_element(optimizer)
        per_group = 2 + self.n_states  # buffers one sub-group in flight takes: master, gradient, states
        fits = self.s.buffer_count // per_group
        need = 1 + self.s.pipeline_read + self.s.pipeline_write
        if fits < need:
            raise ValueError(f"offload_optimizer.buffer_count {self.s.buffer_count} holds {fits} sub-group(s) of "
                             f"{per_group} buffers (master, gradient and {type(optimizer).__name__}'s "
                             f"{self.n_states} per-element states); pipeline_read={self.s.pipeline_read} and "
                             f"pipeline_write={self.s.pipeline_write} need {need}: set buffer_count to at least "
                             f"{need * per_group}")
        self.read_ahead = fits - 1 - self.s.pipeline_write if self.s.pipeline_read else 0
        self.base = [0]
        for b in self.slot_bytes:
            self.base.append(self.base[-1] + (1 + self.n_states) * b)
        self.file = ScratchFile(self.s.nvme_path, self.rank, self.base[-1], self.s)
        spans = [(self.base[g[-1] + 1] - self.base[g[0]], sum(self.slot_bytes[k] for k in g)) for g in self.groups]
        self.slots = [Buffers(max(a for a, _ in spans), max(b for _, b in spans), self.s.pin)
                      for _ in range(1 + self.read_ahead + self.s.pipeline_write)] if spans else []
        with torch.no_grad():
            self._write_out(optimizer, initial=True)

    def _write_out(self, optimizer: Optimizer, initial: bool = False) -> None:
        """Each sub-group's masters (and states held in memory) through the first slot into the file."""
        slot = self.slots[0] if self.slots else None
        for g, ks in enumerate(self.groups):
            for k in ks:
                self._view(slot, g, k, 0).copy_(self.masters[k])
                state = optimizer.state.get(self.masters[k], {})
                for key in self._state_keys(k, state):
                    self._view(slot, g, k, 1 + self.keys.index(key)).copy_(state.pop(key))
                    self.on_disk[k].add(key)
                if initial and not self.s.fast_init:  # every block written once: the disk takes the whole size
                    for j in range(len(self.on_disk[k]) + 1, 1 + self.n_states):
                        self._view(slot, g, k, j).zero_()
                self.masters[k].set_(self._empty)
            if initial and self.s.fast_init and not any(self.on_disk[k] for k in ks):  # the masters alone
                lo = self.base[ks[0]]
                for k in ks:
                    rel = self.base[k] - lo
                    self._finish("writing", g, self.file.transfer(True, self.base[k],
                                                                  slot.states[rel:rel + self.slot_bytes[k]]))
            else:
                self._finish("writing", g, self._transfer(True, g, slot))

    # ---- the step ---------------------------------------------------------------------------------------
    def stream(self, optimizer: Optimizer, grads: list[torch.Tensor], step: Callable[[list[int]], None],
               send: Callable[[int, torch.Tensor], None]) -> None:
        """For each sub-group: read it, bind its masters, gradients and states, `step(buckets)`, `send(k,
        master)` each new master to its working shard, unbind and write it back; pipelined as configured."""
        n, slots = len(self.groups), self.slots
        for g in range(min(1 + self.read_ahead, n)):
            self._start(False, g, slots[g % len(slots)])
        for g, ks in enumerate(self.groups):
            slot = slots[g % len(slots)]
            self._finish(*slot.busy)
            with torch.no_grad():
                self._bind(optimizer, g, slot, grads)
                step(ks)
                for k in ks:
                    send(k, self.masters[k])
                self._unbind(optimizer, g, slot)
            self._start(True, g, slot)
            if not self.s.pipeline_write:
                self._finish(*slot.busy)
            if g + 1 + self.read_ahead < n:
                nxt = slots[(g + 1 + self.read_ahead) % len(slots)]
                if nxt.busy is not None:
                    self._finish(*nxt.busy)
                self._start(False, g + 1 + self.read_ahead, nxt)
        for slot in slots:
            if slot.busy is not None:
                self._finish(*slot.busy)
        self.sent = True

    def _bind(self, optimizer: Optimizer, g: int, slot: Buffers, grads: list[torch.Tensor]) -> None:
        offset = 0
        for k in self.groups[g]:
            m = self.masters[k]
            m.set_(self._view(slot, g, k, 0))
            grad = slot.grads[offset:offset + 4 * self.numels[k]].view(torch.float32)
            offset += self.slot_bytes[k]
            grad.copy_(grads[k])
            m.grad = grad
            state = optimizer.state[m]
            for key in self.on_disk[k]:
                state[key] = self._view(slot, g, k, 1 + self.keys.index(key))

    def _unbind(self, optimizer: Optimizer, g: int, slot: Buffers) -> None:
        for k in self.groups[g]:
            m = self.masters[k]
            state = optimizer.state.get(m, {})
            for key in self._state_keys(k, state):
                view = self._view(slot, g, k, 1 + self.keys.index(key))
                t = state.pop(key)
                if t.data_ptr() != view.data_ptr():  # made by this step (the first): into its slot
                    view.copy_(t)
                self.on_disk[k].add(key)
            m.grad = None
            m.set_(self._empty)

    def _state_keys(self, k: int, state: dict) -> list[str]:
        """The per-element states of bucket k's master in `state`, each given a slot the first time it is seen."""
        keys = [key for key, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
        for key in keys:
            v = state[key]
            if v.shape != (self.numels[k],) or v.dtype != torch.float32:
                raise ValueError(f"optimizer state '{key}' has shape {tuple(v.shape)} and dtype {v.dtype}: the disk "
                                 f"tier holds fp32 states of one value per master element ({self.numels[k]})")
            if key not in self.keys:
                if len(self.keys) == self.n_states:
                    raise ValueError(f"the optimizer keeps more per-element states than the {self.n_states} its probe "
                                     f"step made ({self.keys + [key]}): the disk tier has no slot for '{key}'")
                self.keys.append(key)
        return keys

    def _view(self, slot: Buffers, g: int, k: int, j: int) -> torch.Tensor:
        """Bucket k's slot j (0: master, 1 + i: state keys[i]) in `slot`, which holds sub-group g."""
        start = self.base[k] - self.base[self.groups[g][0]] + j * self.slot_bytes[k]
        return slot.states[start:start + 4 * self.numels[k]].view(torch.float32)

    def _transfer(self, write: bool, g: int, slot: Buffers) -> list[Future]:
        lo, hi = self.base[self.groups[g][0]], self.base[self.groups[g][-1] + 1]
        return self.file.transfer(write, lo, slot.states[:hi - lo])

    def _start(self, write: bool, g: int, slot: Buffers) -> None:
        slot.busy = ("writing" if write else "reading", g, self._transfer(write, g, slot))

    def _finish(self, doing: str, g: int, requests: list[Future]) -> None:
        """Wait for sub-group g's transfer: a read not done within comm_timeout_s, or a failed request, raises
        naming the file, the sub-group and the time."""
        for slot in self.slots:
            if slot.busy is not None and slot.busy[2] is requests:
                slot.busy = None
        done, late = wait(requests, timeout=self.s.timeout_s)
        if late:
            raise DiskTierError(errno.ETIMEDOUT, f"{doing} sub-group {g} of {len(self.groups)} "
                                f"({self.base[self.groups[g][-1] + 1] - self.base[self.groups[g][0]]:,} bytes) of "
                                f"{self.file.path} has not finished after {self.s.timeout_s:g} s (comm_timeout_s): "
                                "the disk under offload_optimizer.nvme_path stalls")
        for r in done:
            e = r.exception()
            if e is not None:
                raise DiskTierError(getattr(e, "errno", None) or errno.EIO,
                                    f"{doing} sub-group {g} of {self.file.path} failed: {e}") from e

    # ---- outside the step ---------------------------------------------------------------------------------
    def master(self, k: int) -> torch.Tensor:
        """Bucket k's master, read from the file into a tensor of its own (resident: the master itself)."""
        if self._resident:
            return self.masters[k]
        g = next(i for i, ks in enumerate(self.groups) if k in ks)
        buf = aligned_bytes(self.slot_bytes[k])
        self._finish("reading", g, self.file.transfer(False, self.base[k], buf))
        return buf[:4 * self.numels[k]].view(torch.float32)

    @contextmanager
    def resident(self, optimizer: Optimizer) -> Iterator[None]:
        """Every master and state in host memory (the whole file's bytes) for the body, written back after it:
        a checkpoint's save or load reads and writes them as tensors."""
        if self._resident:
            self._resident += 1
            try:
                yield
            finally:
                self._resident -= 1
            return
        whole = Buffers(self.base[-1], 0, False)
        self._finish("reading", 0, self.file.transfer(False, 0, whole.states))
        with torch.no_grad():
            for k, m in enumerate(self.masters):
                m.set_(self._view(whole, 0, k, 0))
                for key in self.on_disk[k]:
                    optimizer.state[m][key] = self._view(whole, 0, k, 1 + self.keys.index(key))
        self._resident = 1
        try:
            yield
        finally:
            self._resident = 0
            with torch.no_grad():
                self._write_out(optimizer)

    def bytes(self) -> dict[str, int]:
        """What memory_report shows of the tier: the masters and states (as tensors), the file, the pool."""
        shard = sum(4 * n for n in self.numels)
        return {"fp32_master": shard, "optimizer_states": shard * len(self.keys),
                "nvme_file": self.base[-1] if self.file is not None else 0,
                "nvme_host_buffers": sum(s.states.numel() + s.grads.numel() for s in self.slots)}

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _sub_groups(numels: list[int], limit: int) -> list[list[int]]:
    """Consecutive buckets of at most `limit` elements together (a larger bucket alone)."""
    groups: list[list[int]] = []
    size = 0
    for k, n in enumerate(numels):
        if not groups or size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return groups
