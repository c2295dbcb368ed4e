"""The few collectives zerodp uses, on one process group, with a tally of the bytes each moves.

`Comm` is the single owner of distributed state: the engine holds one and every other module
receives it. It also hides a torch rename: torch >= 2.13 calls the flat collectives
`all_gather_single` / `reduce_scatter_single` and warns on the old names, which are all that
torch 2.11 has.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_distributed(backend: str | None = None) -> None:
    """Initialise torch.distributed from torchrun's environment, or as a world of one without it."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    else:
        # No launcher: a world of one needs no rendezvous, so no socket is opened.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@dataclass
class Traffic:
    """Bytes each rank sends per collective kind, counted as a ring algorithm moves them."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def add(self, op: str, nbytes: float) -> None:
        self.bytes[op] += int(nbytes)
        self.calls[op] += 1

    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


class _Done:
    """The work handle of a collective that had nothing to do (a world of one)."""

    def wait(self) -> bool:
        return True


class Comm:
    """One data-parallel process group: rank, world size, and the collectives on it.

    In a world of one every collective is a local copy at most, done here without calling
    torch.distributed: the same engine code, no kernel launches or stream waits for nothing.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)
        self.traffic = Traffic()

    def _ring(self, nbytes: int) -> float:
        return nbytes * (self.world_size - 1) / self.world_size

    def all_reduce(self, t: torch.Tensor, async_op: bool = False):
        self.traffic.add("all_reduce", 2 * self._ring(t.numel() * t.element_size()))
        if self.world_size == 1:
            return _Done() if async_op else None
        return dist.all_reduce(t, group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Sum `inp` over ranks and keep this rank's 1/N chunk in `out` (which may alias it)."""
        self.traffic.add("reduce_scatter", self._ring(inp.numel() * inp.element_size()))
        if self.world_size == 1:
            return self._local_copy(out, inp, async_op)
        return _reduce_scatter_single(out, inp, group=self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's `inp` into `out` (`inp` may be this rank's chunk of `out`)."""
        self.traffic.add("all_gather", self._ring(out.numel() * out.element_size()))
        if self.world_size == 1:
            return self._local_copy(out, inp, async_op)
        return _all_gather_single(out, inp, group=self.group, async_op=async_op)

    @staticmethod
    def _local_copy(out: torch.Tensor, inp: torch.Tensor, async_op: bool):
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return _Done() if async_op else None

    def broadcast(self, t: torch.Tensor, src_rank: int = 0) -> None:
        if self.world_size == 1:
            return
        self.traffic.add("broadcast", t.numel() * t.element_size())
        dist.broadcast(t, dist.get_global_rank(self.group, src_rank), group=self.group)

    def all_gather_object(self, obj) -> list:
        """Small control messages (fingerprints, flags); not counted as training traffic."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
