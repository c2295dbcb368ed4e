"""`deepspeed.zero`: GatheredParameters over the engine that trains the parameters; Init, which builds
a model on the meta device for initialize to materialise shard by shard; the ZeRO-3 attributes of
parameters (`ds_id`, `ds_status`, ...), which scripts read to find the parameters they must gather.

DeepSpeed's stage 3 partitions each parameter; GatheredParameters makes the named ones whole inside
a `with` block and, with `modifier_rank`, keeps what that rank wrote into them (broadcast to every
rank, and into the fp32 masters). zerodp does the same at every stage: stages 0-2 hold parameters
whole already, so only the modifier_rank broadcast has work to do there.

At stage 3 DeepSpeed gives each partitioned parameter `ds_*` attributes, and its fine-tuning scripts
gather exactly the parameters that carry them (`hasattr(p, "ds_id") and p.ds_status ==
ZeroParamStatus.NOT_AVAILABLE`), reading the others as they are. give_zero3_attributes does the same
for zerodp's stage-3 parameters, `ds_status` kept current by the engine's gatherer (Gatherer.watch).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from enum import Enum
from itertools import repeat
from typing import Iterable

import torch
from torch import nn

from zerodp.deepspeed.construction import Recorder
from zerodp.deepspeed.engine import DeepSpeedEngine, owner_of
from zerodp.engine.engine import inside
from zerodp.engine.layout.flat import Bucket
from zerodp.engine.sharding.gather import BucketState
from zerodp.engine.sharding.gathered_state import LoneCall

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]


class ZeroParamStatus(Enum):
    """DeepSpeed's state of a stage-3 parameter (`param.ds_status`)."""

    AVAILABLE = 1      # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's shard is held: the parameter itself is an empty tensor
    INFLIGHT = 3       # being gathered


_STATUS = {BucketState.RELEASED: ZeroParamStatus.NOT_AVAILABLE, BucketState.GATHERING: ZeroParamStatus.INFLIGHT,
           BucketState.GATHERED: ZeroParamStatus.AVAILABLE}
_ADVICE = ("save with engine.save_16bit_model(dir) on every rank (stage 3 needs zero_optimization."
           "stage3_gather_16bit_weights_on_model_save), or read the parameters inside "
           "deepspeed.zero.GatheredParameters(params) on every rank")


def give_zero3_attributes(engine: DeepSpeedEngine) -> None:
    """At stage 3 (only, as DeepSpeed), each partitioned parameter gets `ds_id` (its index in
    module.parameters()), `ds_numel` and `ds_shape` (whole), `ds_tensor` (this rank's elements of it, a
    flat view of this rank's shard: empty, part or all of it, since zerodp shards buckets, not each
    parameter), `ds_persist` (kept whole between forwards: its unit is under
    stage3_param_persistence_threshold; zerodp decides it per unit, DeepSpeed per parameter) and
    `ds_status`, a ZeroParamStatus kept current. Frozen parameters are partitioned too
    (a LoRA base: DeepSpeed-Chat's merge gathers the weights that have `ds_id`) and get them alike."""
    inner = engine.engine
    if not inside(inner).spec.gathers_per_unit:
        return
    index = {id(p): i for i, p in enumerate(inner.module.parameters())}
    layout = inside(inner).layout
    for b in layout.gathered:
        first = layout.shard_start(b)
        for s in b.slots:
            if id(s.param) not in index:  # a bitsandbytes layer's quantisation state, gathered with its weight
                continue
            lo, hi = max(s.offset, first), min(s.offset + s.numel, first + b.shard_numel)
            s.param.ds_id, s.param.ds_numel, s.param.ds_shape = index[id(s.param)], s.numel, s.shape
            s.param.ds_persist = b.persistent  # whole for good: its unit is under the persistence threshold
            s.param.ds_tensor = b.owned[lo - first:max(lo, hi) - first]
    params = {b.index: [s.param for s in b.slots if id(s.param) in index] for b in layout.gathered}

    def status(b: Bucket, state: BucketState) -> None:  # at each gather and release: no Python frame per parameter
        deque(map(setattr, params[b.index], repeat("ds_status"), repeat(_STATUS[state])), maxlen=0)
    inside(inner).sharded.watch_gathers(status)
    # DeepSpeed's state_dict() on some ranks only returns its placeholders (DeepSpeed-Chat's rank-0-only
    # save_hf_format writes them, and its every-rank save_zero_three_model overwrites the file at once)
    inside(inner).sharded.advise_on_lone_state_dict(_ADVICE, LoneCall.PLACEHOLDERS)


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
    stage keeps, module by module. What the constructor wrote (its layers' reset_parameters, a
    `self.apply(self._init_weights)`, a `fill_`) is recorded as it runs and replayed per module, each call
    from the random state a whole build has before it (construction.py): the values a whole build with the
    same seed gives, bit for bit, which are rank 0's as DeepSpeed keeps them; a write that cannot be replayed
    (through a view, reading another meta tensor) is refused at initialize naming the module. `enabled=False`,
    or `module=` (a model built already), builds whole. DeepSpeed's other arguments (the group,
    remote_device, pin_memory, config, dtype, ...) concern its partitioning at construction, which
    initialize does here: accepted, unused.

    Weights set between the block and initialize would be lost on meta: GatheredParameters refuses such
    parameters."""

    def __init__(self, module: nn.Module | None = None, *args, enabled: bool = True, **kwargs):
        self.enabled = enabled and module is None
        self._meta: torch.device | None = None
        self._recorder: Recorder | None = None  # the constructor's writes, while the block is open

    def __enter__(self) -> "Init":
        if self.enabled:
            self._meta = torch.device("meta")
            self._meta.__enter__()
            self._recorder = Recorder()
            self._recorder.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._recorder is not None:
            self._recorder.__exit__(*exc)
            self._recorder = None
        if self._meta is not None:
            self._meta.__exit__(*exc)
            self._meta = None
