"""`deepspeed.zero`: GatheredParameters over the engine that trains the parameters; Init, which builds
a model on the meta device for initialize to materialise shard by shard.

DeepSpeed's stage 3 partitions each parameter; GatheredParameters makes the named ones whole inside
a `with` block and, with `modifier_rank`, keeps what that rank wrote into them (broadcast to every
rank, and into the fp32 masters). zerodp does the same at every stage: stages 0-2 hold parameters
whole already, so only the modifier_rank broadcast has work to do there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable

import torch
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
    if enabled and not engines and any(p.is_meta for p in params):
        raise ValueError("GatheredParameters was given parameters on the meta device (built under "
                         "deepspeed.zero.Init), which hold no values until deepspeed.initialize; read or "
                         "set them after initialize, inside GatheredParameters(..., modifier_rank=0)")
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
    """deepspeed.zero.Init: a model built inside the block is built on the meta device and holds no values
    (no rank holds it whole); zerodp.deepspeed.initialize then materialises on each rank only what its
    stage keeps, each module initialised by its reset_parameters() from rank 0's random state: the values
    a whole build with the same seed gives, bit for bit. `enabled=False`, or `module=` (a model built
    already), builds whole. DeepSpeed's other arguments (the group, remote_device, pin_memory, config,
    dtype, ...) concern its partitioning at construction, which initialize does here: accepted, unused.

    Weights set before initialize would be lost on meta: GatheredParameters refuses such parameters."""

    def __init__(self, module: nn.Module | None = None, *args, enabled: bool = True, **kwargs):
        self.enabled = enabled and module is None
        self._meta: torch.device | None = None

    def __enter__(self) -> "Init":
        if self.enabled:
            self._meta = torch.device("meta")
            self._meta.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._meta is not None:
            self._meta.__exit__(*exc)
            self._meta = None
