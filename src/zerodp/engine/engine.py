"""The engine users hold: a sharded module (sharded.py) with training added (training.py), behind the face
DeepSpeed's users know (forward, backward, step, save/load_checkpoint, gathered_parameters, memory_report, ...).

`wrap` builds what a model needs: a ShardedModule alone when nothing trains (a reference or teacher model),
an Engine around one otherwise. What checkpoint/, plan/ and the compatibility layers read of either goes
through one narrow internal object, `inside(x)`, never through the face. See DESIGN.md, "One set-up and one
training step, as data".
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from zerodp.config import Config
from zerodp.distributed.comm import Comm
from zerodp.engine.decide import agreed_set_up
from zerodp.engine.layout.layout import Layout
from zerodp.engine.layout.spec import EngineSpec
from zerodp.engine.layout.units import UnitRule
from zerodp.engine.setup.initialisers import ParamInitFn
from zerodp.engine.setup.source import ParameterSource
from zerodp.engine.sharding.memory import memory_report
from zerodp.engine.sharding.module import ShardedModule, collect
from zerodp.engine.stepping.optimizer_view import OptimizerLike
from zerodp.engine.stepping.training import Training


def _names_peer_failure(where: str):
    """A collective that timed out or lost its peer inside the wrapped method is raised again as one
    PeerFailure naming the method and the step (gloo's own error names neither). Free unless it raises."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with self._sharded.comm.names_peer_failure(f"in {where} at step {self._training.global_steps + 1}"):
                return method(self, *args, **kwargs)
        return run
    return wrap


class CheckpointIO(Protocol):
    """What engine.save_checkpoint / load_checkpoint call: the zerodp.checkpoint package, which sits
    above the engine (it reads the engine's state), handed in by zerodp.initialize."""

    def save_checkpoint(self, engine: Engine, save_dir: str, tag: str | None, client_state: dict | None,
                        keep_last: int | None) -> str: ...

    def load_checkpoint(self, engine: Engine, load_dir: str, tag: str | None, optimizer_states: bool,
                        lr_scheduler_states: bool, module_only: bool) -> dict: ...


def wrap(module: nn.Module, optimizer: OptimizerLike | None, config: Config, comm: Comm,
         lr_scheduler: Callable | None = None, stage3_unit: UnitRule | None = None, *,
         checkpoint_io: CheckpointIO | None = None, source: ParameterSource | None = None,
         param_init_fn: ParamInitFn | None = None) -> Engine | ShardedModule:
    """The model sharded, with training added when something trains (an optimizer given, or the config's).

    source: where the parameters' values come from (a model built on meta, or weights read from files),
    asked for the ranges this rank keeps; None: the module's own values, or, for tensors on meta, their
    modules' initialisers (reset_parameters, or param_init_fn(module))."""
    spec, filling, optimizer, groups = agreed_set_up(module, optimizer, config, comm, source, param_init_fn,
                                                     stage3_unit)
    sharded = ShardedModule(module, config, comm, spec, filling, groups, checkpoint_io)
    return Engine(sharded, optimizer, lr_scheduler) if spec.trains else sharded


@dataclass(frozen=True)
class Inside:
    """What checkpoint/, plan/ and the compatibility layers read of an Engine or a ShardedModule: its two parts
    and the facts they share. `training` is None for a model that trains nothing."""

    sharded: ShardedModule  # the module, its layout, gathers and weights
    training: Training | None  # the optimizer, the reducer, the loss scale and the step counts

    @property
    def spec(self) -> EngineSpec:
        return self.sharded.spec

    @property
    def comm(self) -> Comm:
        return self.sharded.comm

    @property
    def layout(self) -> Layout:
        return self.sharded.layout

    @property
    def module(self) -> nn.Module:
        return self.sharded.module

    @property
    def config(self) -> Config:
        return self.sharded.config

    def master_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 master of each trained bucket (none when nothing trains)."""
        return [] if self.training is None else self.training.master_shards()

    def weights(self):
        """The weights as a stream (ShardedModule.weights), trained buckets from their fp32 masters."""
        if self.training is None:
            return self.sharded.weights()
        self.training.wait_for_parameters()
        return self.sharded.weights(self.training.full_master)


def step_timings(engine: Engine) -> dict[str, float]:
    """Milliseconds of each phase of the engine's last step (forward, backward, reduce_wait, step, gather), with
    wall_clock_breakdown; {} without it (`zerodp.step_timings`)."""
    return inside(engine).training.monitor.timings()


def inside(x: Engine | ShardedModule) -> Inside:
    """The internal object of what zerodp.initialize (or zerodp.shard) returned."""
    if isinstance(x, Engine):
        return x._inside
    if isinstance(x, ShardedModule):
        return Inside(x, None)
    inner = getattr(x, "engine", None)  # a compatibility layer's wrapper around one (zerodp.deepspeed's engine)
    if isinstance(inner, (Engine, ShardedModule)):
        return inside(inner)
    raise TypeError(f"expected a zerodp Engine or ShardedModule, got {type(x).__name__}")


class Engine:
    """A model wrapped for ZeRO training: a ShardedModule with training added. Use `zerodp.initialize`."""

    def __init__(self, sharded: ShardedModule, optimizer: OptimizerLike, lr_scheduler: Callable | None = None):
        self._sharded = sharded  # the model, its layout, stage 3's gathers, the weights in and out
        self._training = Training(sharded, optimizer, lr_scheduler)  # gradients, optimizer, loss scale, step
        self._inside = Inside(sharded, self._training)  # what the layers above read (inside())

    # ---- the model ------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The user's model: its parameters are views into zerodp's flat buckets."""
        return self._sharded.module

    @property
    def config(self) -> Config:
        """The validated configuration, the same on every rank."""
        return self._sharded.config

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer, rewired to step this rank's fp32 master shards."""
        return self._training.optimizer

    @property
    def lr_scheduler(self):
        """The scheduler stepped after each step taken; None: none."""
        return self._training.lr_scheduler

    @_names_peer_failure("the forward pass (stage 3 / overlap_param_gather wait for parameter gathers)")
    def __call__(self, *args, **kwargs):
        monitor = self._training.monitor
        if self.module.training:
            monitor.saw_inputs(args)
        with monitor.span("forward"):
            return self._sharded.module_forward(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def zero_grad(self) -> None:
        """Nothing to do: gradients live in the engine's buffers and are cleared by step()."""

    # ---- the training step ------------------------------------------------------------------------------
    @_names_peer_failure("engine.backward() (the gradient reduction)")
    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Scale (fp16) and divide by the accumulation steps, run autograd, reduce the buckets.
        scale_wrt_gas=False (DeepSpeed's spelling): the loss is already divided by the accumulation steps."""
        self._training.backward(loss, scale_wrt_gas)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next backward() ends an accumulation, i.e. the step() after it updates."""
        return self._training.is_gradient_accumulation_boundary()

    @_names_peer_failure("engine.step() (gradient reduction, norm all_reduce, parameter all_gather)")
    def step(self) -> None:
        """Once gradient_accumulation_steps backward() calls have been made since the last update:
        reduce, unscale, clip, update, all-gather. Otherwise nothing.

        More backward() calls than that before step() (two at gradient_accumulation_steps 1) all
        add to this update, as PyTorch's loss.backward() twice then optimizer.step() does; step()
        with no backward() since the last update changes nothing, as PyTorch's does without grads."""
        self._training.step()

    @contextmanager
    def no_sync(self):
        """As DDP's no_sync: backward() inside reduces nothing; its gradients join those of the next
        backward() outside, which reduces them all. Stages 0-1 only."""
        with self._training.no_sync():
            yield

    def wait_for_parameters(self) -> None:
        """With overlap_param_gather, step() returns while the updated parameters are still being
        gathered and the next forward waits for them; call this to read them directly before that.
        A step decided on the device (non_finite.read_back) is settled too."""
        self._training.wait_for_parameters()

    # ---- what the step left -------------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        """Optimizer steps, taken or skipped."""
        return self._training.global_steps

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm of the last step, before clipping (inf/nan after an fp16 overflow)."""
        norm = self._training.grad_norm
        return None if norm is None else float(norm)

    @property
    def loss_scale(self) -> float:
        return self._training.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm or loss (reading it settles a step decided on
        the device: a wait for that step's device work)."""
        self._training.settle()
        return self._training.skipped

    def get_lr(self) -> list[float]:
        """Each param group's lr for the next step (settles a step decided on the device)."""
        self._training.settle()
        return [g["lr"] for g in self.optimizer.param_groups]

    # ---- ranks ----------------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job (torch.distributed's default group)."""
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        """This process's index on its machine: torchrun's LOCAL_RANK (0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        """This rank's device, where the module's parameters are and each batch goes."""
        return self._sharded.spec.device

    @property
    def world_size(self) -> int:
        """The data-parallel ranks the model is trained on (the engine's process group)."""
        return self._sharded.comm.world_size

    # ---- whole parameters, weights and checkpoints ------------------------------------------------------
    @contextmanager
    def gathered_parameters(self, params: Iterable[nn.Parameter] | None = None, modifier_rank: int | None = None):
        """ShardedModule.gathered_parameters, after the last step's gathers: modifier_rank's writes become
        every rank's weights and fp32 masters."""
        self.wait_for_parameters()
        with self._sharded.gathered_parameters(params, modifier_rank):
            yield

    @contextmanager
    def uneven_forwards(self):
        """ShardedModule.uneven_forwards: forwards that differ in number between ranks."""
        with self._sharded.uneven_forwards():
            yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights of every rank, keyed like module.state_dict(), each tensor whole (joined over
        the tp group under tensor parallelism; collective). It gathers the whole model on every rank: files
        are written without that (zerodp.checkpoint.export_engine, one bucket at a time)."""
        return collect(self._inside.weights())

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        keep_last: int | None = None) -> str:
        """Sharded checkpoint of everything needed to resume (collective: call on every rank)."""
        self.wait_for_parameters()
        if self._sharded.gathered_state is not None:
            self._sharded.gathered_state.entering("save_checkpoint()")
        return self._checkpoints().save_checkpoint(self, save_dir, tag, client_state, keep_last)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, optimizer_states: bool = True,
                        lr_scheduler_states: bool = True, module_only: bool = False) -> dict:
        """Restore a checkpoint saved on any world size; returns its client_state (collective).
        module_only restores the weights alone (no optimizer, scheduler, counters or RNG)."""
        self._training.settle()
        return self._checkpoints().load_checkpoint(self, load_dir, tag, optimizer_states, lr_scheduler_states,
                                                   module_only)

    def _checkpoints(self) -> CheckpointIO:
        if self._sharded.checkpoint_io is None:
            raise RuntimeError("this Engine was built without checkpoint_io, so it cannot save or load "
                               "checkpoints; build it with zerodp.initialize, or call "
                               "zerodp.checkpoint.save_checkpoint(engine, ...) / load_checkpoint(engine, ...)")
        return self._sharded.checkpoint_io

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by category, counted from the tensors the engine owns."""
        return memory_report(self._sharded, self._training.bytes(), self._training.partitioned_optimizer.offload)
