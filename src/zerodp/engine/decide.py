"""The engine's facts decided once, by one local check: the ZeRO stage, the batch sizes, the shard size,
the working precision, the device, where the parameters' values come from and stage 3's units.

`local_check` runs on each rank alone, before any collective: whatever it raises, the engine's set-up
agreement (Comm.agree) makes every rank raise, so no rank is left waiting in a collective. What it
returns is frozen (layout/spec.py's EngineSpec): the rest of the engine reads these facts and never
derives them again.
"""

from __future__ import annotations

import hashlib
import itertools
import sys

import torch
from torch import nn
from torch.optim import Optimizer

from zerodp.config import BatchSizes, Config, ConfigError
from zerodp.distributed.comm import Comm
from zerodp.distributed.device import device_of_backend
from zerodp.engine.layout import formats
from zerodp.engine.layout.layout import frozen_params
from zerodp.engine.layout.spec import EngineSpec, OptimizerView
from zerodp.engine.layout.units import UnitRule, find_units, unit_rule
from zerodp.engine.setup import fill
from zerodp.engine.setup.fill import Filling, filling_for
from zerodp.engine.setup.initialisers import ParamInitFn
from zerodp.engine.setup.source import ParameterSource
from zerodp.engine.stepping.cpu_bf16 import warn_if_slow_bf16
from zerodp.engine.stepping.optimizer_view import OptimizerLike, Optimizers, probe_class, refusal, view_of
from zerodp.engine.tensor_parallel import placements as tensor_parallel
from zerodp.engine.tensor_parallel import whole as whole_over_tp
from zerodp.monitor.writers import check_available


def local_check(config: Config, comm: Comm, module: nn.Module, optimizer: OptimizerLike | None,
                source: ParameterSource | None, param_init_fn: ParamInitFn | None,
                stage3_unit: UnitRule | None
                ) -> tuple[EngineSpec, Filling, OptimizerLike, list[list[nn.Parameter]]]:
    """Everything about the set-up that this rank can check alone: the spec, where the values come from, the optimizer (the config's
    when none is given; for a frozen-only engine one over no parameter) and the trained parameters of
    each optimizer param group. No collective."""
    zero = config.zero_optimization
    stage = zero.stage
    trains = optimizer is not None or config.optimizer is not None
    if trains or config.train_batch_size is not None or config.train_micro_batch_size_per_gpu is not None:
        batch = config.batch(comm.world_size)
    else:  # a frozen-only engine takes no step: no batch size to check (its forward takes any batch)
        batch = BatchSizes(comm.world_size, 1, 1)
    shard_size = zero.shard_size(comm.world_size)
    if comm.mesh is not None:  # the mesh's shard dimension is S, unless the key says otherwise
        if zero.mics_shard_size not in (-1, comm.shard_size):
            raise ConfigError(f"zero_optimization.mics_shard_size {zero.mics_shard_size} disagrees with the "
                              f"device mesh's shard dimension {comm.shard_size}; give one of them, "
                              "or the same S in both")
        if stage == 0:
            raise ConfigError("a device mesh shards model states, which stage 0 does not do; use stage 1, "
                              "2 or 3, or leave device_mesh out")
        shard_size = comm.shard_size
    elif comm.tp is not None:  # an mpu: its groups are the only ones, and stage 0 would not reduce the norm
        if stage == 0 or shard_size != comm.world_size:
            raise ConfigError(f"with an mpu (tensor parallelism), ZeRO shards over the whole data-parallel group "
                              f"at stage 1, 2 or 3: got stage {stage}, shard size {shard_size} of "
                              f"{comm.world_size}; use stage 1-3 and leave zero_optimization.mics_shard_size out")
    if not trains and any(p.requires_grad for p in module.parameters()):
        raise ConfigError("no optimizer: pass one to zerodp.initialize or give the config an "
                          "'optimizer' section, e.g. {'type': 'AdamW', 'params': {'lr': 1e-3}}; a model that "
                          "is not trained (a reference or teacher model) is wrapped without one once none "
                          "of its parameters requires grad (model.requires_grad_(False))")
    if optimizer is None:
        optimizer = config.optimizer.for_model(module) if trains else _nothing_to_step
    if isinstance(optimizer, (list, tuple)):
        optimizer = _combined(optimizer)
    groups = _trainable_groups(module, optimizer)
    if trains:
        _check_model(module, groups)
    tensor_parallel.check(module, comm, source is not None)
    views = _views(module, optimizer, groups, None if comm.tp is None else comm.tp.world_size)
    filling = filling_for(module, source, param_init_fn)
    formats.check(module, {id(p) for g in groups for p in g}, filling.from_source)
    _check_trained_dtypes(module, groups, config.dtype)
    units = find_units(module, unit_rule(zero, stage3_unit)) if stage == 3 else None
    device = _device_of(module, comm)
    check_available(config)  # an enabled monitor's package is missing: every rank hears of it
    # config/zero_optimization.py resets offload_param below stage 3.
    spec = EngineSpec(stage, batch, shard_size, config.dtype, device, units,
                      zero.offload_param.device in ("cpu", "nvme"), views, shards_frozen=stage == 3, trains=trains,
                      params_on_disk=zero.offload_param.device == "nvme")
    return spec, filling, optimizer, groups


def _combined(optimizers: list | tuple) -> Optimizers:
    """Several optimizers over disjoint parameters (Muon on the matrices, AdamW on the rest), as one."""
    if not optimizers or not all(isinstance(o, Optimizer) for o in optimizers):
        raise TypeError("a list of optimizers must hold torch.optim.Optimizer objects built on disjoint parameters "
                        f"of the model, got [{', '.join(type(o).__name__ for o in optimizers)}]")
    return Optimizers(optimizers)


def _views(module: nn.Module, optimizer: OptimizerLike, groups: list[list[nn.Parameter]],
           tp_size: int | None) -> tuple[OptimizerView, ...]:
    """Each param group's OptimizerView; an optimizer zerodp cannot step exactly is refused by name, as is a
    shape-aware one on a tensor-parallel shard that cannot be gathered into its whole matrix for the step
    (whole_over_tp.refusal: stepped as it is, it would treat a piece of the matrix as the matrix)."""
    if isinstance(optimizer, Optimizers):
        classes = [type(o) for o in optimizer.group_owners()]
    elif isinstance(optimizer, Optimizer):
        classes = [type(optimizer)] * len(groups)
    else:
        classes = [probe_class(optimizer)] * len(groups)
    for cls in dict.fromkeys(classes):
        reason = refusal(cls)
        if reason is not None:
            raise ValueError(f"optimizer {cls.__name__} is not supported by zerodp: {reason}")
    views = tuple(view_of(cls) for cls in classes)
    names = {id(p): n for n, p in module.named_parameters()}
    for cls, view, params in zip(classes, views, groups):
        for p in params if view is OptimizerView.WHOLE_PARAMETERS else ():
            reason = whole_over_tp.refusal(names[id(p)], p, tp_size)
            if reason is not None:
                raise ValueError(f"optimizer {cls.__name__} steps whole parameters (its update depends on a "
                                 f"parameter's shape), and a tensor-parallel shard is stepped as its whole matrix, "
                                 f"gathered over tp; {reason}. Or step that parameter with an element-wise "
                                 "optimizer (AdamW, ...), e.g. in a second optimizer of a list")
    return views


def _nothing_to_step(groups: list[dict]) -> Optimizer:
    """A frozen-only engine's optimizer: over no parameter (torch accepts a group with an empty list), so
    that the engine's parts are those of any engine; backward() and step() refuse before reaching it."""
    return torch.optim.SGD(groups, lr=0.0)


def _check_model(module: nn.Module, groups: list[list[nn.Parameter]]) -> None:
    """What this rank can tell about the model on its own, before any collective. (Tensors on meta are
    fill.filling_for's to check.)"""
    if not any(groups):
        raise ValueError("the model has no trainable parameters (none has requires_grad=True, or the "
                         "optimizer holds none), so there is nothing to train; set requires_grad=True on "
                         "the parameters to train before zerodp.initialize")


def _check_trained_dtypes(module: nn.Module, groups: list[list[nn.Parameter]], working: torch.dtype) -> None:
    """A trained parameter is fp32 (its values start the fp32 master; under bf16/fp16 its working copy is cast
    as the config asks) or already the working precision. Any other dtype (a bf16 parameter trained under an
    fp32 config, an fp16 one under bf16) would be cast without being asked: refused by name."""
    names = {id(p): n for n, p in module.named_parameters()}
    odd = [f"'{names.get(id(p), '?')}' ({p.dtype})" for g in groups for p in g
           if p.dtype not in (torch.float32, working)]
    if odd:
        raise ValueError(f"{len(odd)} trained parameter(s) are in a dtype that is neither fp32 nor the working "
                         f"precision {working} (the config's bf16/fp16 section; fp32 without one): "
                         f"{', '.join(odd[:3])}. zerodp would have to cast them; make them fp32 (PEFT: "
                         "autocast_adapter_dtype=True, the default) or set the config's precision to theirs. "
                         "Frozen parameters may keep any dtype (docs/CONFIG.md, 'Dtypes').")


def _device_of(module: nn.Module, comm: Comm) -> torch.device:
    devices = {p.device for p in module.parameters() if not p.is_meta}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices {sorted(map(str, devices))}; "
                         "zerodp needs the whole model on one device per rank")
    on_backend = device_of_backend(comm.backend)  # an accelerator's backend: its current device
    if on_backend is not None:
        return on_backend
    return devices.pop() if devices else torch.device("cpu")


def _trainable_groups(module: nn.Module, optimizer: OptimizerLike) -> list[list[nn.Parameter]]:
    """The trainable parameters of each optimizer param group, checked against the model."""
    params = list(module.parameters())
    names = {id(p): n for n, p in module.named_parameters()}
    if not isinstance(optimizer, Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable params -> "
                            f"Optimizer, got {type(optimizer).__name__}")
        return [[p for p in params if p.requires_grad]]
    groups, seen = [], set()
    for i, group in enumerate(optimizer.param_groups):
        kept = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer param group {i} holds a tensor of shape {tuple(p.shape)} "
                                 "that is not a parameter of the model")
            if id(p) in seen:
                raise ValueError(f"parameter '{names[id(p)]}' appears in more than one optimizer param group")
            seen.add(id(p))
            if p.requires_grad:
                kept.append(p)
        groups.append(kept)
    for p in params:
        if p.requires_grad and id(p) not in seen:
            raise ValueError(f"parameter '{names[id(p)]}' requires grad but is in no optimizer param "
                             "group; add it to the optimizer or set requires_grad=False")
    return groups


def agreed_set_up(module: nn.Module, optimizer: OptimizerLike | None, config: Config, comm: Comm,
                  source: ParameterSource | None, param_init_fn: ParamInitFn | None, stage3_unit: UnitRule | None
                  ) -> tuple[EngineSpec, Filling, OptimizerLike, list[list[nn.Parameter]]]:
    """(the spec, where the values come from, the optimizer, the trained parameters of each of its param
    groups), agreed by every rank (zerodp.initialize meets this agreement directly when its config failed to
    load): the local check, the module moved to its device, then the first collective, in which every rank
    reports ok or its error (Comm.agree); then the checks that need the others."""
    error = spec = filling = None
    try:
        spec, filling, optimizer, groups = local_check(config, comm, module, optimizer, source, param_init_fn,
                                                       stage3_unit)
        if any(t.device != spec.device and not t.is_meta for t in itertools.chain(module.parameters(),
                                                                                  module.buffers())):
            fill.move_to(module, spec.device)  # only when needed: a model already there may hold fake tensors
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others hang
        error = e
    comm.agree(error, "zerodp.initialize")
    _check_same_everywhere(module, config, comm, filling)
    _bound_collectives(config, comm)
    warn_if_slow_bf16(spec.device, spec.dtype, comm.rank)
    comm.split(spec.shard_size)  # hierarchical sharding's groups (nothing when flat)
    in_buffers = groups + ([frozen_params(module, groups)] if spec.shards_frozen else [])
    # How the sharding collectives run on this backend (a probe on gloo), before the model's memory is taken:
    # the probe's transient buffers then add nothing to set-up's peak. Nothing is sharded at stage 0.
    sharded = sum(p.numel() for g in in_buffers for p in g) if spec.shards_optimizer or spec.gathers_per_unit else 0
    comm.choose_collectives(config.collectives, sharded)
    fill.start(filling, comm, spec.device, {id(p) for g in in_buffers for p in g})
    return spec, filling, optimizer, groups


def _check_same_everywhere(module: nn.Module, config: Config, comm: Comm, filling: Filling) -> None:
    """Every rank must wrap the same model with the same config, or collectives would mismatch."""
    if comm.world_size == 1 or comm.is_fake():
        return
    sig = [(n, tuple(p.shape), str(p.dtype), p.requires_grad, "meta" if p.is_meta else "built")
           for n, p in module.named_parameters()]
    sig.append(("the values come from", filling.origin))  # a broadcast, or each rank's own reads
    text = repr(sig) + config.model_dump_json()
    digests = comm.all_gather_object(hashlib.sha256(text.encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    sigs = comm.all_gather_object((sig, config.model_dump()))
    for r, (other, cfg) in enumerate(sigs):
        if cfg != sigs[0][1]:
            raise ValueError(f"rank {r} was given a different config from rank 0; every rank "
                             "must pass the same config")
        for a, b in zip(sigs[0][0], other):
            if a != b:
                raise ValueError(f"rank {r} has a different model from rank 0: parameter "
                                 f"{b} where rank 0 has {a}")
        if len(other) != len(sigs[0][0]):
            raise ValueError(f"rank {r} has {len(other)} parameters, rank 0 has {len(sigs[0][0])}")


def _bound_collectives(config: Config, comm: Comm) -> None:
    """From here on every collective of the engine waits at most comm_timeout_s, when the config gives
    it, whoever created the process group (Comm.bound); a group torch cannot bound is named in one line
    with what to set instead. Not given, the groups keep their own timeouts (a group zerodp creates has
    the key's default)."""
    given = "comm_timeout_s" in config.model_fields_set
    seconds = config.comm_timeout_s
    comm.notify_waits(config.wait_notice_s)  # and a wait longer than wait_notice_s says so, timeout or not
    for reason in comm.bound(seconds if given else None):
        if comm.everyone.rank == 0:
            print(f"[zerodp] comm_timeout_s={seconds:g} cannot bound zerodp's collectives on {reason}; they wait "
                  f"as long as that group's own timeout: create it with timeout=datetime.timedelta(seconds="
                  f"{seconds:g}) instead", file=sys.stderr, flush=True)
