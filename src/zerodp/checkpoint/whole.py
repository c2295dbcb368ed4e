"""Saved tensors made whole: a parameter's pieces put end to end, its tensor-parallel shards joined along
their axis (pieces.py says how a tp shard is saved: per tp rank, in that rank's coordinates).

export.py streams every weight of a checkpoint through it; load.py, resuming on another tp size, reads
whole each tensor this rank keeps a part of and cuts out this rank's shard (`its_shard`). One tensor is
assembled at a time, never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from zerodp.checkpoint.errors import CheckpointError
from zerodp.checkpoint.pieces import saved_pieces, stored, tp_dim
from zerodp.checkpoint.read import iter_tensors
from zerodp.engine.layout.flat import place_tp_shard, tp_parts


@dataclass(frozen=True)
class Reading:
    """What to read for some saved tensors, and how its keys make each of them whole."""

    keys: list[str]                                    # the saved tensors to read, in order
    owner: dict[str, tuple[str, int, int | None]]      # key -> (name, part, start; None: saved whole)
    shapes: dict[str, tuple[torch.Size, torch.dtype]]  # name -> the whole tensor's shape and dtype
    parts: dict[str, dict[str, torch.Size]]            # name -> {saved name: shape}: itself, or its tp shards
    tp_dims: dict[str, int]                            # name -> the axis its tp shards join along
    tp_parts: dict[str, int]                           # name -> flat.tp_parts: joined part by part when over 1

    def stream(self, path: str, manifest: dict, metadata, chunk_numel: int,
               verified: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor), each as soon as its last piece is read, `chunk_numel` elements read at once
        (verified: read.iter_tensors's, the files already checked)."""
        return _assemble(iter_tensors(path, metadata, self.keys, manifest, chunk_numel, verified), self)


def plan(path: str, manifest: dict, metadata, entries: list[dict], prefix: str = "master/") -> Reading:
    """The Reading of model entries `entries` (zerodp.json's, no aliases): a trained one from its pieces
    `{prefix}{name}@{start}` (prefix "master/" or "optim/{key}/"), in fp32; a frozen one stage 3
    sharded from its pieces `frozen/{name}@{start}`; the rest from `model/{name}`; a frozen parameter in its
    own dtype (its bits), a floating buffer in fp32.
    Everything missing is found here, before the first value is read."""
    md = metadata.state_dict_metadata
    pieces = saved_pieces(metadata, prefix)
    frozen_pieces = saved_pieces(metadata, "frozen/")  # stage 3's frozen parameters (ModelEntry.sharded)
    keys, owner, shapes, parts = [], {}, {}, {}
    for e in entries:
        name = e["name"]
        parts[name] = _parts(path, e)
        # a frozen parameter keeps its own dtype (its bits: a bf16 base, packed 4-bit words); the rest in fp32
        dtype = _dtype_named(e["dtype"]) if e["kind"] == "frozen" else torch.float32
        for i, (saved_as, part) in enumerate(parts[name].items()):
            if e["kind"] == "trained" or e.get("sharded"):
                found = sorted((frozen_pieces if e.get("sharded") else pieces).get(saved_as, []))
                covered = sum(numel for _, numel, _ in found)
                if covered != part.numel():
                    raise CheckpointError(f"checkpoint '{path}' is corrupt: {prefix.rstrip('/')} of parameter "
                                          f"'{saved_as}' has {covered} of {part.numel()} elements saved")
                owner.update({key: (name, i, start) for start, _, key in found})
                keys += [key for _, _, key in found]
            else:
                key = f"model/{saved_as}"
                if key not in md:
                    raise CheckpointError(f"checkpoint '{path}' is corrupt: '{saved_as}' is not saved")
                saved_dtype = md[key].properties.dtype
                if e["kind"] != "frozen":
                    dtype = torch.float32 if saved_dtype.is_floating_point else saved_dtype
                owner[key] = (name, i, None)
                keys.append(key)
        shapes[name] = (torch.Size(e["shape"]), dtype)
    tp_dims = {e["name"]: e["tp"]["dim"] for e in entries if e.get("tp")}
    tp_parts = {e["name"]: e["tp"].get("parts", 1) for e in entries if e.get("tp")}
    return Reading(keys, owner, shapes, parts, tp_dims, tp_parts)


def _dtype_named(name: str) -> torch.dtype:
    """The torch dtype a manifest names ("torch.bfloat16")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a checkpoint entry names dtype {name!r}, which is not a torch dtype")
    return dtype


def _parts(path: str, e: dict) -> dict[str, torch.Size]:
    """{saved name: shape} of what makes up entry `e`: itself, or each tp rank's shard (pieces.stored)."""
    if not e.get("tp"):
        return {e["name"]: torch.Size(e["shape"])}
    if e["tp"]["dim"] is None:
        raise CheckpointError(f"checkpoint '{path}': '{e['name']}' is a tensor-parallel shard whose axis was not "
                              f"recorded (its parameter was marked tensor_model_parallel / model_parallel without "
                              f"Megatron's partition_dim), so its {len(e['tp']['shapes'])} tp shards cannot be "
                              "joined into one tensor; set `partition_dim` (and partition_stride 1) on the model's "
                              "tensor-parallel parameters before saving, or resume it with the same tp size")
    return {stored(e["name"], r): torch.Size(s) for r, s in enumerate(e["tp"]["shapes"])}


def _assemble(chunks: Iterator[dict[str, torch.Tensor]], r: Reading) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors from the saved keys (a tensor's parts, and each part's pieces, come in order, one
    after another). A part is the whole tensor, or one tp rank's shard, which is copied to its place
    along the tp axis once complete: held at once, the tensor being assembled and one shard of it."""
    current, whole, part, filled, joined = None, None, None, 0, 0
    for chunk in chunks:
        for key, t in chunk.items():
            n, i, start = r.owner[key]
            if start is None and n not in r.tp_dims:  # saved whole
                yield n, t.to(r.shapes[n][1])
                continue
            shard_shapes = list(r.parts[n].values())
            if current is None or current[0] != n:
                whole = torch.empty(r.shapes[n][0], dtype=r.shapes[n][1]) if n in r.tp_dims else None
                joined = 0
            if current != (n, i):
                current, filled = (n, i), 0
                part = torch.empty(shard_shapes[i].numel(), dtype=r.shapes[n][1])
            start = start or 0  # a tp shard of an untrained tensor is saved whole
            part[start:start + t.numel()] = t.reshape(-1)
            filled += t.numel()
            if filled < part.numel():
                continue
            if n not in r.tp_dims:
                yield n, part.view(r.shapes[n][0])
                continue
            dim = r.tp_dims[n]
            at = sum(s[dim] for s in shard_shapes[:i])
            place_tp_shard(whole, part.view(shard_shapes[i]), dim, at, r.tp_parts[n])
            joined += 1
            if joined == sum(1 for s in shard_shapes if s.numel()):  # an empty shard has no pieces
                yield n, whole
                current = whole = None


def its_shard(t: torch.Tensor, tp_rank: int | None, tp_size: int, local_shape: torch.Size,
              whole: torch.Tensor) -> torch.Tensor:
    """Tensor `t`'s part of `whole` on tp rank `tp_rank` (None: not a tp shard, the whole of it): a
    DTensor's as torch splits it (torch.chunk's sizes, the last shards the smaller), a Megatron shard's
    as Megatron does (equal parts along partition_dim)."""
    if tp_rank is None:
        return whole
    dim = tp_dim(t)
    if tp_parts(t) > 1:  # a _StridedShard: this rank's slice of each part, side by side
        return torch.cat([piece.chunk(tp_size, dim)[tp_rank] for piece in whole.chunk(tp_parts(t), dim)], dim)
    n = local_shape[dim]
    step = -(-whole.shape[dim] // tp_size) if isinstance(t, DTensor) else n
    return whole.narrow(dim, min(tp_rank * step, whole.shape[dim]), n)
