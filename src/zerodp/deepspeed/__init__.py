"""DeepSpeed's public training API over zerodp: `import zerodp.deepspeed as deepspeed`.

    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters())
    loss = engine(batch); engine.backward(loss); engine.step()

The one place that knows DeepSpeed's names: initialize's arguments and 4-tuple, the config's
"auto" values (auto.py), the engine's methods (engine.py), `zero.GatheredParameters` (zero.py), and
the modules scripts import beside `deepspeed`: `accelerator.get_accelerator()` (also `deepspeed.
get_accelerator`), `comm` (get_rank, barrier, all_reduce, ...), `ops.adam` (FusedAdam, DeepSpeedCPUAdam),
`utils` (logger, zero_to_fp32, timer.ThroughputTimer), `compression.helper`; `moe` is refused on import. Replacing
`deepspeed` by `zerodp.deepspeed` in a script's import lines is the whole port.
What maps to what, and what is refused, is in docs/DEEPSPEED.md.

Modules: accelerator.py (get_accelerator), comm.py (deepspeed.comm), construction.py (zero.Init's record of
what a constructor wrote, replayed at initialize), engine.py (DeepSpeedEngine), launch.py
(init_distributed), moe.py (refused), zero.py (GatheredParameters, Init); sub-packages compression/ (helper),
ops/ (adam), runtime/ (runtime.zero), utils/ (logger, timer, zero_to_fp32).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import zerodp
from zerodp.config import load_config, read_config_file
from zerodp.config.auto import resolve_auto
from zerodp.deepspeed import accelerator, comm, ops, utils, zero
from zerodp.deepspeed.accelerator import get_accelerator
from zerodp.deepspeed.construction import replay_for
from zerodp.deepspeed.engine import DeepSpeedEngine
from zerodp.deepspeed.launch import init_distributed, local_rank_from_launcher
from zerodp.engine.engine import Engine, inside

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "DeepSpeedEngine", "resolve_auto",
           "accelerator", "get_accelerator", "comm", "ops", "utils"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's --deepspeed, --deepspeed_config (and the deprecated --deepscale*) flags.

    Under torchrun, a `--local_rank` the script declared before this call defaults to LOCAL_RANK:
    DeepSpeed's launcher passes --local_rank=N, torchrun sets LOCAL_RANK=N instead, and the scripts
    branch on args.local_rank (-1: not distributed) before anything reads the environment."""
    launched = os.environ.get("LOCAL_RANK")
    if launched is not None and any(a.dest == "local_rank" for a in parser._actions):
        parser.set_defaults(local_rank=int(launched))
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Dataset | None = None,
               lr_scheduler: Any = None, distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: dict | str | None = None, mesh_param: Any = None,
               config_params: dict | str | None = None,
               weights: str | os.PathLike | None = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's initialize: (engine, optimizer, training_dataloader, lr_scheduler).

    optimizer: a torch optimizer, a callable params -> optimizer, or None for the config's 'optimizer'
    section (built on model_parameters: tensors or param-group dicts; default the model's).
    lr_scheduler: a scheduler built on that optimizer, a callable optimizer -> scheduler, or None for the
    config's 'scheduler' section. training_data: a dataset, served per rank by a DistributedSampler.
    weights (zerodp's, not DeepSpeed's): the parameters' values from files, each rank reading its share
    (zerodp.initialize's `weights`: an HF folder, a .safetensors file, a zerodp or DeepSpeed checkpoint).
    """
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mesh_param is not None:
        raise ValueError("mesh_param (sequence parallelism) is not supported; for tensor parallelism pass "
                         "mpu= (Megatron-style local shards), or parallelize the model with torch's "
                         "parallelize_module over mesh['tp'] of a (dp, tp) DeviceMesh and pass the mesh to "
                         "zerodp.initialize(..., device_mesh=mesh)")
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError("dist_init_required=False but torch.distributed is not initialised; initialise "
                           "it first, or pass dist_init_required=None")
    local_rank = local_rank_from_launcher(getattr(args, "local_rank", None))
    raw = _config_dict(args, config if config is not None else config_params)
    # Before any process group: the same config fails the same way on every rank, and
    # zerodp.initialize creates the group with the config's comm_timeout_s.
    cfg = load_config(resolve_auto(raw, _known(model, optimizer)))
    if optimizer is None and cfg.optimizer is None:
        # DeepSpeed builds an engine without an optimizer for any model, to run it forward (TRL's DPO
        # reference model, whose parameters keep requires_grad=True): nothing trains it, so it is frozen
        # here, which makes it zerodp's frozen-only engine (sharded at stage 3; backward/step refused).
        model.requires_grad_(False)
    elif optimizer is None and cfg.optimizer is not None:
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = cfg.optimizer.build([p for p in params if not torch.is_tensor(p) or p.requires_grad])
    elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and model_parameters is not None:
        optimizer = optimizer(model_parameters)  # DeepSpeed calls the factory on model_parameters
    # a model built under zero.Init: its constructor's writes, replayed module by module (None: none recorded)
    replay = replay_for(model) if weights is None else None
    engine = zerodp.initialize(model, optimizer, cfg, lr_scheduler=_scheduler_factory(lr_scheduler), weights=weights,
                               mpu=mpu, param_init_fn=replay)
    loader = None
    if training_data is not None:
        comm = inside(engine).comm
        sampler = DistributedSampler(training_data, num_replicas=comm.world_size, rank=comm.rank)
        loader = DataLoader(training_data, batch_size=inside(engine).spec.batch.micro_batch_size, sampler=sampler,
                            collate_fn=collate_fn)
    wrapped = DeepSpeedEngine(engine, loader)
    if hasattr(args, "local_rank"):
        args.local_rank = local_rank  # as DeepSpeed's engine aligns it, for the script's later reads
    zero.give_zero3_attributes(wrapped)
    if not isinstance(engine, Engine):  # a sharded module that trains nothing: DeepSpeed returns no optimizer
        return wrapped, None, loader, None
    return wrapped, engine.optimizer, loader, engine.lr_scheduler


def _config_dict(args: Any, config: dict | str | None) -> dict:
    """The raw config from config= / config_params= or args.deepspeed_config, as DeepSpeed picks it."""
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ValueError("a config was given both as args.deepspeed_config and as config=; give only one")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("DeepSpeed requires --deepspeed_config to specify configuration file, or config=")
    if isinstance(config, dict):
        return config
    return read_config_file(config)


def _known(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What "auto" may be filled from: the passed optimizer's hyperparameters, the model's width and
    precision. (Batch sizes are not known here: an "auto" one is derived from the others.)"""
    known: dict[str, Any] = {}
    if isinstance(optimizer, torch.optim.Optimizer):
        group = optimizer.param_groups[0]
        known.update({k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group})
        if torch.is_tensor(known.get("lr")):
            known["lr"] = float(known["lr"])
    hf = getattr(model, "config", None)
    hidden = getattr(hf, "hidden_size", None) or max(getattr(hf, "hidden_sizes", None) or [0]) or None
    if hidden is not None:
        known["hidden_size"] = int(hidden)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    known["fp16"], known["bf16"] = dtypes == {torch.float16}, dtypes == {torch.bfloat16}
    return known


def _scheduler_factory(lr_scheduler: Any) -> Callable | None:
    """zerodp takes a callable optimizer -> scheduler; a scheduler object must be on that optimizer."""
    if lr_scheduler is None or not hasattr(lr_scheduler, "step") or not hasattr(lr_scheduler, "optimizer"):
        return lr_scheduler

    def same(opt: torch.optim.Optimizer) -> Any:
        if lr_scheduler.optimizer is not opt:
            raise ValueError("the lr_scheduler object was built on another optimizer than the one the engine "
                             "steps (the config's 'optimizer' section builds a new one); pass the optimizer "
                             "too, or a callable optimizer -> scheduler")
        return lr_scheduler
    return same
