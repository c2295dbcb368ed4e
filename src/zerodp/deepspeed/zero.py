"""`deepspeed.zero`: GatheredParameters over the engine that trains the parameters.

DeepSpeed's stage 3 partitions each parameter; GatheredParameters makes the named ones whole inside
a `with` block and, with `modifier_rank`, keeps what that rank wrote into them (broadcast to every
rank, and into the fp32 masters). zerodp does the same at every stage: stages 0-2 hold parameters
whole already, so only the modifier_rank broadcast has work to do there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable

from torch import nn

from zerodp.deepspeed.engine import owner_of

__all__ = ["GatheredParameters", "Init"]


@contextmanager
def GatheredParameters(params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                       fwd_module: nn.Module | None = None, enabled: bool = True):
    """Parameters whole inside the block on every rank; with modifier_rank, that rank's changes kept.

    Collective when the parameters belong to a zerodp.deepspeed engine (call on every rank);
    parameters of no engine (not yet initialised) are whole anyway, and the block then does nothing.
    """
    params = [params] if isinstance(params, nn.Parameter) else [p for p in params if p is not None]
    engines = {id(e): e for p in params if (e := owner_of(p)) is not None}
    if not enabled or not engines:
        yield
        return
    if len(engines) > 1:
        raise ValueError("GatheredParameters was given parameters of several engines; gather each "
                         "engine's parameters in a block of its own")
    engine = next(iter(engines.values()))
    with engine.engine.gathered_parameters(params, modifier_rank):
        yield


class Init:
    """deepspeed.zero.Init builds a model already partitioned; zerodp partitions in initialize.

    Accepted so that scripts run unchanged: it builds the model whole (enabled or not), and
    zerodp.deepspeed.initialize partitions it. Peak memory at construction is the whole model."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self) -> "Init":
        return self

    def __exit__(self, *exc) -> None:
        return None
