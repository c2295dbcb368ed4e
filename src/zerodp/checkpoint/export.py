"""Consolidation: a sharded checkpoint as one full fp32 state dict, in one process, no process group.

`zerodp consolidate DIR OUT` (command.py) writes it as `.safetensors` or `.pt`, keyed like module.state_dict().
"""

from __future__ import annotations

import json

import torch

from . import deepspeed
from .errors import CheckpointError
from .pieces import saved_pieces
from .read import read_metadata, read_tensors, resolve


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
