"""DeepSpeedEngine: DeepSpeed's engine methods, each a call or two on a zerodp.Engine.

What the wrapper adds is only DeepSpeed's names and return conventions (load_checkpoint's
`(path, client_state)`, save_checkpoint's True, the batch getters as methods). Anything not defined
here is looked up on the zerodp engine, then on the wrapped module (`parameters()`, `state_dict()`).
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerodp.checkpoint.export_engine import save_weights
from zerodp.checkpoint.files import LATEST
from zerodp.deepspeed.utils.timer import ThroughputTimer
from zerodp.distributed.device import empty_cache
from zerodp.engine.engine import Engine, inside
from zerodp.engine.faces import defers_reduction
from zerodp.engine.sharding.module import ShardedModule

# The live engines, for zero.GatheredParameters (which DeepSpeed's scripts call with bare
# parameters, not the engine). Weak: a freed engine leaves nothing behind.
_ENGINES: "weakref.WeakSet[DeepSpeedEngine]" = weakref.WeakSet()


def owner_of(param: nn.Parameter) -> "DeepSpeedEngine | None":
    """The engine training `param`, if any (its module holds this very parameter object)."""
    return next((e for e in _ENGINES if id(param) in e._param_ids), None)


class DeepSpeedEngine:
    """What `zerodp.deepspeed.initialize` returns first: a zerodp engine under DeepSpeed's API."""

    def __init__(self, engine: Engine | ShardedModule, training_dataloader: Any = None):
        self.engine = engine  # a ShardedModule where nothing trains (DeepSpeed's engine without an optimizer)
        self._trains = isinstance(engine, Engine)
        self.training_dataloader = training_dataloader
        self._last_step: tuple[int, int] | None = None  # (global steps, skipped steps) before the last step()
        self._param_ids = {id(p) for p in engine.module.parameters()}
        # DeepSpeed's samples/s, timed from each forward to its step; no log lines of its own: zerodp's
        # steps_per_print line already reports samples/s.
        self.tput_timer = ThroughputTimer(batch_size=inside(engine).spec.batch.train_batch_size)
        _ENGINES.add(self)

    def __getattr__(self, name: str) -> Any:  # only for names not found on the wrapper itself
        engine = self.__dict__.get("engine")
        if engine is None:
            if self.__dict__.get("_destroyed") and not name.startswith("__"):  # (protocol probes stay AttributeErrors)
                raise RuntimeError(f"this engine was destroyed (engine.destroy()), and {name!r} was read of it; "
                                   "build a new one with deepspeed.initialize")
            raise AttributeError(name)
        if hasattr(engine, name):
            return getattr(engine, name)
        return getattr(engine.module, name)

    # ---- what the engine holds, released (DeepSpeed's own tests call both) ---------------------
    def empty_partition_cache(self) -> None:
        """DeepSpeed's: stage 3's parameters still gathered (the last unit of a forward, kept for its
        backward; an eval forward's) are released and the freed memory handed back; the next forward
        gathers what it needs. Parameters under stage3_param_persistence_threshold stay whole (zerodp
        keeps them gathered for good, with no hook to gather them again). Below stage 3 parameters are
        whole by design: nothing to release. Local: no collective."""
        inside(self.engine).sharded.release_gathered()
        gc.collect()
        empty_cache(self.device)

    def destroy(self) -> None:
        """DeepSpeed's: the engine lets go of the model. Every hook it put on the model (stage 3's gathers,
        the gradient hooks, the state_dict hooks) is removed, stage 3's gathered parameters are released,
        and the engine is forgotten (zero.GatheredParameters no longer finds it), so that the engine, its
        optimizer state and its buffers are freed when the script drops its own references, even while it
        keeps the model. The engine cannot be used after; the model's parameters keep what the engine left
        in them (at stage 3 they are empty, as DeepSpeed's). Local: no collective."""
        if self.__dict__.get("_destroyed"):
            return
        parts = inside(self.engine)
        if parts.training is not None:
            parts.training.remove_hooks()
        parts.sharded.remove_hooks()
        _ENGINES.discard(self)
        self._param_ids = set()
        self._destroyed = True
        del self.engine  # every use after raises (__getattr__) instead of half-working
        gc.collect()

    # ---- the training step ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.tput_timer.start()
        return self.engine(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        if retain_graph:
            raise ValueError("backward(retain_graph=True) is not supported: zerodp's backward reduces the gradients "
                             "as autograd produces them and frees the graph; call backward once per micro-batch")
        self.engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        if lr_kwargs:
            raise ValueError("step(lr_kwargs=...) is not supported: the lr scheduler is stepped without "
                             "arguments after every applied step")
        # Read before the step, so reading skipped_steps settles the previous step, not this one: a
        # step decided on the device (non_finite.read_back) is read only if was_step_applied() asks.
        self._last_step = self.engine.global_steps, self.engine.skipped_steps
        self.engine.step()
        self.tput_timer.stop(global_step=self.engine.global_steps > self._last_step[0])

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.engine.train(mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    def zero_grad(self) -> None:
        """Nothing to do: step() clears the gradients (DeepSpeed's engine does the same)."""

    @contextmanager
    def no_sync(self):
        if not defers_reduction(self.engine):  # DeepSpeed's exception and words for it
            raise AssertionError(f"no_sync context manager is incompatible with gradient partitioning logic "
                                 f"of ZeRO stage {inside(self.engine).spec.stage}")
        with self.engine.no_sync():
            yield

    # ---- state DeepSpeed scripts read ------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.engine.optimizer if self._trains else None

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler if self._trains else None

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps if self._trains else 0

    @property
    def global_samples(self) -> int:
        return self.engine.global_steps * self.train_batch_size()

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps if self._trains else 0

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def world_size(self) -> int:
        return inside(self.engine).comm.world_size

    @property
    def dp_world_size(self) -> int:
        return inside(self.engine).comm.world_size

    @property
    def device(self) -> torch.device:
        return inside(self.engine).spec.device

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def get_global_grad_norm(self) -> float | None:
        return self.engine.grad_norm

    def gradient_accumulation_steps(self) -> int:
        return inside(self.engine).spec.gas

    def train_micro_batch_size_per_gpu(self) -> int:
        return inside(self.engine).spec.batch.micro_batch_size

    def train_batch_size(self) -> int:
        return inside(self.engine).spec.batch.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the weights (not an accumulation micro-step, not skipped)."""
        if self._last_step is None:
            return False
        steps, skipped = self._last_step
        return self.engine.global_steps > steps and self.engine.skipped_steps == skipped

    def zero_optimization_stage(self) -> int:
        return inside(self.engine).spec.stage

    def zero_optimization(self) -> bool:
        return inside(self.engine).spec.shards_optimizer

    def fp16_enabled(self) -> bool:
        return inside(self.engine).spec.dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return inside(self.engine).spec.dtype == torch.bfloat16

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """zerodp's sharded checkpoint (any world size can load it). client_state must be JSON."""
        if not save_latest or exclude_frozen_parameters:
            raise ValueError("save_checkpoint(save_latest=False / exclude_frozen_parameters=True) is not "
                             "supported: zerodp always updates 'latest' and saves frozen parameters")
        self.engine.save_checkpoint(save_dir, tag, client_state or {})
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[str | None, dict | None]:
        """(the checkpoint's directory, its client_state); (None, None) when load_dir has none, as
        DeepSpeed (a zerodp or a DeepSpeed ZeRO checkpoint, saved on any world size)."""
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported; load the state dict "
                             "yourself inside zero.GatheredParameters(..., modifier_rank=0)")
        if tag is None and not os.path.isfile(os.path.join(load_dir, LATEST)):
            warnings.warn(f"Unable to find latest file at {os.path.join(load_dir, LATEST)}; if trying to "
                          "load the latest checkpoint please pass tag", stacklevel=2)
            return None, None
        if tag is None:
            with open(os.path.join(load_dir, LATEST), encoding="utf-8") as f:
                tag = f.read().strip()
        client_state = self.engine.load_checkpoint(load_dir, tag, load_optimizer_states,
                                                   load_lr_scheduler_states, load_module_only)
        return os.path.join(load_dir, tag), client_state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model in its working precision as one torch.save'd state dict, on rank 0
        (collective). Stage 3 needs zero_optimization.stage3_gather_16bit_weights_on_model_save."""
        zero = self.engine.config.zero_optimization
        if inside(self.engine).spec.gathers_per_unit and not zero.stage3_gather_16bit_weights_on_model_save:
            warnings.warn("did not save the model: stage 3 needs "
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save: true", stacklevel=2)
            return False
        names = None
        if exclude_frozen_parameters:
            names = {n for n, p in self.engine.module.named_parameters() if p.requires_grad}
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
        # Rank 0 writes each tensor as its bucket arrives: the model is never whole on any rank.
        save_weights(self.engine, os.path.join(save_dir, save_filename), inside(self.engine).spec.dtype, names)
        return True
