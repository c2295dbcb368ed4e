"""Filling the engine's buffers at set-up: from the module's own values (rank 0's, broadcast), or, for a
model built on `meta` or a weights source, from a ParameterSource that is asked for exactly the elements
this rank keeps (stage 3: its shard of each bucket; stages 0-2: the whole working bucket, whose shard
starts the fp32 master). One bucket at a time: no rank ever holds the whole model, in any precision.

Weights may leave some parameters to the initialisers (`ParameterSource.initialised`: an adapter added to
a pretrained base, which no file of the base holds): those are read from the modules' initialisers, run
only for the modules that hold them, and every other parameter from the weights.

Stage 3's frozen parameters are in flat buffers of their own (layout.Layout.frozen, one per storage dtype),
filled like the trained ones but in their own dtype: their bits are copied, never cast through fp32. Parameters outside the flat buffers (frozen ones below stage 3) and buffers are kept whole
on every rank, as for a model built whole: frozen parameters from the source, buffers from their modules'
initialisers (initialisers.ModuleInit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import swap_tensors

from zerodp.distributed.comm import Comm
from zerodp.distributed.device import return_freed_host_memory
from zerodp.engine.layout.flat import Bucket, FlatGroup, local, set_local
from zerodp.engine.setup.initialisers import (
    ModuleInit,
    ParamInitFn,
    meta_names,
    missing_initialiser,
)
from zerodp.engine.setup.source import ParameterSource
from zerodp.engine.setup.tp_shards import Box, boxes, read_local


@dataclass
class Filling:
    """Where this rank's values come from. source None: the module's own values, rank 0's broadcast."""

    module: nn.Module
    source: ParameterSource | None = None
    inits: ModuleInit | None = None  # the initialisers of the tensors on meta
    # tensor-parallel parameters whose local shard is read out of the source's whole tensor, by name
    boxes: dict[str, Box] = field(default_factory=dict)
    # parameters the weights leave to the initialisers (source.initialised), read from `inits`
    initialised: frozenset[str] = frozenset()

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

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the values this rank holds of parameter `name` (a tensor-parallel
        parameter's local shard) flattened."""
        source = self.inits if name in self.initialised else self.source
        box = self.boxes.get(name)
        return source.read(name, start, stop) if box is None else read_local(source, name, box, start, stop)

    @property
    def draws(self) -> bool:
        """The initialisers give parameters: the random state is left where the whole build leaves it."""
        return self.inits is not None and (self.source is self.inits or bool(self.initialised))


def filling_for(module: nn.Module, source: ParameterSource | None, param_init_fn: ParamInitFn | None) -> Filling:
    """Local checks, no collective: every tensor on meta has a source of values, and the source has every
    parameter with its shape. Raises ValueError naming what is missing."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn must be a callable module -> None, got {type(param_init_fn).__name__}")
    params, buffers = meta_names(module)
    if param_init_fn is not None and not params and not buffers:
        raise ValueError("param_init_fn initialises a model built on the 'meta' device, and this model has no "
                         "tensor on meta; build it under torch.device('meta'), or leave param_init_fn out")
    shapes = {n: p.shape for n, p in module.named_parameters()}
    initialised = _left_to_initialisers(source, params)
    inits = None
    if buffers or (params and source is None) or initialised:  # weights need no initialiser for theirs
        inits = ModuleInit(module, param_init_fn, None if source is None else {*buffers, *initialised})
        missing = inits.uninitialisable(buffers + (params if source is None else sorted(initialised)))
        if missing:
            raise ValueError(missing_initialiser(missing))
    if source is None and params:
        source = inits
    elif source is not None:
        source.check({n: s for n, s in shapes.items() if n not in initialised})
    # Files hold every parameter whole; the initialisers give whole values for the tensors on meta only (a
    # parameter already built holds its local shard, which ModuleInit reads).
    return Filling(module, source, inits, boxes(module, None if source is not inits else set(params)),
                   frozenset(initialised))


def _left_to_initialisers(source: ParameterSource | None, params: list[str]) -> set[str]:
    """Of the parameters on meta, those `source` says it does not hold and leaves to their initialisers. (A
    parameter already built has no initialiser to run: the files must hold it, or check names it.)"""
    ask = getattr(source, "initialised", None)
    if ask is None:
        return set()
    names = set(ask(params))
    unknown = sorted(names - set(params))
    if unknown:
        raise ValueError(f"{type(source).__name__}.initialised named {unknown[:3]}, which are not parameters of "
                         "the model on the 'meta' device")
    return names


def start(filling: Filling, comm: Comm, device: torch.device, trained: set[int]) -> None:
    """Collective (one broadcast of rank 0's random state, when something is initialised): then every
    tensor outside the flat buffers that is on meta gets its value, whole, on `device`, and so does
    every frozen parameter when the values come from files."""
    if filling.inits is not None:
        state = filling.inits.initial_state.to(device)
        # every rank draws rank 0's values, as the whole build broadcasts rank 0's; with tensor parallelism
        # the world's rank 0, so that every tp rank's shard is cut from the same whole values
        comm.everyone.broadcast(state)
        filling.inits.seed(state.cpu())
    for name, p in filling.module.named_parameters():
        if id(p) in trained or not (p.is_meta or filling.from_files):
            continue
        value = filling.read(name, 0, local(p).numel()).view(local(p).shape)
        if p.is_meta:
            swap_tensors(p, _parameter(p, value.to(device, p.dtype, copy=True)))
        else:
            set_local(p, value.to(local(p).device, p.dtype))
    for m, name, value in list(filling.inits.buffers()) if filling.inits is not None else []:
        setattr(m, name, value.to(device, copy=True))


def fill(layout: list[FlatGroup], filling: Filling, comm: Comm, rank: int, dtype: torch.dtype,
         device: torch.device, sharded: bool, host_shards: bool, pin: bool,
         frozen: tuple[FlatGroup, ...] = (), store: Callable[[Bucket, torch.Tensor], None] | None = None
         ) -> list[torch.Tensor]:
    """Materialise every group's flat buffer bucket by bucket; returns this rank's fp32 shard of each
    trained bucket (the masters start from these): fresh tensors, or, in fp32 with the shards on the
    device, views of the working shards themselves (the fp32 master is the working shard; no second copy).
    `frozen` (stage 3's frozen parameters, a group per storage dtype) is filled the same way last, in its own
    dtype (its values are moved, never cast); it has no master. `store` (offload_param "nvme"): where each
    shard goes instead of a flat buffer (FlatGroup.allocate)."""
    names = {id(p): n for n, p in filling.module.named_parameters()}
    shards: list[torch.Tensor] = []
    fresh = dtype != torch.float32 or host_shards
    for g in [*layout, *frozen]:
        trained, kept = g.dtype is None, g.dtype or dtype
        for b in g.buckets:
            for s in b.slots:
                if s.param.is_meta:  # a real tensor to hold the flat-buffer view (the object is kept)
                    swap_tensors(s.param, _parameter(s.param, torch.empty(0, dtype=kept, device=device)))
        values = _bucket_values(g, filling, comm, rank, sharded, names, shards if fresh and trained else None,
                                torch.float32 if trained else kept)
        g.allocate(kept, values, rank, sharded=sharded, host_shards=host_shards, pin=pin, store=store)
        if not fresh and trained:
            shards += [b.owned for b in g.buckets]
    if filling.inits is not None:
        filling.inits.finish(advance=filling.draws)
    return shards


def _parameter(like: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """A Parameter holding `value` where `like` (on meta) holds its values: a DTensor's local shard, which
    keeps its mesh and placements (swap_tensors swaps only tensors of one kind)."""
    if isinstance(like, DTensor):
        value = DTensor.from_local(value, like.device_mesh, like.placements, run_check=False,
                                   shape=like.shape, stride=like.stride())
    return nn.Parameter(value, requires_grad=like.requires_grad)


def _bucket_values(g: FlatGroup, filling: Filling, comm: Comm, rank: int, sharded: bool,
                   names: dict[int, str], shards: list[torch.Tensor] | None,
                   dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Each bucket's values in `dtype` (fp32 for a trained group, a frozen group's own: its bits moved as they
    are) in turn: whole, or only this rank's shard (stage 3 from a source); with `shards`, a fresh copy of this
    rank's shard of each is added to it."""
    for b in g.buckets:
        if not filling.from_source:
            values = b.flatten(dtype)
            comm.broadcast(values)  # every rank starts from rank 0's weights
        elif sharded:
            values = _bucket_elements(b, rank * b.shard_numel, (rank + 1) * b.shard_numel, filling, names, dtype)
        else:
            values = _bucket_elements(b, 0, b.numel, filling, names, dtype)
        if shards is not None:
            shards.append(values if values.numel() == b.shard_numel else b.shard(values, rank).clone())
        yield values
        del values
        return_freed_host_memory()  # the bucket's staging and its initialisers' stand-ins


def _bucket_elements(b: Bucket, lo: int, hi: int, filling: Filling, names: dict[int, str],
                     dtype: torch.dtype) -> torch.Tensor:
    """Elements [lo, hi) of bucket b in `dtype`, padding zero, each parameter's range asked of the source."""
    out = torch.zeros(hi - lo, dtype=dtype)
    for s in reversed(b.slots):  # registration order: a module initialiser's source runs each unit once
        a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < z:
            out[a - lo:z - lo].copy_(filling.read(names[id(s.param)], a - s.offset, z - s.offset))
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
