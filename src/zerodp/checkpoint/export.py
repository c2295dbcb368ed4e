"""Consolidation: a sharded checkpoint as one full fp32 state dict, in one process, no process group.

`zerodp consolidate DIR OUT` (command.py) writes it as `.safetensors` or `.pt`, keyed like module.state_dict();
`--hf` as a Hugging Face model folder (zerodp.models.hf_folder) that from_pretrained loads, from the HF config
a `zerodp train` checkpoint records or from `--hf-config` (a DeepSpeed checkpoint records none).
"""

from __future__ import annotations

import json

import torch

from zerodp.checkpoint import deepspeed
from zerodp.checkpoint.errors import CheckpointError
from zerodp.checkpoint.pieces import saved_pieces
from zerodp.checkpoint.read import read_metadata, read_tensors, resolve
from zerodp.models import hf_folder


def consolidate(load_dir: str, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(full fp32 state dict keyed like module.state_dict(), {alias: tied-to name}); one process."""
    ds_path = deepspeed.find(load_dir, tag)
    if ds_path is not None:  # a DeepSpeed ZeRO checkpoint
        return deepspeed.consolidate(ds_path)
    path, meta = resolve(load_dir, tag)
    metadata = read_metadata(path)
    md = metadata.state_dict_metadata
    requests: dict[str, torch.Tensor] = {}
    read_tensors(path, metadata, [k for k in md if k.startswith(("master/", "model/"))], meta, requests.update)
    pieces = saved_pieces(metadata, "master/")
    out: dict[str, torch.Tensor] = {}
    ties: dict[str, str] = {}
    for e in meta["model"]:
        name, shape = e["name"], torch.Size(e["shape"])
        if e["alias_of"] is not None:
            ties[name] = e["alias_of"]
            out[name] = out[e["alias_of"]]
        elif e["kind"] == "trained":
            full, covered = torch.zeros(shape.numel(), dtype=torch.float32), 0
            for start, numel, key in pieces.get(name, []):
                full[start:start + numel] = requests[key]
                covered += numel
            if covered != shape.numel():
                raise CheckpointError(f"checkpoint '{path}' is corrupt: parameter '{name}' has "
                                      f"{covered} of {shape.numel()} elements saved")
            out[name] = full.view(shape)
        else:
            t = requests.get(f"model/{name}")
            if t is None:
                raise CheckpointError(f"checkpoint '{path}' is corrupt: '{name}' is not saved")
            out[name] = t.float() if t.is_floating_point() else t
    return out, ties


def write_consolidated(load_dir: str, out: str, tag: str | None = None) -> None:
    """Write the full fp32 state dict as `.safetensors` (ties in its metadata) or `.pt`."""
    state, ties = consolidate(load_dir, tag)
    if out.endswith(".safetensors"):
        from safetensors.torch import save_file
        # safetensors stores no shared tensors: a tied name gets an equal copy, the tie goes in metadata.
        plain = {k: (v.clone() if k in ties else v).contiguous() for k, v in state.items()}
        save_file(plain, out, metadata={"format": "pt", "zerodp_tied": json.dumps(ties)})
    elif out.endswith(".pt"):
        torch.save(state, out)  # tied names share one tensor, as in the module
    else:
        raise CheckpointError(f"output '{out}' must end in .safetensors or .pt")


def write_hf_folder(load_dir: str, out: str, tag: str | None = None, hf_config: str | None = None) -> list[str]:
    """Write the checkpoint as a Hugging Face model folder at `out` (config, generation config,
    model.safetensors with HF's key names, the tokenizer when known); returns notes for the user.
    hf_config: an HF folder or config.json to take the config from instead of the checkpoint's record."""
    try:
        description = hf_folder.read_description(hf_config) if hf_config else _recorded_hf(load_dir, tag)
        state, _ = consolidate(load_dir, tag)
        return hf_folder.write_folder(out, state, description)
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

