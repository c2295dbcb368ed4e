"""A tensor-parallel parameter's local shard, read from a source of the whole model.

A model built on `meta` and parallelized (`parallelize_module` gives meta DTensors) holds, per
parameter, only where its local shard lies in the whole tensor: a box, one range per dimension
(`Box`). The weight files, and a module's initialiser run on whole-shape stand-ins, hold the whole
tensor. The engine asks for elements [start, stop) of the *local* shard flattened (its buckets lay out
local shards); `read_local` turns that into the box's rows that cover the range, read from the whole
tensor:
  Shard(0)  the local rows are a contiguous range of the whole tensor flattened;
  Shard(1)  the local columns of every row: a strided block, read as one box by a source that has
            `read_box` (safetensors: `get_slice(key)[rows, columns]`), else as one contiguous run of
            the whole tensor flattened per row (any ParameterSource's `read`).
Less than one local row is read on either side of the range, and never the whole tensor.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zerodp.engine.setup.source import ParameterSource


@dataclass(frozen=True)
class Box:
    """Where this rank's local shard of a parameter lies in the whole tensor."""

    whole: tuple[int, ...]   # the whole tensor's shape (the DTensor's)
    local: tuple[int, ...]   # this rank's shard's shape
    offset: tuple[int, ...]  # where the shard starts, per dimension

    def rows(self, first: int, last: int) -> tuple[slice, ...]:
        """Local rows [first, last) of the shard as a box of the whole tensor: a slice per dimension."""
        return ((slice(self.offset[0] + first, self.offset[0] + last),)
                + tuple(slice(o, o + n) for o, n in zip(self.offset[1:], self.local[1:])))


def boxes(module: nn.Module, names: set[str] | None = None) -> dict[str, Box]:
    """{name: Box} of every DTensor parameter (of `names`, when given) whose local shard is not the whole
    tensor. (tensor_parallel.check has let only Shard and Replicate placements through: one box each.)"""
    out = {}
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor) or (names is not None and name not in names):
            continue
        local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if tuple(local) != tuple(p.shape):
            out[name] = Box(tuple(p.shape), tuple(local), tuple(offset))
    return out


def read_local(source: ParameterSource, name: str, box: Box, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the local shard of parameter `name` flattened, read from `source`, which
    holds the whole tensor: the shard's rows that cover the range, and only their local columns."""
    row = math.prod(box.local[1:])
    first, last = start // row, -(-stop // row)
    index = box.rows(first, last)
    read_box = getattr(source, "read_box", None)
    if read_box is not None:
        block = read_box(name, index)
    else:
        block = torch.cat([source.read(name, a, z) for a, z in _runs(box.whole, index)])
    return block.reshape(-1)[start - first * row:stop - first * row]


def _runs(shape: tuple[int, ...], index: tuple[slice, ...]) -> list[tuple[int, int]]:
    """The box `index` of a tensor of `shape` as contiguous [start, stop) runs of the tensor flattened,
    in order: the dimensions after the last one the box cuts are whole, so every index of the
    dimensions before it starts one run."""
    cut = max((d for d, s in enumerate(index) if (s.start, s.stop) != (0, shape[d])), default=0)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out = []
    for outer in itertools.product(*(range(s.start, s.stop) for s in index[:cut])):
        base = sum(i * st for i, st in zip(outer, strides))
        out.append((base + index[cut].start * strides[cut], base + index[cut].stop * strides[cut]))
    return out
