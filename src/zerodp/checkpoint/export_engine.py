"""A trained engine's weights written as files without gathering the model: every rank sends one
bucket at a time (engine.weights.engine_weights) and rank 0 writes each tensor where it goes as it
arrives, so no rank, the writer included, holds more than its shard and one bucket (and, under tensor
parallelism, the one whole tensor joined over the tp group). Collective: call these on every rank.

  save_weights   one torch.save file of the state dict ({name: tensor}; `zerodp train`'s final.pt,
                 zerodp.deepspeed's save_16bit_model), optionally cast and filtered
  save_final     final.pt and, for a Hugging Face model, the HF folder, from one pass over the buckets
  save_hf        an HF folder (a PEFT model's: its base and its adapter, in one folder)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerodp.engine.engine import inside
from zerodp.engine.sharding.weights import Weights
from zerodp.models import hf_folder, hf_peft
from zerodp.models.weight_files import TorchSaveFile, write_all

if TYPE_CHECKING:
    from zerodp.engine.engine import Engine

ADAPTER = "adapter"  # a PEFT model's adapter folder inside its HF folder (save_hf)


def save_weights(engine: Engine, path: str | os.PathLike, dtype: torch.dtype | None = None,
                 names: set[str] | None = None) -> None:
    """The weights as one torch.save'd state dict at `path`, written by rank 0; floating tensors cast
    to `dtype` when given; only `names` when given."""
    weights = _select(inside(engine).weights(), dtype, names)
    if not _writes(engine):
        weights.drain()
        return
    file = TorchSaveFile(path, weights.shapes, weights.ties)
    write_all(weights.stream, {n: [(file, n)] for n in weights.shapes if n not in weights.ties})


def save_final(engine: Engine, out: Path, hf: dict[str, Any] | None) -> list[str]:
    """`out/final.pt` (fp32, keyed like module.state_dict()) and, when `hf` describes a Hugging Face
    model (hf_folder.description), the folder `out/hf` that from_pretrained loads; returns the HF
    writer's notes (rank 0)."""
    weights = inside(engine).weights()
    writer = _writes(engine)
    file = TorchSaveFile(out / "final.pt", weights.shapes, weights.ties) if writer else None
    errors: list[Exception] = []
    teed = Weights(weights.shapes, weights.ties, _tee(weights.stream, file, errors))
    if hf is not None:
        notes = hf_folder.write_folder(out / "hf", teed, hf, writer=writer)
    else:
        teed.drain()
        notes = []
    if file is not None:
        file.close()
    if errors:
        raise errors[0]
    return notes


def save_hf(engine: Engine, out: str | os.PathLike, description: dict[str, Any]) -> list[str]:
    """The HF folder of `description`'s model at `out`, written by rank 0; returns its notes. A PEFT model's
    is the folder of its base (a QLoRA base as bitsandbytes writes it: packed words and quantisation state)
    and, in `out/adapter`, PEFT's adapter folder, loaded as users load a base and an adapter:
    `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out), out / "adapter")`. (Not in `out`
    itself: from_pretrained would load an adapter found there on its own, in the base's dtype, and PEFT
    would then add it a second time.)"""
    weights, module, writer = inside(engine).weights(), inside(engine).module, _writes(engine)
    peft = hf_peft.split_adapter(module, weights, keep=writer)
    if peft is None:
        return hf_folder.write_folder(out, weights, description, writer=writer)
    base, adapter = peft
    notes = hf_folder.write_folder(out, base, description, writer=writer)  # fills `adapter` as it streams
    if writer:
        module.save_pretrained(os.path.join(out, ADAPTER), state_dict=adapter)  # PEFT picks and names them
    return notes


def _writes(engine: Engine) -> bool:
    """Whether this rank writes: one rank of the whole job (with tensor parallelism, rank 0 of every
    dp group holds the same whole tensors, and each would write them)."""
    return inside(engine).comm.everyone.rank == 0


def _tee(stream: Iterable[tuple[str, torch.Tensor]], file: TorchSaveFile | None, errors: list[Exception]
         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, each tensor also written to `file` (when there is one). A failed write is kept in
    `errors` and the stream goes on, so that no rank is left waiting in a collective."""
    for name, tensor in stream:
        if file is not None and not errors:
            try:
                file.put(name, tensor)
            except (OSError, ValueError) as e:
                errors.append(e)
        yield name, tensor
        del tensor  # before the stream makes its next bucket


def _select(weights: Weights, dtype: torch.dtype | None, names: set[str] | None) -> Weights:
    """Only `names` (an alias kept only with its tensor's name), floating tensors cast to `dtype`, except
    bitsandbytes' quantized words and their quantisation state, which are written as bitsandbytes reads them."""
    keep = set(weights.shapes) if names is None else names
    renamed: dict[str, str] = {}  # a name left out whose alias is kept: its values go by the alias
    for alias, name in weights.ties.items():
        if alias in keep and name not in keep:
            renamed.setdefault(name, alias)
    ties = {a: renamed.get(n, n) for a, n in weights.ties.items() if a in keep and a != renamed.get(n)}

    beside = hf_folder.quant_entries(weights.shapes)
    exact = set(beside).union(*beside.values())  # packed words in bf16 storage may read as NaNs: never cast

    def cast(n: str, d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point and n not in exact else d

    shapes = {n: (s, cast(n, d)) for n, (s, d) in weights.shapes.items() if n in keep}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in weights.stream:
            if n in keep or n in renamed:
                yield renamed.get(n, n), t.to(cast(n, t.dtype))
            del t  # before the stream makes its next one (a generator expression would hold it)
    return Weights(shapes, ties, stream())
