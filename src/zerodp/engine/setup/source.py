"""Where the values of a model's parameters come from when the model was built on `meta`: the contract
between the engine, which decides which elements this rank keeps (the working copy's buckets at stages
0-2, the shards at stage 3, the fp32 masters' shard), and the readers that fill them (module
initialisers, safetensors files, Hugging Face folders, zerodp and DeepSpeed checkpoints). A reader
never hands over a whole model: the engine asks for element ranges, one bucket at a time. A
tensor-parallel model's source holds the whole model under the whole tensors' names and shapes; the
engine reads each rank's local shard out of it (tp_shards)."""

from __future__ import annotations

from typing import Protocol

import torch


class ParameterSource(Protocol):
    """Values of parameters by the model's own parameter names (`module.named_parameters()`, tied
    parameters under their first name)."""

    def check(self, shapes: dict[str, torch.Size]) -> None:
        """Raise ValueError naming every parameter that is missing or has another shape. Called before
        any collective, on every rank (the engine agrees on the outcome)."""
        ...

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of parameter `name` flattened, as a 1-D CPU tensor of any floating
        dtype (the caller casts). Reads no more of the file than those elements need."""
        ...

    # A source may also have `initialised(names: list[str]) -> list[str]`: of the names of the model's parameters on
    # meta, those it does not hold and leaves to the modules' own initialisers (an adapter added to a pretrained base: the
    # base's files have no adapter). `check` is then asked about the others only, the initialisers run only
    # for the modules holding those names, and the random state ends where a whole build that loads the rest
    # (drawing nothing for it) leaves it.
    #
    # A source may also have `read_box(name, index: tuple[slice, ...]) -> Tensor`: the elements inside one
    # box of the tensor (a slice per dimension), shaped as the box. A tensor-parallel Shard(1) shard, a
    # column block of every row, is read with it in one call (tp_shards.read_local); without it, one `read`
    # per row.

