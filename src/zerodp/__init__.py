"""zerodp: ZeRO data parallelism for any PyTorch model.

    engine = zerodp.initialize(model, optimizer, config)
    loss = engine(x, y); engine.backward(loss); engine.step()

The package, one line a room (DESIGN.md's layout has the map):
  engine/        one training step, sharded: its rooms (layout, tensor_parallel, setup, sharding, stepping)
  distributed/   the process group, its collectives and the device
  config/        DeepSpeed's config keys, strict
  checkpoint/    sharded save / load, DeepSpeed checkpoints in, export
  models/        the models the commands train, Hugging Face folders in and out
  plan/          `zerodp estimate`: the paper's formulas, the planned and measured peaks, communication
  monitor/       what training reports
  deepspeed/     `import zerodp.deepspeed as deepspeed`
  integrations/  the HF Trainer, TRL and Lightning on the engine
  train/         `zerodp train`, the main job
  bench/         `zerodp bench`
  activations.py activation checkpointing (checkpoint_blocks), CPU offload of its inputs
  cli.py         `zerodp train | estimate | consolidate | bench`
  lazy.py        names imported on first use; the pip extras
  sizes.py       sizes the engine, the config and the formulas share, torch-free
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from zerodp.distributed.accelerate import check_same_world  # torch-free, as this module must be
from zerodp.lazy import lazy_names

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import nn

    from zerodp.config import Config
    from zerodp.engine.engine import Engine
    from zerodp.engine.layout.units import UnitRule
    from zerodp.engine.setup.source import ParameterSource
    from zerodp.engine.sharding.module import ShardedModule
    from zerodp.engine.stepping.optimizer_view import OptimizerLike

# The public names, each imported from its module on first use (PEP 562): `import zerodp` does not
# import torch, so `zerodp --help` and every command's --help answer before torch loads.
_LAZY = {
    "checkpoint_blocks": "activations",
    "DEFAULT_TIMEOUT_S": "distributed.comm", "Comm": "distributed.comm", "PeerFailure": "distributed.failures",
    "init_distributed": "distributed.comm",
    "Config": "config", "ConfigError": "config", "load_config": "config",
    "Engine": "engine.engine", "ShardedModule": "engine.sharding.module", "step_timings": "engine.engine",
    "NonFiniteError": "engine.stepping.non_finite",
    "OptimizerLike": "engine.stepping.optimizer",
}

# Activation checkpointing is zerodp.activations.checkpoint / zerodp.checkpoint_blocks: the name
# zerodp.checkpoint belongs to the sharded save/load module (DESIGN.md's layout).
__all__ = ["initialize", "shard", "Engine", "ShardedModule", "step_timings", "Config", "ConfigError", "load_config",
           "init_distributed", "checkpoint_blocks", "PeerFailure", "NonFiniteError"]


__getattr__ = lazy_names(__name__, _LAZY, submodules=True)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def initialize(model: nn.Module, optimizer: OptimizerLike | None = None,
               config: Config | dict | str | None = None, process_group: dist.ProcessGroup | None = None,
               lr_scheduler: Callable | None = None, device_mesh=None, stage3_unit: UnitRule | None = None,
               param_init_fn: Callable[[nn.Module], None] | None = None,
               weights: str | os.PathLike | ParameterSource | None = None, mpu=None) -> Engine | ShardedModule:
    """Wrap `model` for ZeRO training: an Engine; when nothing trains (no optimizer given nor configured, no
    parameter requiring grad: a reference or teacher model), the ShardedModule `shard` returns.

    optimizer: an optimizer built on model.parameters() (its param groups and hyperparameters are
      kept; it is rewired to step on this rank's fp32 master shard), a callable params -> Optimizer,
      or None to build the config's 'optimizer' section.
    config: a dict, a path to a DeepSpeed-style JSON file, or a zerodp.Config.
    process_group: the data-parallel group; by default the world, initialised from torchrun's
      environment (NCCL on CUDA, gloo otherwise) or as a world of one when there is none.
    lr_scheduler: a callable optimizer -> scheduler, stepped after every step that is not skipped.
    device_mesh: a 2-D torch DeviceMesh (replicate, shard) over the data-parallel ranks: model states
      are sharded along its second dimension and replicated along its first (as the config key
      zero_optimization.mics_shard_size does with groups zerodp builds). Or a mesh over the world whose
      dimension names give the roles: "dp" (or "dp_shard" with an optional "dp_replicate") is what ZeRO
      partitions over, "tp" the dimension the model was tensor-parallelized over beforehand with
      torch's parallelize_module(model, mesh["tp"], plan) (docs/CONFIG.md, "Tensor parallelism").
    stage3_unit: what stage 3 gathers and reduces as one unit, as zero_optimization.stage3_unit
      (which it replaces; give one of the two): "blocks", "module", a list of module classes, class
      names or module names, or a function module -> bool choosing the units' root modules.
    param_init_fn: for a model built on the 'meta' device (under `torch.device("meta")`), fn(module)
      initialises one module's own parameters and buffers, as FSDP1's param_init_fn; by default a Hugging
      Face model's own _init_weights (rotary tables, which no file holds, computed), else reset_parameters().
      Each rank then materialises only what its stage keeps, one bucket at a time, running the
      initialisers module by module from rank 0's random state: the same values, bit for bit, as
      building the model whole with that seed.
    weights: where the parameters' values come from instead of the model's own: a Hugging Face folder
      (save_pretrained's: model.safetensors, or shards with model.safetensors.index.json), a .safetensors
      file, a zerodp or DeepSpeed checkpoint directory (zerodp.checkpoint.weights.open_weights), or a
      zerodp.engine.setup.source.ParameterSource. Every rank reads only the elements it keeps; a parameter the
      files lack or hold in another shape, or a tensor of theirs the model lacks, is an error naming it. A PEFT
      model reads its base from the base model's files; its LoRA is initialised as PEFT does (models/hf_peft).
    mpu: instead of device_mesh, Megatron's parallel_state or DeepSpeed's mpu (its data- and tensor-parallel
      groups), for a model whose tp parameters are plain local shards marked `tensor_model_parallel=True`
      (or `model_parallel=True`); ZeRO partitions over the dp group (docs/CONFIG.md, "Tensor parallelism").

    A set-up error on any rank (config, device, optimizer, ...) raises on every rank: the first
    collective is an agreement in which every rank reports ok or its error (Comm.agree).
    """
    import zerodp.checkpoint as checkpoint_io
    from zerodp.distributed.comm import DEFAULT_TIMEOUT_S, Comm, init_distributed
    from zerodp.engine.engine import inside, wrap
    from zerodp.engine.summary import log_set_up
    check_same_world()  # a script's Accelerator: every process sees the same two counts, so each refuses alone
    cfg, source, error = _local_inputs(config, weights, model)
    if param_init_fn is None and error is None:  # None still, unless a Hugging Face or PEFT model is on meta
        param_init_fn, error = _default_init_fn(model, source)
    init_distributed(timeout_s=cfg.comm_timeout_s if cfg is not None else DEFAULT_TIMEOUT_S)
    comm = Comm(process_group, mesh=device_mesh, mpu=mpu)
    if error is not None:
        comm.agree(error, "zerodp.initialize")  # meets the agreement in the other ranks' wrap()
    wrapped = wrap(model, optimizer, cfg, comm, lr_scheduler, stage3_unit, checkpoint_io=checkpoint_io,
                   source=source, param_init_fn=param_init_fn)
    log_set_up(cfg, comm.world_size, inside(wrapped).spec.shard_size, comm.everyone.rank,
               forward_only=not inside(wrapped).spec.trains, collectives=comm.plan.describe())
    return wrapped


def shard(model: nn.Module, config: Config | dict | str | None = None,
          process_group: dist.ProcessGroup | None = None, device_mesh=None,
          stage3_unit: UnitRule | None = None, param_init_fn: Callable[[nn.Module], None] | None = None,
          weights: str | os.PathLike | ParameterSource | None = None, mpu=None) -> ShardedModule:
    """Shard `model`, which trains nothing (a DPO reference model, a distillation teacher), over the data-parallel
    ranks, as FSDP2's fully_shard does and DeepSpeed's initialize(model=...) without an optimizer: at stage 3
    each rank holds 1/N of its parameters, gathered per unit in its forward; below stage 3 every rank holds it
    whole. No optimizer, reducer, loss scaler or gradient hook exists for it. The arguments are initialize's;
    every parameter must have requires_grad=False (model.requires_grad_(False)) and the config no 'optimizer'."""
    from zerodp.config import load_config
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    if trained or load_config(config).optimizer is not None:  # (the same on every rank: before any collective)
        what = (f"{len(trained)} parameters require grad (the first: '{trained[0]}')" if trained
                else "the config has an 'optimizer' section")
        raise ValueError(f"zerodp.shard wraps a model that trains nothing, but {what}; call "
                         "model.requires_grad_(False) and leave the optimizer out, or use zerodp.initialize "
                         "with an optimizer to train it")
    return initialize(model, None, config, process_group, None, device_mesh, stage3_unit, param_init_fn, weights, mpu)


def _local_inputs(config, weights, model: nn.Module) -> tuple[Config | None, ParameterSource | None,
                                                                 Exception | None]:
    """The config and the weights' source, read before the process group exists (the config's timeout is
    the group's); an error is returned, not raised, for every rank to agree on."""
    from zerodp.config import load_config
    try:
        cfg = load_config(config)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others hang
        return None, None, e
    source, error = _weights_source(weights, model)
    return cfg, source, error


def _default_init_fn(model: nn.Module, source: ParameterSource | None) -> tuple[Callable | None, Exception | None]:
    """(HF's initialiser of a model on meta, with PEFT's for its LoRA adapters, or the error to agree on)."""
    from zerodp.models import hf_folder, hf_peft

    left = getattr(source, "initialised", None)  # the parameters the weights leave to the initialisers
    try:
        return hf_peft.init_fn(model, hf_folder.init_fn(model), None if source is None else
                               set(left([n for n, p in model.named_parameters() if p.is_meta]) if left else [])), None
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others hang
        return None, e


def _weights_source(weights, model: nn.Module) -> tuple[ParameterSource | None, Exception | None]:
    """(the ParameterSource `weights` names, or the error to agree on): headers and metadata only."""
    if weights is None:
        return None, None
    if not isinstance(weights, (str, os.PathLike)):
        if all(callable(getattr(weights, m, None)) for m in ("check", "read")):
            return weights, None
        return None, TypeError(f"weights must be a path (an HF folder, a .safetensors file, a zerodp or DeepSpeed "
                               f"checkpoint) or a ParameterSource, got {type(weights).__name__}")
    from zerodp.checkpoint.weights import open_weights
    from zerodp.models.hf_peft import weight_names
    try:  # a PEFT model's base is read under the base model's own names
        return open_weights(weights, model, *weight_names(model)), None
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others hang
        return None, e
