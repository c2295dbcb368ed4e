"""Consolidation: a sharded checkpoint as full fp32 tensors, in one process, no process group.

`zerodp consolidate DIR OUT` (command.py) writes it as `.safetensors` or `.pt`, keyed like module.state_dict();
`--hf` as a Hugging Face model folder (zerodp.models.hf_folder) that from_pretrained loads, from the HF config
a `zerodp train` checkpoint records or from `--hf-config` (a DeepSpeed checkpoint records none). The writers
read the checkpoint a chunk at a time and write each tensor as soon as it is whole (checkpoint_weights,
models.weight_files): the whole model is never in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch

from zerodp.checkpoint import deepspeed
from zerodp.checkpoint.errors import CheckpointError
from zerodp.checkpoint.pieces import saved_pieces, stored
from zerodp.checkpoint.read import iter_tensors, read_metadata, resolve
from zerodp.engine.weights import Weights
from zerodp.models import hf_folder
from zerodp.models.weight_files import SafetensorsFile, TorchSaveFile, write_all

# Elements read from the checkpoint at once while exporting (zero_optimization.reduce_bucket_size's
# default): the exporter holds one such chunk and the tensor being assembled, never the whole model.
EXPORT_CHUNK_NUMEL = 50_000_000


def consolidate(load_dir: str, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(full fp32 state dict keyed like module.state_dict(), {alias: tied-to name}); one process.
    It holds the whole model: the writers below stream `checkpoint_weights` instead."""
    weights = checkpoint_weights(load_dir, tag)
    values = dict(weights.stream)
    out = {n: values[weights.ties.get(n, n)] for n in weights.shapes}
    return out, weights.ties


def checkpoint_weights(load_dir: str, tag: str | None = None, chunk_numel: int = EXPORT_CHUNK_NUMEL) -> Weights:
    """A checkpoint's weights as consolidate() gives them (trained parameters from their fp32 master
    pieces, the rest as saved, floating ones in fp32), read `chunk_numel` elements at a time; a
    tensor-parallel shard joined with its other tp ranks' along its axis, under the model's name.
    Everything missing is found before the first value is read. A DeepSpeed checkpoint is read tensor
    by tensor from its memory-mapped partitions."""
    ds_path = deepspeed.find(load_dir, tag)
    if ds_path is not None:
        return deepspeed.weights(ds_path)
    path, meta = resolve(load_dir, tag)
    metadata = read_metadata(path)
    md = metadata.state_dict_metadata
    pieces = saved_pieces(metadata, "master/")
    shapes, ties, keys, owner, parts = {}, {}, [], {}, {}
    for e in meta["model"]:
        name, shape = e["name"], torch.Size(e["shape"])
        if e["alias_of"] is not None:
            ties[name] = e["alias_of"]
            shapes[name] = shapes[e["alias_of"]]
            continue
        parts[name] = _parts(path, e)
        for i, (saved_as, part) in enumerate(parts[name].items()):
            if e["kind"] == "trained":
                found = sorted(pieces.get(saved_as, []))
                covered = sum(numel for _, numel, _ in found)
                if covered != part.numel():
                    raise CheckpointError(f"checkpoint '{path}' is corrupt: parameter '{saved_as}' has "
                                          f"{covered} of {part.numel()} elements saved")
                owner.update({key: (name, i, start) for start, _, key in found})
                keys += [key for _, _, key in found]
                dtype = torch.float32
            else:
                key = f"model/{saved_as}"
                if key not in md:
                    raise CheckpointError(f"checkpoint '{path}' is corrupt: '{saved_as}' is not saved")
                dtype = md[key].properties.dtype
                dtype = torch.float32 if dtype.is_floating_point else dtype
                owner[key] = (name, i, None)
                keys.append(key)
        shapes[name] = (shape, dtype)
    tp_dims = {e["name"]: e["tp"]["dim"] for e in meta["model"] if e.get("tp")}
    chunks = iter_tensors(path, metadata, keys, meta, chunk_numel)
    return Weights(shapes, ties, _assemble(chunks, owner, shapes, parts, tp_dims))


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


def _assemble(chunks: Iterator[dict[str, torch.Tensor]], owner: dict[str, tuple[str, int, int | None]],
              shapes: dict[str, tuple[torch.Size, torch.dtype]], parts: dict[str, dict[str, torch.Size]],
              tp_dims: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors from the saved keys (a tensor's parts, and each part's pieces, come in order, one
    after another): each given as soon as its last piece is read. A part is the whole tensor, or one tp
    rank's shard, which is copied to its place along the tp axis once complete: the exporter holds the
    tensor being assembled and one shard of it."""
    current, whole, part, filled, joined = None, None, None, 0, 0
    for chunk in chunks:
        for key, t in chunk.items():
            n, i, start = owner[key]
            if start is None and n not in tp_dims:  # saved whole
                yield n, t.float() if t.is_floating_point() else t
                continue
            shard_shapes = list(parts[n].values())
            if current is None or current[0] != n:
                whole = torch.empty(shapes[n][0], dtype=shapes[n][1]) if n in tp_dims else None
                joined = 0
            if current != (n, i):
                current, filled = (n, i), 0
                part = torch.empty(shard_shapes[i].numel(), dtype=shapes[n][1])
            start = start or 0  # a tp shard of an untrained tensor is saved whole
            part[start:start + t.numel()] = t.reshape(-1)
            filled += t.numel()
            if filled < part.numel():
                continue
            if n not in tp_dims:
                yield n, part.view(shapes[n][0])
                continue
            dim = tp_dims[n]
            at = sum(s[dim] for s in shard_shapes[:i])
            whole.narrow(dim, at, shard_shapes[i][dim]).copy_(part.view(shard_shapes[i]))
            joined += 1
            if joined == sum(1 for s in shard_shapes if s.numel()):  # an empty shard has no pieces
                yield n, whole
                current = whole = None


def write_consolidated(load_dir: str, out: str, tag: str | None = None) -> None:
    """Write the full fp32 state dict as `.safetensors` (ties in its metadata) or `.pt`, tensor by tensor."""
    if not out.endswith((".safetensors", ".pt")):
        raise CheckpointError(f"output '{out}' must end in .safetensors or .pt")
    weights = checkpoint_weights(load_dir, tag)
    plain = [n for n in weights.shapes if n not in weights.ties]
    if out.endswith(".safetensors"):
        # safetensors stores no shared tensors: a tied name gets an equal copy, the tie goes in metadata.
        file = SafetensorsFile(out, weights.shapes, {"format": "pt", "zerodp_tied": json.dumps(weights.ties)})
        routes = {n: [(file, n)] for n in plain}
        for alias, name in weights.ties.items():
            routes[name].append((file, alias))
    else:
        file = TorchSaveFile(out, weights.shapes, weights.ties)  # tied names share one tensor, as in the module
        routes = {n: [(file, n)] for n in plain}
    write_all(weights.stream, routes)
    hf_folder.usual_mode(out)


def write_hf_folder(load_dir: str, out: str, tag: str | None = None, hf_config: str | None = None) -> list[str]:
    """Write the checkpoint as a Hugging Face model folder at `out` (config, generation config,
    model.safetensors with HF's key names, the tokenizer when known); returns notes for the user.
    hf_config: an HF folder or config.json to take the config from instead of the checkpoint's record."""
    try:
        description = hf_folder.read_description(hf_config) if hf_config else _recorded_hf(load_dir, tag)
        return hf_folder.write_folder(out, checkpoint_weights(load_dir, tag), description)
    except ValueError as e:
        raise CheckpointError(f"--hf: {e}") from None


def _recorded_hf(load_dir: str, tag: str | None) -> dict:
    """The HF description (hf_folder.description) that `zerodp train` keeps in its checkpoints."""
    if deepspeed.find(load_dir, tag) is not None:
        raise CheckpointError(f"'{load_dir}' is a DeepSpeed checkpoint, which records no Hugging Face config: "
                              "pass --hf-config with the model's folder (save_pretrained's) or its config.json")
    path, meta = resolve(load_dir, tag)
    client = meta.get("client_state")
    hf = client.get("hf") if isinstance(client, dict) else None
    if not isinstance(hf, dict) or not isinstance(hf.get("config"), dict):
        raise CheckpointError(f"checkpoint '{path}' records no Hugging Face config (only `zerodp train` with "
                              "an hf-* model or an HF folder records one): pass --hf-config with the model's "
                              "folder or its config.json")
    return hf

