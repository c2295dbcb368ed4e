"""ZeRO-Infinity's disk tier for stage 3's parameters (offload_param "nvme"): this rank's shard of each gathered
bucket (trained and frozen) lives in a scratch file of its own under nvme_path (scratch.py), and reaches host
memory only to be gathered, updated by the step, or saved.

Where each shard lives, decided once at set-up (`ShardsOnDisk`):
  kept      the first buckets, in bucket order, whose shards fit in max_in_cpu elements: a host tensor of
            their own, for good (offload_param "cpu"'s place), never in the file.
  on disk   the rest: one slot each in the file, in bucket order, rounded up to 4096 bytes; between uses
            `b.owned` is an empty tensor (its dtype kept), so a stray read fails instead of reading stale values.

The host buffers: buffer_count buffers of the largest shard on disk (buffer_size elements is their bound: a
larger shard is refused at initialize, naming the size to set). A buffer holds one shard that is
  read ahead   `ahead(buckets)`: the Gatherer names the buckets its next gathers need, in the order it already
               knows (the first forward's, walked forward in a forward and back in a backward; after a step
               the next forward's first); the first buffer_count - 1 of those on disk are read while the
               current unit computes.
  in use       `reading(b)`: a gather's copy of b's shard into its place in the gathered bucket (the read
               ahead waited for, or read at once); `updating(b)`: b.owned points at the buffer while the
               step (or a gathered_parameters write) writes it,
  written      then the buffer is written back in flight, and reused once the write is done; `flush()` (at
               the end of the step) waits for every write, so no read passes a write.
`resident()` puts every shard in host memory at once (read in, written back after), for a checkpoint's save or
load. The file is scratch: made at initialize, its name removed at once (scratch.ScratchFile), never a
checkpoint.
"""

from __future__ import annotations

import errno
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from zerodp.engine.layout.flat import Bucket
from zerodp.engine.sharding.scratch import DiskTierError, ScratchFile, aligned_bytes, round_up

_KEY = "offload_param.nvme_path"


@dataclass(frozen=True)
class ParamDiskSettings:
    """The offload_param and aio keys the tier honours (docs/CONFIG.md, "Parameters on disk")."""

    nvme_path: str
    buffer_count: int  # shard buffers in host memory: one in use, the rest read ahead or being written
    buffer_size: int  # elements: the largest shard on disk a buffer may be sized for
    max_in_cpu: int  # elements of shards kept in host memory for good (the first buckets')
    block_size: int  # aio: bytes per request
    queue_depth: int  # aio: runs of requests of one transfer in flight at once
    thread_count: int  # aio: threads issuing requests
    single_submit: bool  # aio: one system call per request rather than one per run
    timeout_s: float  # comm_timeout_s: a read not done by then is a stalled disk
    pin: bool  # the buffers and kept shards in pinned memory (a device's copies from them are asynchronous)

    @classmethod
    def from_config(cls, config, pin: bool) -> ParamDiskSettings:
        off, aio = config.zero_optimization.offload_param, config.aio
        return cls(off.nvme_path, off.buffer_count, off.buffer_size, off.max_in_cpu, aio.block_size,
                   aio.queue_depth, aio.thread_count, aio.single_submit, config.comm_timeout_s, pin)


class ShardsOnDisk:
    """This rank's parameter shards of stage 3's gathered buckets, in a file of its own (the module's doc)."""

    def __init__(self, shards: list[tuple[Bucket, torch.dtype]], rank: int, settings: ParamDiskSettings,
                 units: dict[int, str]):
        """shards: each gathered bucket with its working dtype (set-up calls this before the buckets have
        tensors); units: bucket index -> the units that read it."""
        self.s = settings
        self.units = units  # bucket index -> the units that read it, for a stalled read's message
        self.kept: set[int] = set()  # buckets whose shards stay in host memory (max_in_cpu)
        self.offset: dict[int, int] = {}  # bucket index -> its slot's place in the file
        self.slot: dict[int, int] = {}  # bucket index -> its slot's bytes (rounded up to 4096)
        self.numel: dict[int, int] = {}  # bucket index -> its shard's elements
        self.dtype = {b.index: dtype for b, dtype in shards}  # bucket index -> the dtype of its shard
        left, end = settings.max_in_cpu, 0
        for b, dtype in shards:
            if b.shard_numel <= left:
                self.kept.add(b.index)
                left -= b.shard_numel
                continue
            self.offset[b.index], self.numel[b.index] = end, b.shard_numel
            self.slot[b.index] = round_up(b.shard_numel * dtype.itemsize)
            end += self.slot[b.index]
        self._check_buffers()
        self.file = ScratchFile(settings.nvme_path, rank, end, settings, key=_KEY, holds="parameter shards",
                                suffix=".params") if self.offset else None
        size = max(self.slot.values(), default=0)
        self.buffers = [aligned_bytes(size, settings.pin) for _ in range(settings.buffer_count)] if size else []
        self.free: list[int] = list(range(len(self.buffers)))  # buffers holding nothing
        self.reads: dict[int, tuple[int, list[Future]]] = {}  # bucket index -> (buffer, requests): read ahead
        self.writes: list[tuple[int, int, list[Future]]] = []  # (buffer, bucket index, requests), oldest first
        self.resident_depth = 0  # resident() contexts open: every shard is a host tensor of its own
        # the first write that failed since the last flush(), which raises it: a rank whose write fails while
        # the step still writes must reach the step's agreement as the others do, not leave it early
        self.write_error: DiskTierError | None = None
        self.keep_bytes = 0  # the kept shards' bytes (host memory)

    def _check_buffers(self) -> None:
        largest = max(self.numel.values(), default=0)
        if largest > self.s.buffer_size:
            k = max(self.numel, key=self.numel.get)
            raise ValueError(f"offload_param.buffer_size {self.s.buffer_size:,} elements is smaller than this rank's "
                             f"shard of bucket {k} ({largest:,} elements, {self.units.get(k, '')}), which a buffer "
                             f"holds whole: set buffer_size to at least {largest:,}, or make stage 3's buckets "
                             "smaller (stage3_prefetch_bucket_size, smaller units: stage3_unit)")

    # ---- set-up -------------------------------------------------------------------------------------
    def put(self, b: Bucket, values: torch.Tensor) -> None:
        """(set-up, FlatGroup.allocate) b's shard takes `values`: a host tensor of its own if kept, else its
        slot in the file (through a buffer, written at once); b.owned is then an empty tensor of its dtype."""
        if b.index in self.kept:
            b.owned = torch.empty(b.shard_numel, dtype=self.dtype[b.index], pin_memory=self.s.pin).copy_(values)
            self.keep_bytes += b.owned.numel() * b.owned.element_size()
            return
        buf = self._take()
        self._view(buf, b).copy_(values)
        self._wait(self._transfer(True, buf, b.index), "writing", b.index)
        self.free.append(buf)

    # ---- the gathers --------------------------------------------------------------------------------
    def ahead(self, wanted: Iterable[Bucket]) -> None:
        """The next gathers need `wanted`, in order: the first buffer_count - 1 of them on disk are read (or
        stay read); reads ahead of any other bucket are let go."""
        if self.resident_depth or len(self.buffers) < 2:
            return
        want: list[int] = []
        for b in wanted:
            if b.index in self.offset:
                want.append(b.index)
                if len(want) == len(self.buffers) - 1:
                    break
        for k in [k for k in self.reads if k not in want]:
            self._drop(k)
        for k in want:
            if k not in self.reads:
                self._finish_writes(k)
                buf = self._take()
                self.reads[k] = (buf, self._transfer(False, buf, k))

    @contextmanager
    def reading(self, b: Bucket) -> Iterator[torch.Tensor]:
        """b's shard in host memory for the body: b.owned where it is a host tensor, else a buffer (its read
        ahead waited for, or read now), given back after."""
        if b.index not in self.offset or self.resident_depth:
            yield b.owned
            return
        if b.index in self.reads:
            buf, requests = self.reads.pop(b.index)
        else:
            self._finish_writes(b.index)
            buf = self._take()
            requests = self._transfer(False, buf, b.index)
        try:
            self._wait(requests, "reading", b.index)
            yield self._view(buf, b)
        finally:
            self.free.append(buf)

    @contextmanager
    def updating(self, b: Bucket, read: bool = False) -> Iterator[None]:
        """b.owned is b's shard in host memory for the body, which writes it (all of it; with `read`, parts:
        the old values are read first); then written back, in flight until the buffer is needed or flush()."""
        if b.index not in self.offset or self.resident_depth:
            yield
            return
        self._drop(b.index)  # a read ahead holds the old values
        self._finish_writes(b.index)
        buf = self._take()
        empty = b.owned
        try:
            if read:
                self._wait(self._transfer(False, buf, b.index), "reading", b.index)
            b.owned = self._view(buf, b)
            yield
        except BaseException:
            self.free.append(buf)  # half written: the file keeps the old values
            raise
        finally:
            b.owned = empty
        self.writes.append((buf, b.index, self._transfer(True, buf, b.index)))

    def flush(self) -> None:
        """Every write in flight done (the end of a step): a failed one (since the last flush) raises, naming
        the file and bucket."""
        self._finish_writes(None)
        error, self.write_error = self.write_error, None
        if error is not None:
            raise error

    # ---- checkpoints --------------------------------------------------------------------------------
    @contextmanager
    def resident(self, buckets: list[Bucket]) -> Iterator[None]:
        """Every shard on disk in host memory, as b.owned, for the body (the whole file's bytes at once), and
        written back after it: a checkpoint's save or load reads and writes them as tensors."""
        if self.resident_depth or self.file is None:
            self.resident_depth += 1
            try:
                yield
            finally:
                self.resident_depth -= 1
            return
        self.flush()
        for k in list(self.reads):
            self._drop(k)
        whole = aligned_bytes(self.file.nbytes)
        self._wait(self.file.transfer(False, 0, whole), "reading", None)
        empties = {b.index: b.owned for b in buckets if b.index in self.offset}
        for b in buckets:
            if b.index in self.offset:
                start = self.offset[b.index]
                b.owned = whole[start:start + self.slot[b.index]].view(self.dtype[b.index])[:b.shard_numel]
        self.resident_depth = 1
        try:
            yield
        finally:
            self.resident_depth = 0
            for b in buckets:
                if b.index in empties:
                    b.owned = empties[b.index]
            self._wait(self.file.transfer(True, 0, whole), "writing", None)

    # ---- the buffers and the file -------------------------------------------------------------------
    def _view(self, buf: int, b: Bucket) -> torch.Tensor:
        return self.buffers[buf][:self.slot[b.index]].view(self.dtype[b.index])[:b.shard_numel]

    def _transfer(self, write: bool, buf: int, k: int) -> list[Future]:
        return self.file.transfer(write, self.offset[k], self.buffers[buf][:self.slot[k]])

    def _take(self) -> int:
        """A free buffer: the oldest write finished for one, else a read ahead let go (the farthest)."""
        if not self.free and self.writes:
            self._finish_write(0)
        if not self.free and self.reads:
            self._drop(next(reversed(self.reads)))
        if not self.free:
            raise RuntimeError("offload_param \"nvme\": every host buffer is in use at once; this is a bug in "
                               "zerodp (a buffer was not given back)")
        return self.free.pop()

    def _drop(self, k: int) -> None:
        """Let go of bucket k's read ahead (a read in flight is waited for: its buffer is written into)."""
        entry = self.reads.pop(k, None)
        if entry is not None:
            wait(entry[1], timeout=self.s.timeout_s)
            self.free.append(entry[0])

    def _finish_writes(self, k: int | None) -> None:
        """Wait for the writes in flight of bucket k (None: all of them)."""
        for i in reversed([i for i, w in enumerate(self.writes) if k is None or w[1] == k]):
            self._finish_write(i)

    def _finish_write(self, i: int) -> None:
        buf, k, requests = self.writes.pop(i)
        try:
            self._wait(requests, "writing", k)
        except DiskTierError as e:  # raised by flush()
            self.write_error = self.write_error or e
        finally:
            self.free.append(buf)

    def _wait(self, requests: list[Future], doing: str, k: int | None) -> None:
        """A transfer not done within comm_timeout_s, or a failed request, raises naming the file, the
        bucket and its units, and the time."""
        done, late = wait(requests, timeout=self.s.timeout_s)
        what = (f"the parameter shard of bucket {k} ({self.units.get(k, 'no unit')}, {self.slot[k]:,} bytes)"
                if k is not None else f"the parameter shards ({self.file.nbytes:,} bytes)")
        if late:
            raise DiskTierError(errno.ETIMEDOUT, f"{doing} {what} of {self.file.path} has not finished after "
                                f"{self.s.timeout_s:g} s (comm_timeout_s): the disk under {_KEY} stalls")
        for r in done:
            e = r.exception()
            if e is not None:
                raise DiskTierError(getattr(e, "errno", None) or errno.EIO,
                                    f"{doing} {what} of {self.file.path} failed: {e}") from e

    def bytes(self) -> dict[str, int]:
        """What memory_report shows of the tier: the shards in the file and kept in host memory, the file's
        bytes (slots rounded to 4096) and the host buffers."""
        return {"params_on_disk": sum(n * self.dtype[k].itemsize for k, n in self.numel.items()),
                "params_in_cpu": self.keep_bytes,
                "nvme_param_file": self.file.nbytes if self.file is not None else 0,
                "nvme_param_buffers": sum(b.numel() for b in self.buffers)}

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
