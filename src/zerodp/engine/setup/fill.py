"""Filling the engine's buffers at set-up: from the module's own values (rank 0's, broadcast), or, for a
model built on `meta` or a weights source, from a ParameterSource that is asked for exactly the elements
this rank keeps (stage 3: its shard of each bucket; stages 0-2: the whole working bucket, whose shard
starts the fp32 master). One bucket at a time: no rank ever holds the whole model, in any precision.

Parameters outside the flat buffers (frozen ones) and buffers are small next to the model and are kept
whole on every rank, as for a model built whole: frozen parameters from the source, buffers from their
modules' initialisers (initialisers.ModuleInit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn
from torch.utils import swap_tensors

from zerodp.distributed.device import return_freed_host_memory
from zerodp.distributed.comm import Comm
from zerodp.engine.flat import Bucket, FlatGroup
from zerodp.engine.setup.initialisers import (
    ModuleInit,
    ParamInitFn,
    meta_names,
    missing_initialiser,
)
from zerodp.engine.setup.source import ParameterSource


@dataclass
class Filling:
    """Where this rank's values come from. source None: the module's own values, rank 0's broadcast."""

    module: nn.Module
    source: ParameterSource | None = None
    inits: ModuleInit | None = None  # the initialisers of the tensors on meta

    @property
    def from_source(self) -> bool:
        return self.source is not None

    @property
    def from_files(self) -> bool:
        """The values come from weights (files, or any source the caller gave), not initialisers."""
        return self.source is not None and self.source is not self.inits

    @property
    def origin(self) -> str:
        """Said the same on every rank, or the ranks would not meet in the same collectives."""
        return "rank 0's module (broadcast)" if self.source is None else type(self.source).__name__


def filling_for(module: nn.Module, source: ParameterSource | None, param_init_fn: ParamInitFn | None) -> Filling:
    """Local checks, no collective: every tensor on meta has a source of values, and the source has every
    parameter with its shape. Raises ValueError naming what is missing."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn must be a callable module -> None, got {type(param_init_fn).__name__}")
    params, buffers = meta_names(module)
    if param_init_fn is not None and not params and not buffers:
        raise ValueError("param_init_fn initialises a model built on the 'meta' device, and this model has no "
                         "tensor on meta; build it under torch.device('meta'), or leave param_init_fn out")
    inits = None
    if buffers or (params and source is None):  # weights from files need no initialiser for parameters
        inits = ModuleInit(module, param_init_fn)
        missing = inits.uninitialisable(buffers + ([] if source is not None else params))
        if missing:
            raise ValueError(missing_initialiser(missing))
    if source is None and params:
        source = inits
    elif source is not None:
        source.check({n: p.shape for n, p in module.named_parameters()})
    return Filling(module, source, inits)


def start(filling: Filling, comm: Comm, device: torch.device, trained: set[int]) -> None:
    """Collective (one broadcast of rank 0's random state, when something is initialised): then every
    tensor outside the flat buffers that is on meta gets its value, whole, on `device`, and so does
    every frozen parameter when the values come from files."""
    if filling.inits is not None:
        state = filling.inits.initial_state.to(device)
        comm.broadcast(state)  # every rank draws rank 0's values, as the whole build broadcasts rank 0's
        filling.inits.seed(state.cpu())
    for name, p in filling.module.named_parameters():
        if id(p) in trained or not (p.is_meta or filling.from_files):
            continue
        value = filling.source.read(name, 0, p.numel()).view(p.shape)
        if p.is_meta:
            swap_tensors(p, nn.Parameter(value.to(device, p.dtype, copy=True), requires_grad=p.requires_grad))
        else:
            p.data = value.to(p.device, p.dtype)
    for m, name, value in list(filling.inits.buffers()) if filling.inits is not None else []:
        setattr(m, name, value.to(device, copy=True))


def fill(layout: list[FlatGroup], filling: Filling, comm: Comm, rank: int, dtype: torch.dtype,
         device: torch.device, sharded: bool, host_shards: bool, pin: bool) -> list[torch.Tensor]:
    """Materialise every group's flat buffer bucket by bucket; returns this rank's fp32 shard of each
    bucket (the masters start from these): fresh tensors, or, in fp32 with the shards on the device,
    views of the working shards themselves (the fp32 master is the working shard; no second copy)."""
    names = {id(p): n for n, p in filling.module.named_parameters()}
    shards: list[torch.Tensor] = []
    fresh = dtype != torch.float32 or host_shards
    for g in layout:
        for b in g.buckets:
            for s in b.slots:
                if s.param.is_meta:  # a real tensor to hold the flat-buffer view (the object is kept)
                    swap_tensors(s.param, nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                                       requires_grad=s.param.requires_grad))
        g.allocate(dtype, _bucket_values(g, filling, comm, rank, sharded, names, shards if fresh else None),
                      rank, sharded=sharded, host_shards=host_shards, pin=pin)
        if not fresh:
            shards += [b.owned for b in g.buckets]
    if filling.inits is not None:
        filling.inits.finish(advance=filling.source is filling.inits)
    return shards


def _bucket_values(g: FlatGroup, filling: Filling, comm: Comm, rank: int, sharded: bool,
                   names: dict[int, str], shards: list[torch.Tensor] | None) -> Iterator[torch.Tensor]:
    """Each bucket's fp32 values in turn: whole, or only this rank's shard (stage 3 from a source); with
    `shards`, a fresh copy of this rank's shard of each is added to it."""
    for b in g.buckets:
        if not filling.from_source:
            values = b.flatten(torch.float32)
            comm.broadcast(values)  # every rank starts from rank 0's weights
        elif sharded:
            values = _bucket_elements(b, rank * b.shard_numel, (rank + 1) * b.shard_numel, filling.source, names)
        else:
            values = _bucket_elements(b, 0, b.numel, filling.source, names)
        if shards is not None:
            shards.append(values if values.numel() == b.shard_numel else b.shard(values, rank).clone())
        yield values
        del values
        return_freed_host_memory()  # the bucket's staging and its initialisers' stand-ins


def _bucket_elements(b: Bucket, lo: int, hi: int, source: ParameterSource, names: dict[int, str]) -> torch.Tensor:
    """Elements [lo, hi) of bucket b, padding zero, each parameter's range asked of the source."""
    out = torch.zeros(hi - lo, dtype=torch.float32)
    for s in reversed(b.slots):  # registration order: a module initialiser's source runs each unit once
        a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < z:
            out[a - lo:z - lo].copy_(source.read(names[id(s.param)], a - s.offset, z - s.offset))
    return out


def move_to(module: nn.Module, device: torch.device) -> None:
    """module.to(device) for a model that may hold meta tensors: those have no values to move and are
    given their place on the device by start() and fill()."""
    if not any(t.is_meta for t in module.parameters()) and not any(t.is_meta for t in module.buffers()):
        module.to(device)
        return
    for p in module.parameters():
        if not p.is_meta and p.device != device:
            p.data = p.data.to(device)
    for m in module.modules():
        for name, b in list(m.named_buffers(recurse=False)):
            if not b.is_meta and b.device != device:
                setattr(m, name, b.to(device))
