"""Consolidation: a sharded checkpoint as full fp32 tensors, in one process, no process group.

`zerodp consolidate DIR OUT` (__main__.py) writes it as `.safetensors` or `.pt`, keyed like module.state_dict();
`--hf` as a Hugging Face model folder (zerodp.models.hf_folder) that from_pretrained loads, from the HF config
a `zerodp train` checkpoint records or from `--hf-config` (a DeepSpeed checkpoint records none). The writers
read the checkpoint a chunk at a time and write each tensor as soon as it is whole (checkpoint_weights,
models.weight_files): the whole model is never in memory.
"""

from __future__ import annotations

import json

import torch

from zerodp.checkpoint import deepspeed, whole
from zerodp.checkpoint.errors import CheckpointError
from zerodp.checkpoint.read import read_metadata, resolve
from zerodp.engine.sharding.weights import Weights
from zerodp.models import hf_folder, hf_peft
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
    tensor-parallel shard joined with its other tp ranks' along its axis, under the model's name
    (whole.py). Everything missing is found before the first value is read. A DeepSpeed checkpoint is
    read tensor by tensor from its memory-mapped partitions."""
    ds_path = deepspeed.find(load_dir, tag)
    if ds_path is not None:
        return deepspeed.weights(ds_path)
    path, manifest = resolve(load_dir, tag)
    metadata = read_metadata(path)
    reading = whole.plan(path, manifest, metadata, [e for e in manifest["model"] if e["alias_of"] is None])
    ties = {e["name"]: e["alias_of"] for e in manifest["model"] if e["alias_of"] is not None}
    shapes = {e["name"]: reading.shapes[ties.get(e["name"], e["name"])] for e in manifest["model"]}
    return Weights(shapes, ties, reading.stream(path, manifest, metadata, chunk_numel))


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
    weights = checkpoint_weights(load_dir, tag)
    peft = hf_peft.peft_names(weights.shapes)
    if peft:
        raise CheckpointError(f"--hf: '{load_dir}' holds a PEFT model ({peft[0]}, ...), and a checkpoint records "
                              "no adapter config, without which no adapter folder can be written: write the HF "
                              "folder from the engine (zerodp.checkpoint.export_engine.save_hf: the base, and "
                              "PEFT's adapter in adapter/), or consolidate to .safetensors / .pt")
    try:
        description = hf_folder.read_description(hf_config) if hf_config else _recorded_hf(load_dir, tag)
        return hf_folder.write_folder(out, weights, description)
    except ValueError as e:
        raise CheckpointError(f"--hf: {e}") from None


def _recorded_hf(load_dir: str, tag: str | None) -> dict:
    """The HF description (hf_folder.description) that `zerodp train` keeps in its checkpoints."""
    if deepspeed.find(load_dir, tag) is not None:
        raise CheckpointError(f"'{load_dir}' is a DeepSpeed checkpoint, which records no Hugging Face config: "
                              "pass --hf-config with the model's folder (save_pretrained's) or its config.json")
    path, manifest = resolve(load_dir, tag)
    client = manifest.get("client_state")
    hf = client.get("hf") if isinstance(client, dict) else None
    if not isinstance(hf, dict) or not isinstance(hf.get("config"), dict):
        raise CheckpointError(f"checkpoint '{path}' records no Hugging Face config (only `zerodp train` with "
                              "an hf-* model or an HF folder records one): pass --hf-config with the model's "
                              "folder or its config.json")
    return hf

