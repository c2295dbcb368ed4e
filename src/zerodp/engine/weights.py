"""A model's weights as a stream of whole tensors, never all of them held at once.

`Weights` is what an exporter writes: every name of `module.state_dict()` with its shape and dtype,
known before any value (a file's layout is fixed first), the names that share a tensor with another
(ties), and the values, each once, in whatever order they become available. `engine_weights` gives
a trained engine's: the fp32 master values bucket by bucket (each bucket's shards gathered from its
owners, so every rank takes part and holds one bucket at a time), then the buffers and frozen
parameters, which every rank holds whole. `Engine.full_state_dict` is the same values all at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zerodp.engine.tensor_parallel import refuse

if TYPE_CHECKING:
    from zerodp.engine.engine import Engine


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


def engine_weights(engine: Engine) -> Weights:
    """The engine's weights keyed like module.state_dict(): trained parameters as their fp32 masters,
    floating buffers and frozen parameters in fp32, the rest as they are. Iterating the stream is a
    collective (stages 1-3 gather each bucket from its owners): every rank must iterate it to the end."""
    refuse(engine.comm, "exporting the weights (engine_weights: the Hugging Face export, zerodp consolidate)")
    engine.wait_for_parameters()
    layout = engine.layout
    slots = layout.by_param()
    shapes, ties, first = {}, {}, {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in slots:
            shapes[name] = (layout.shape_of(slots[id(t)][1]), torch.float32)
        else:
            shapes[name] = (t.shape, torch.float32 if t.is_floating_point() else t.dtype)
        if id(t) in first:
            ties[name] = first[id(t)]
        else:
            first[id(t)] = name
    return Weights(shapes, ties, _stream(engine, first))


def _stream(engine: Engine, first: dict[int, str]) -> Iterator[tuple[str, torch.Tensor]]:
    trained = set()
    for b in engine.layout.buckets:
        full = engine.full_master(b)  # one bucket, fp32, on every rank
        for s in b.slots:
            trained.add(id(s.param))
            yield first[id(s.param)], full[s.offset:s.offset + s.numel].view(engine.layout.shape_of(s))
        del full
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) not in trained and first.get(id(t)) == name:
            yield name, t.detach().float() if t.is_floating_point() else t.detach()
