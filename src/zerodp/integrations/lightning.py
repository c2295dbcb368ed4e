"""Lightning on zerodp: `ZeroStrategy` for `lightning.Trainer`, `ZeroFabricStrategy` for `lightning.Fabric`.

    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy({"zero_optimization": {"stage": 2}}))
    fabric = lightning.Fabric(accelerator="cpu", devices=2, strategy=ZeroFabricStrategy({"zero_optimization": {"stage": 2}}))

or by name: strategy="zerodp" (stage 2), "zerodp_stage_1" / "_2" / "_3", "zerodp_stage_2_offload",
"zerodp_stage_3_offload" (both registries). Both strategies are Lightning's DDP strategies (process launch,
process group, sampler, reduce / barrier for `self.log(sync_dist=True)`) with zerodp in place of DDP, as Lightning's
DeepSpeed strategy is; the config is what `zerodp.initialize` takes. What Lightning owns and zerodp takes over:
  precision          "32-true", "bf16-mixed", "16-mixed" become the config's fp32 / bf16 / fp16 (zerodp's
                     low-precision weights with fp32 masters, as Lightning's DeepSpeed strategy maps them); any
                     other precision is refused by name (zerodp has no equivalent)
  accumulation       Trainer(accumulate_grad_batches=k) is the config's gradient_accumulation_steps; Lightning's
                     loop still picks the boundaries and divides the loss by k, the engine sums the k backwards
  clipping           gradient_clip_val is the config's gradient_clipping (norm; "value" refused): the engine
                     clips inside step() on its sharded gradients, so clip hooks see no per-parameter gradients
  optimizer / lr     configure_optimizers' one optimizer is rewired by zerodp.initialize onto this rank's master
                     shards; its lr scheduler stays Lightning's (stepped by Lightning's loop, as under DeepSpeed)
  configure_model    runs under torch.device("meta"): each rank materialises only its share in initialize
  checkpoints        a checkpoint "file" (ModelCheckpoint, trainer.save_checkpoint, Fabric.save) is a directory:
                     zerodp's sharded checkpoint, resumable on another number of ranks, plus Lightning's own
                     state (loops, callbacks, schedulers) written by rank 0 as lightning_state.pt
  validate / test / predict  through the engine after fit (stage 3 gathers per unit); on their own, the module
                     runs whole on every rank, as under DDP (zerodp.shard would shard it, but a checkpoint
                     given to them is read by load_checkpoint into an engine, which only fit builds)
  state_dict         checkpoint["state_dict"] holds the module's whole weights for hooks and callbacks (stage 3:
                     gathered on every rank, fp32); the files hold zerodp's shards instead
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

import zerodp
from zerodp.config import Config, ConfigError, Said, load_config
from zerodp.config.schema import read_config_file
from zerodp.engine.engine import Engine, inside
from zerodp.engine.faces import EngineModule, EngineOptimizer, deferred_reduction

STATE_FILE = "lightning_state.pt"  # Lightning's own part of a checkpoint directory, beside zerodp's shards
# Lightning's precision names that zerodp runs exactly: the dtype each is in zerodp.
_PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
_NAMED = {"zerodp": {"stage": 2}, "zerodp_stage_1": {"stage": 1}, "zerodp_stage_2": {"stage": 2},
          "zerodp_stage_3": {"stage": 3},
          "zerodp_stage_2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "zerodp_stage_3_offload": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "cpu"}}}


# ---- shared by both strategies -------------------------------------------------------------------------
def _config_dict(config: dict[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)
    if not isinstance(config, dict):
        raise TypeError(f"ZeroStrategy's config is a dict or a JSON file path, not {type(config).__name__}")
    return dict(config)


def _dtype(precision: str) -> Said:
    """Lightning's precision flag as the dtype zerodp runs (Config.under_framework), or a refusal naming it."""
    if precision not in _PRECISIONS:
        raise ConfigError(f"precision={precision!r} has no exact zerodp equivalent; ZeroStrategy runs "
                          f"{', '.join(repr(p) for p in _PRECISIONS)} (the last two as the config's bf16 / fp16 "
                          "sections: low-precision weights with fp32 masters)")
    return Said(_PRECISIONS[precision], f"Lightning's precision is {precision!r}")


def _save_dir(engine: Engine, path: str, state: dict[str, Any]) -> None:
    """zerodp's sharded checkpoint in `path` (a directory), Lightning's own state beside it (rank 0)."""
    engine.save_checkpoint(os.fspath(path), tag="checkpoint")
    if engine.global_rank == 0:
        torch.save(state, os.path.join(path, STATE_FILE))
    torch.distributed.barrier()


def _load_dir(engine: Engine, path: str, optimizer_states: bool) -> dict[str, Any]:
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, STATE_FILE)):
        raise FileNotFoundError(f"{path} is not a ZeroStrategy checkpoint (a directory with zerodp's shards and "
                                f"{STATE_FILE})")
    engine.load_checkpoint(os.fspath(path), optimizer_states=optimizer_states)
    return torch.load(os.path.join(path, STATE_FILE), weights_only=False)


# ---- lightning.Trainer --------------------------------------------------------------------------------
class ZeroPrecision(Precision):
    """Lightning's precision plugin under ZeroStrategy: no autocast or scaler (the engine owns the dtype and
    the fp16 loss scale); backward and the optimizer step are the engine's."""

    def __init__(self, strategy: ZeroStrategy, precision: str) -> None:
        self.strategy = strategy
        self.precision = precision

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        # Lightning divided the loss by accumulate_grad_batches (the engine's gradient_accumulation_steps) already.
        self.strategy.engine.backward(tensor, scale_wrt_gas=False)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if result is None and getattr(model, "automatic_optimization", False):
            raise ValueError("training_step returned None: ZeroStrategy cannot skip a step (every rank's engine "
                             "steps together); return a loss")
        self.strategy.engine.step()
        return result

    def clip_gradients(self, optimizer, clip_val: float = 0.0, gradient_clip_algorithm=None) -> None:
        pass  # the engine clips inside step() at the config's gradient_clipping (gradient_clip_val)


class ZeroStrategy(DDPStrategy):
    """Lightning's DDP strategy with zerodp's engine in place of DistributedDataParallel (stages 0-3, offload).

    config: a zerodp / DeepSpeed-style config (dict or JSON path), as zerodp.initialize takes it; the batch
    sizes, gradient_accumulation_steps, gradient_clipping and the precision come from the Trainer."""

    strategy_name = "zerodp"

    def __init__(self, config: dict[str, Any] | str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = _config_dict(config)
        self.engine: Engine | None = None

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """configure_model / Trainer.init_module build on meta for fit (each rank materialises its share in
        zerodp.initialize); for validate / test / predict on their own, whole on the device as under DDP."""
        trainer = getattr(self._lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"):
            yield

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        if not isinstance(self.precision_plugin, ZeroPrecision):
            self.precision_plugin = ZeroPrecision(self, str(self.precision_plugin.precision))
        module = self.lightning_module
        if self.engine is not None and self.engine.module is module:
            self.model = EngineModule(module, self.engine)
        elif trainer.state.fn == TrainerFn.FITTING:
            self.engine = self._build_engine(trainer, module)
            self.model = EngineModule(module, self.engine)
        else:
            if any(p.is_meta for p in module.parameters()):
                raise ValueError(f"trainer.{trainer.state.fn.value}() before fit() on a model built on meta "
                                 "(configure_model): ZeroStrategy materialises it only when it trains")
            self.model = module.to(self.root_device)  # whole on every rank, as under DDP (see the docstring)
        self.barrier()

    def _build_engine(self, trainer, module: nn.Module) -> Engine:
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers and {len(schedulers)} "
                             "schedulers; ZeroStrategy trains one optimizer with at most one scheduler")
        engine = zerodp.initialize(module, optimizers[0], self._config_for(trainer),
                                   process_group=torch.distributed.group.WORLD)
        self.optimizers = [EngineOptimizer(engine)]
        self.lr_scheduler_configs = schedulers  # stepped by Lightning's loop on the rewired optimizer
        return engine

    def _config_for(self, trainer) -> Config:
        """The strategy's config under the Trainer's accumulation, clipping, batch and precision (Lightning decides
        them: Config.under_framework's precedence)."""
        if getattr(trainer, "gradient_clip_algorithm", "norm") == "value" and trainer.gradient_clip_val:
            raise ValueError("gradient_clip_algorithm='value' is not supported by ZeroStrategy: the engine clips "
                             "the global norm of its sharded gradients; use gradient_clip_algorithm='norm'")
        k, clip = trainer.accumulate_grad_batches, trainer.gradient_clip_val
        return load_config(self.config).under_framework(
            gradient_accumulation_steps=Said(k, f"accumulate_grad_batches says {k!r}"),
            gradient_clipping=Said(float(clip), f"gradient_clip_val says {float(clip)!r}") if clip else None,
            dtype=_dtype(self.precision_plugin.precision), micro_batch_size=_micro_batch(trainer))

    def teardown(self) -> None:
        # Lightning's own teardown moves the module to the CPU: its parameters are views into the engine's
        # buffers, which stay where the engine placed them (validate / test / predict after fit use them).
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # A micro-batch before the accumulation boundary: the engine's deferred reduction (faces.py).
        with deferred_reduction(self.engine) if self.engine is not None else nullcontext():
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's whole state dict, for Lightning's dump_checkpoint (on_save_checkpoint hooks and callbacks
        read checkpoint["state_dict"]), as DDP and DeepSpeed's ZeRO-1/2 give it. At stage 3 the engine's fp32
        weights gathered on every rank (collective: Lightning's save_checkpoint runs dump_checkpoint on every
        rank). save_checkpoint leaves it out of the files: the weights are in zerodp's sharded checkpoint."""
        if self.engine is not None and inside(self.engine).spec.gathers_per_unit:
            return self.engine.full_state_dict()
        return self.lightning_module.state_dict()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.engine is None:
            raise RuntimeError("ZeroStrategy saves a checkpoint of its engine, which fit() builds")
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        _save_dir(self.engine, os.fspath(filepath), state)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads its shards, so it must exist first

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if self.engine is None:
            raise RuntimeError("ZeroStrategy loads checkpoints into its engine, which fit() builds")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return _load_dir(self.engine, os.fspath(checkpoint_path), optimizer_states=fitting)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded by the engine in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, zero in _NAMED.items():
            strategy_registry.register(name, cls, description=f"zerodp {zero}", config={"zero_optimization": zero})


def _micro_batch(trainer) -> int:
    """The train dataloader's batch size (what Lightning's DeepSpeed strategy reads), else 1; zerodp
    uses it only to report, the loop is Lightning's."""
    source = trainer.fit_loop._data_source
    if source.instance is not None and source.is_defined():
        loader = source.dataloader()
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return 1


# ---- lightning.Fabric ---------------------------------------------------------------------------------
class _EngineBackwardSync(_BackwardSyncControl):
    """fabric.no_backward_sync: the engine's deferred reduction (zerodp.engine.faces.deferred_reduction)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool):
        engine = getattr(module, "engine", None)
        return deferred_reduction(engine) if enabled and engine is not None else nullcontext()


_NOT_BUILT = ("fabric.{what}() before the optimizer is set up: ZeroFabricStrategy builds its engine in "
              "fabric.setup(model, optimizer) or fabric.setup_optimizers(...)")


class ZeroFabricStrategy(FabricDDPStrategy):
    """Lightning Fabric's DDP strategy with zerodp's engine in place of DistributedDataParallel.

    config: as zerodp.initialize takes it; Fabric's precision maps onto it as for ZeroStrategy. The engine is
    built when the optimizer is set up (fabric.setup(model, optimizer), or setup_module then setup_optimizers)."""

    def __init__(self, config: dict[str, Any] | str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = _config_dict(config)
        self.engine: Engine | None = None
        self._module: nn.Module | None = None
        self._wrapped: EngineModule | None = None  # what setup_module returned, given the engine once built
        self._backward_sync_control = _EngineBackwardSync()

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler=None):
        if len(optimizers) != 1:
            raise ValueError(f"ZeroFabricStrategy trains one optimizer, got {len(optimizers)}")
        wrapped = self.setup_module(module)
        return wrapped, [self.setup_optimizer(optimizers[0])], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        # Fabric's module before its optimizer is set up; setup_optimizer attaches the engine it builds.
        self._module = module
        self._wrapped = EngineModule(module, not_built=_NOT_BUILT.format(what="forward"))
        return self._wrapped

    def setup_optimizer(self, optimizer: torch.optim.Optimizer):
        if self._module is None or self.engine is not None:
            raise RuntimeError("ZeroFabricStrategy builds one engine: set up one module, then its optimizer")
        # The loop is the user's: Fabric decides only the precision (a micro batch of 1 is what zerodp reports).
        config = load_config(self.config).under_framework(dtype=_dtype(str(self.precision.precision)),
                                                          micro_batch_size=1)
        self.precision = FabricPrecision()  # no autocast / casts: the engine owns the dtype
        self.engine = zerodp.initialize(self._module, optimizer, config, process_group=torch.distributed.group.WORLD)
        self._wrapped.engine = self.engine
        return EngineOptimizer(self.engine)

    def module_to_device(self, module: nn.Module) -> None:
        pass  # the engine places its shares

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._engine("backward").backward(tensor)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite: bool = True):
        engine = self._engine("clip_gradients")
        if float(max_norm) != engine.config.gradient_clipping or float(norm_type) != 2.0:
            raise ValueError(f"the engine clips the 2-norm inside optimizer.step() at the config's gradient_clipping "
                             f"({engine.config.gradient_clipping}); fabric.clip_gradients(max_norm={max_norm}) must "
                             "match it (set gradient_clipping in the zerodp config)")
        return None

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        raise ValueError("clipping gradients by value is not supported by ZeroFabricStrategy: the engine clips "
                         "the global norm (the config's gradient_clipping)")

    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict | None = None) -> None:
        rest = {k: v for k, v in state.items() if not isinstance(v, (nn.Module, EngineOptimizer))}
        _save_dir(self._engine("save"), os.fspath(path), {k: _plain(v) for k, v in rest.items()})

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None):
        saved = _load_dir(self._engine("load"), os.fspath(path), optimizer_states=True)
        if state is None or isinstance(state, nn.Module):
            return saved
        for key, value in list(saved.items()):
            if key in state and hasattr(state[key], "load_state_dict"):
                state[key].load_state_dict(value)
            elif key in state:
                state[key] = value
            else:
                continue
            saved.pop(key)
        return saved

    def _engine(self, what: str) -> Engine:
        if self.engine is None:
            raise RuntimeError(_NOT_BUILT.format(what=what))
        return self.engine

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, zero in _NAMED.items():
            strategy_registry.register(name, cls, description=f"zerodp {zero}", config={"zero_optimization": zero})


def _plain(value: Any) -> Any:
    return value.state_dict() if hasattr(value, "state_dict") and not isinstance(value, dict) else value


for _registry, _cls in ((StrategyRegistry, ZeroStrategy), (FABRIC_REGISTRY, ZeroFabricStrategy)):
    if "zerodp" not in _registry:
        _cls.register_strategies(_registry)
