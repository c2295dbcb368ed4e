"""A model's weights as a stream of whole tensors, never all of them held at once.

`Weights` is what an exporter writes: every name of `module.state_dict()` with its shape and dtype,
known before any value (a file's layout is fixed first), the names that share a tensor with another
(ties), and the values, each once, in whatever order they become available. `engine_weights` gives
a trained engine's: the fp32 master values bucket by bucket (each bucket's shards gathered from its
owners, so every rank takes part and holds one bucket at a time), stage 3's frozen parameters the
same way from their working shards (in their own dtype: their bits), then the buffers and the frozen
parameters every rank holds whole.
`Engine.full_state_dict` is the same values all at once.

Tensor parallelism: a bucket gathered over dp holds this rank's tp shard of each parameter; each
shard is then joined over the tp group (comm.tp) along the dimension it was split on, one parameter
at a time, into the whole tensor under the model's own name (shapes: the whole tensor's, found by one
small exchange of the shards' sizes before any value). A parameter every tp rank holds alike
(flat.tp_duplicate) is sent as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import Bucket, join_tp, local, tp_parts
from zerodp.engine.layout.layout import Layout
from zerodp.engine.tensor_parallel.placements import shard_dim


@dataclass
class Weights:
    """Names (in state_dict order) -> (shape, dtype); alias -> the name whose tensor it shares; and
    the values of every name that is not an alias, each once."""

    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    ties: dict[str, str]
    stream: Iterable[tuple[str, torch.Tensor]]

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> Weights:
        """A whole state dict as Weights (ties: names holding the same tensor object)."""
        first: dict[int, str] = {}
        ties = {}
        for name, t in state.items():
            if id(t) in first:
                ties[name] = first[id(t)]
            else:
                first[id(t)] = name
        shapes = {n: (t.shape, t.dtype) for n, t in state.items()}
        return cls(shapes, ties, ((n, state[n]) for n in first.values()))

    def drain(self) -> None:
        """Take part in the stream's collectives without writing anything (the ranks that do not write)."""
        for _ in self.stream:
            del _  # one bucket alive at a time


@dataclass(frozen=True)
class _Split:
    """How a tensor-parallel shard joins the others: along `dim`, each tp rank's `sizes` along it, part by
    part when each shard holds its slice of each of `parts` parts (flat.tp_parts: a fused q | k | v)."""

    dim: int
    sizes: list[int]
    parts: int = 1


def engine_weights(module: nn.Module, comm: Comm, layout: Layout, values: Callable[[Bucket], torch.Tensor]
                   ) -> Weights:
    """The engine's weights keyed like module.state_dict(): trained parameters as their fp32 masters, frozen
    parameters in their own dtype (their bits: a bf16 base stays bf16, packed 4-bit words stay packed),
    floating buffers in fp32, the rest as they are; under tensor parallelism every tensor whole. Iterating
    the stream is a collective (stages 1-3 gather each bucket from its owners, tp joins each shard over the
    tp group): every rank must iterate it to the end. Under tp, making the Weights is one too (the shards'
    sizes, for the whole shapes): call it on every rank. `values(b)`: bucket b whole (the trained ones' fp32
    masters, the frozen ones' working shards in their dtype), gathered from every rank."""
    trained, frozen = layout.by_param(), layout.by_frozen_param()
    slots = {**trained, **frozen}
    params = {id(p) for p in module.parameters()}
    # One state_dict, kept for the stream: entries a module makes anew on each call (bitsandbytes' quant
    # state) are known by their objects only in this one.
    state = module.state_dict(keep_vars=True)
    held = {id(t): layout.shape_of(slots[id(t)][1]) if id(t) in slots else local(t).shape for t in state.values()}
    splits = _splits(comm, state, held)  # a local check, then the tp ranks' sizes (collective)
    shapes, ties, first = {}, {}, {}
    for name, t in state.items():
        shape = held[id(t)]
        if id(t) in splits:
            split = splits[id(t)]
            shape = shape[:split.dim] + (sum(split.sizes),) + shape[split.dim + 1:]
        shapes[name] = (torch.Size(shape), _dtype(t, id(t) in trained, frozen.get(id(t)), id(t) in params))
        if id(t) in first:
            ties[name] = first[id(t)]
        else:
            first[id(t)] = name
    return Weights(shapes, ties, _stream(state, params, comm.tp, layout, values, first, splits))


def _dtype(t: torch.Tensor, trained: bool, frozen: tuple[Bucket, object] | None, param: bool) -> torch.dtype:
    """The dtype an entry is written in: a trained parameter's fp32 master; a frozen parameter's own (stage 3's
    the dtype of its bucket); a floating buffer in fp32; anything else as it is."""
    if trained:
        return torch.float32
    if frozen is not None:
        return frozen[0].data.dtype
    if param or not t.is_floating_point():
        return t.dtype
    return torch.float32


def _splits(comm: Comm, state: dict[str, torch.Tensor], held: dict[int, torch.Size]) -> dict[int, _Split]:
    """id(tensor) -> its _Split, for every tensor-parallel shard among the state's tensors (`held`: the
    shape of each one's values on this rank). Raises on every rank alike (the model is built alike) for a
    shard whose split dimension is unknown, before the one collective: the tp ranks' sizes along it."""
    if comm.tp is None:
        return {}
    dims: dict[int, int] = {}  # in state order, the same on every tp rank
    for name, t in state.items():
        if id(t) not in dims and (dim := shard_dim(name, t, len(held[id(t)]))) is not None:
            dims[id(t)] = dim
    sizes = comm.tp.all_gather_object([held[i][d] for i, d in dims.items()])
    parts = {id(t): tp_parts(t) for t in state.values()}
    return {i: _Split(d, [theirs[k] for theirs in sizes], parts[i]) for k, (i, d) in enumerate(dims.items())}


def _stream(state: dict[str, torch.Tensor], params: set[int], tp: Comm | None, layout: Layout,
            values: Callable[[Bucket], torch.Tensor], first: dict[int, str], splits: dict[int, _Split]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    trained = set()
    for b in layout.gathered:  # stage 3's frozen buckets last: their working values, no master
        full = values(b)
        for s in b.slots:
            trained.add(id(s.param))
            value = full[s.offset:s.offset + s.numel].view(layout.shape_of(s))
            split = splits.get(id(s.param))
            yield first[id(s.param)], value if split is None else join(tp, value, split)
            del value  # a view of the bucket: held, it would keep the bucket alive beside the next one
        del full
    for name, t in state.items():
        if id(t) not in trained and first.get(id(t)) == name:
            value = local(t).detach()
            value = value.float() if value.is_floating_point() and id(t) not in params else value
            split = splits.get(id(t))
            yield name, value if split is None else join(tp, value, split)


def join(tp: Comm, shard: torch.Tensor, split: _Split) -> torch.Tensor:
    """The whole tensor from every tp rank's `shard`, split along `split.dim` into `split.sizes` (in tp rank
    order; an uneven split is padded for the gather), part by part when each shard holds its slice of each
    of `split.parts` parts (flat.join_tp). Collective over the tp group; every rank gets it whole.
    Held at once: the gathered shards and, unless they are the whole tensor already (dim 0), their join."""
    dim, sizes = split.dim, split.sizes
    rows = max(sizes)
    if shard.shape[dim] != rows:
        pad = list(shard.shape)
        pad[dim] = rows - shard.shape[dim]
        shard = torch.cat([shard, shard.new_zeros(pad)], dim)
    shard = shard.contiguous()
    out = shard.new_empty((len(sizes), *shard.shape))
    tp.all_gather(out.view(-1), shard.view(-1))
    if dim == 0 and all(n == rows for n in sizes) and split.parts == 1:
        return out.flatten(0, 1)
    return join_tp([out[r].narrow(dim, 0, n) for r, n in enumerate(sizes)], dim, split.parts)
