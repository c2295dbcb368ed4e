"""Floating buffers (BatchNorm running statistics) kept equal across ranks, as DDP's broadcast_buffers.

Each rank normalises its own data, so a training forward moves each rank's running statistics its
own way. Before a forward that follows one that may have changed them (in training mode or with
grad enabled; DDP's rule is grad enabled), every floating buffer takes rank 0's value: one flat
broadcast per dtype, into buffers made once at initialise time. Buffers are read from the module at
each sync, as DDP does, so one the module reassigns is still synced. Repeated forwards in eval mode
under no_grad broadcast nothing after the first: they do not change the buffers. Between the last
training forward and the next forward each rank holds its own update, as under DDP.
Such a forward is therefore collective, as DDP's is: to run the model on one rank only (an
evaluation on rank 0), call engine.module(...) there, which syncs nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.distributed.comm import Comm


class BufferSync:
    def __init__(self, module: nn.Module, comm: Comm):
        self.module, self.comm = module, comm
        self.flats: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        for key, bufs in self._groups().items():
            self._flat(key, sum(b.numel() for b in bufs))
        self.due = True  # as DDP: the first forward syncs too (buffers may be set after initialize)

    @staticmethod
    def wanted(module: nn.Module, comm: Comm, enabled: bool) -> bool:
        """Only with ranks to agree and floating buffers to agree on."""
        return enabled and comm.world_size > 1 and any(b.is_floating_point() for b in module.buffers())

    def before_forward(self) -> None:
        if self.due:
            self._broadcast()
        self.due = self.module.training or torch.is_grad_enabled()

    def _groups(self) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in self.module.buffers():
            if b.is_floating_point():
                groups.setdefault((b.dtype, b.device), []).append(b)
        return groups

    def _broadcast(self) -> None:
        groups = self._groups()
        src = self.comm.rank == 0
        # The in-place copy must not invalidate a graph that saved a buffer (DDP does the same).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(
                tuple(b for bufs in groups.values() for b in bufs)):
            for key, bufs in groups.items():
                flat = self._flat(key, sum(b.numel() for b in bufs))
                if src:
                    torch.cat([b.reshape(-1) for b in bufs], out=flat)
                self.comm.broadcast(flat)
                if not src:
                    views = flat.split([b.numel() for b in bufs])
                    torch._foreach_copy_(bufs, [v.view_as(b) for v, b in zip(views, bufs)])

    def _flat(self, key: tuple[torch.dtype, torch.device], numel: int) -> torch.Tensor:
        flat = self.flats.get(key)
        if flat is None or flat.numel() != numel:  # made once, unless the module's buffers change
            flat = self.flats[key] = torch.empty(numel, dtype=key[0], device=key[1])
        return flat
