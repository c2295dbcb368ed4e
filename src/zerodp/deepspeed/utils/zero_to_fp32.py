"""`deepspeed.utils.zero_to_fp32`: a ZeRO checkpoint as one full fp32 state dict, in one process.

DeepSpeed's three functions over zerodp.checkpoint.consolidate, which reads zerodp's own sharded
checkpoints (what `engine.save_checkpoint` writes) and DeepSpeed's ZeRO 1-3 checkpoints alike.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from zerodp.checkpoint import consolidate, write_consolidated

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (keys as module.state_dict(), tied names sharing one tensor);
    tag: the checkpoint under checkpoint_dir (default: the one `latest` names)."""
    if exclude_frozen_parameters or lazy_mode:
        raise ValueError("get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=True / "
                         "lazy_mode=True) is not supported: the state dict holds every parameter and buffer, "
                         "read whole; drop the keys you do not want from it")
    state, _ = consolidate(checkpoint_dir, tag)
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: str | int = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Write the fp32 state dict into output_dir as `pytorch_model.bin` (or `model.safetensors`);
    returns the file's path. One file: a model above max_shard_size is refused (no sharded output)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    size = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    limit = _bytes(max_shard_size)
    if size > limit:
        raise ValueError(f"the fp32 state dict is {size} bytes, above max_shard_size={max_shard_size!r}; "
                         "zerodp writes one file: raise max_shard_size, or use `zerodp consolidate DIR "
                         "OUT.safetensors`")
    os.makedirs(output_dir, exist_ok=True)
    out = os.path.join(output_dir, "model.safetensors" if safe_serialization else "pytorch_model.bin")
    if safe_serialization:
        write_consolidated(checkpoint_dir, out, tag)
    else:
        torch.save(state, out)
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str, tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into `model` (moved to the CPU, as DeepSpeed); returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _bytes(size: str | int) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size={size!r} is not a size: expected an integer number of bytes or a "
                         "string like '5GB' or '500MB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
