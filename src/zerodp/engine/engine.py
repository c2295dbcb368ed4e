"""The engine: ties flat buffers, gradient reduction, the partitioned optimizer and the loss scaler
into forward / backward / step. See DESIGN.md, "One set-up and one training step, as data"."""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import sys
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from zerodp.config import BatchSizes, Config
from zerodp.distributed.comm import Comm
from zerodp.distributed.device import can_pin, seed_everything
from zerodp.engine.decide import frozen_params, local_check
from zerodp.engine.layout.flat import Bucket, local, set_local
from zerodp.engine.layout.layout import Layout
from zerodp.engine.layout.spec import EngineSpec
from zerodp.engine.layout.units import UnitRule, Units
from zerodp.engine.memory import memory_report
from zerodp.engine.setup import fill
from zerodp.engine.setup.fill import Filling
from zerodp.engine.setup.initialisers import ParamInitFn
from zerodp.engine.setup.source import ParameterSource
from zerodp.engine.sharding.buffers import BufferSync
from zerodp.engine.sharding.gather import BucketState, Gatherer
from zerodp.engine.sharding.gathered_state import GatheredStateDict, LoneCall
from zerodp.engine.sharding.weights import engine_weights
from zerodp.engine.stepping.cpu_bf16 import warn_if_slow_bf16
from zerodp.engine.stepping.forward_order import ForwardOrder
from zerodp.engine.stepping.non_finite import (
    NonFiniteError,
    NonFinitePolicy,
    PendingStep,
    decides_on_device,
    pending_step,
    skip_on_device,
    step_flags,
    step_is_finite,
)
from zerodp.engine.stepping.optimizer import (
    OptimizerLike,
    PartitionedOptimizer,
    clip_coefficient,
)
from zerodp.engine.stepping.precision import LossScaler, cast_floating
from zerodp.engine.stepping.reducer import Reducer
from zerodp.engine.stepping.unused import UsedParameters
from zerodp.engine.tensor_parallel.grads import GradPlacements, names_of
from zerodp.monitor.step import StepMonitor


def _names_peer_failure(where: str):
    """A collective that timed out or lost its peer inside the wrapped method is raised again as one
    PeerFailure naming the method and the step (gloo's own error names neither). Free unless it raises."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with self.comm.names_peer_failure(f"in {where} at step {self.global_steps + 1}"):
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


class Engine:
    """A model wrapped for ZeRO training. Use `zerodp.initialize` to build one."""

    def __init__(self, module: nn.Module, optimizer: OptimizerLike | None, config: Config,
                 comm: Comm, lr_scheduler: Callable | None = None, stage3_unit: UnitRule | None = None, *,
                 checkpoint_io: CheckpointIO | None = None, source: ParameterSource | None = None,
                 param_init_fn: ParamInitFn | None = None):
        """source: where the parameters' values come from (a model built on meta, or weights read from
        files), asked for the ranges this rank keeps; None: the module's own values, or, for tensors on
        meta, their modules' initialisers (reset_parameters, or param_init_fn(module))."""
        self.config = config  # the validated configuration, the same on every rank
        self.comm = comm  # the engine's process group: every collective of the engine goes through it
        self.module = module  # the user's model: its trained parameters become views into flat buckets
        self.checkpoint_io = checkpoint_io  # zerodp.checkpoint, above the engine; None: no save/load methods
        spec, filling, optimizer, groups = self._agreed_set_up(optimizer, source, param_init_fn, stage3_unit)
        self.spec: EngineSpec = spec  # stage, batch, shard size, dtype, device, units: decided once, read after
        frozen = frozen_params(module, groups) if spec.shards_frozen else None  # stage 3 shards them too
        self._cast_and_sync_untrained(groups, frozen or [], filling)
        # rank 0's floating buffers before each forward (broadcast_buffers); None: nothing to keep equal
        self.buffer_sync = (BufferSync(module, comm) if BufferSync.wanted(module, comm, config.broadcast_buffers)
                            else None)
        layout, fp32_shards = self._flat_buffers(groups, frozen, filling)
        self.layout: Layout = layout  # the buckets the trained parameters are views into, this rank's shard
        self.used_only = self._used_parameters(layout)  # the parameters a step updates (unused.py); None: all
        # the user's optimizer on this rank's fp32 master shards, and the all-gather of the result
        self.partitioned_optimizer = self._partitioned(optimizer, layout, fp32_shards)
        self.optimizer: Optimizer = self.partitioned_optimizer.optimizer  # the torch optimizer it steps
        self.forward_order = self._forward_order()  # overlap_param_gather's gather order; None without it
        self.gatherer = self._gatherer(layout)  # stage 3's gather and release of each unit; None below stage 3
        # stage 3: module.state_dict() gathers the parameters it would otherwise hold empty; None below it
        self.gathered_state = (GatheredStateDict(module, self.gatherer, comm, config.comm_timeout_s)
                               if self.gatherer is not None else None)
        self.reducer = self._reducer(layout)  # gradients into buckets during backward, reduced (-scattered)
        del fp32_shards
        self.scaler = LossScaler.from_config(config)  # fp16's dynamic loss scale; a fixed 1 otherwise
        self.lr_scheduler = self._scheduler(lr_scheduler)  # stepped after each step taken; None: none
        self.clip = config.gradient_clipping  # the global gradient norm is clipped to this (0: no clipping)
        self.micro_steps = self.global_steps = 0  # backward() calls, optimizer steps (taken or skipped)
        self._stepped_at = 0  # micro_steps at the last update: the accumulation window starts there
        self._skipped = 0  # steps skipped for a non-finite gradient norm or loss
        self._scale_used = self.scaler.scale  # the loss scale this window's backward() calls multiplied by
        self._grad_norm: torch.Tensor | None = None  # the last step's global norm, before clipping
        self.non_finite = NonFinitePolicy(config, comm.everyone.rank)  # what a non-finite step does: skip, log, raise
        # non_finite.read_back: steps skipped on the device, their decision read a step later
        self._on_device = decides_on_device(config, self.optimizer, self.partitioned_optimizer.offload,
                                            self.scaler, self.device)
        self._pending: PendingStep | None = None  # the last such step, until the host has read it
        self._refused: NonFiniteError | None = None  # the policy's error from a settled step, for step() to raise
        self._window_loss: torch.Tensor | None = None  # the window's losses summed, for step_flags
        self._no_sync = self._unsynced = False  # inside no_sync(); gradients not yet reduced since
        comm.traffic.reset()  # the byte tally counts training, not set-up
        # steps_per_print, wall_clock_breakdown, monitors, comms_logger (zerodp.monitor)
        self.monitor = StepMonitor(config, comm, self.device)
        self.monitor.instrument_gathers(self.partitioned_optimizer, self.gatherer)

    # ---- set-up, in the order __init__ runs it ---------------------------------------------------
    def _agreed_set_up(self, optimizer: OptimizerLike | None, source: ParameterSource | None,
                       param_init_fn: ParamInitFn | None, stage3_unit: UnitRule | None
                       ) -> tuple[EngineSpec, Filling, OptimizerLike, list[list[nn.Parameter]]]:
        """The local check (decide.local_check) and the module moved to its device, then the first
        collective: a set-up error on any rank raises on every rank (zerodp.initialize meets this
        agreement directly when its config failed to load)."""
        error = spec = filling = None
        try:
            spec, filling, optimizer, groups = local_check(self.config, self.comm, self.module, optimizer, source,
                                                  param_init_fn, stage3_unit)
            if any(t.device != spec.device and not t.is_meta
                   for t in itertools.chain(self.module.parameters(), self.module.buffers())):
                # only when needed: a model already there may hold fake tensors
                fill.move_to(self.module, spec.device)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others hang
            error = e
        self.comm.agree(error, "zerodp.initialize")
        self._check_same_everywhere(filling)
        self._bound_collectives()
        warn_if_slow_bf16(spec.device, spec.dtype, self.comm.rank)
        self.comm.split(spec.shard_size)  # hierarchical sharding's groups (nothing when flat)
        in_buffers = groups + ([frozen_params(self.module, groups)] if spec.shards_frozen else [])
        fill.start(filling, self.comm, spec.device, {id(p) for g in in_buffers for p in g})
        return spec, filling, optimizer, groups

    def _check_same_everywhere(self, filling: Filling) -> None:
        """Every rank must wrap the same model with the same config, or collectives would mismatch."""
        if self.comm.world_size == 1 or self.comm.is_fake():
            return
        sig = [(n, tuple(p.shape), str(p.dtype), p.requires_grad, "meta" if p.is_meta else "built")
               for n, p in self.module.named_parameters()]
        sig.append(("the values come from", filling.origin))  # a broadcast, or each rank's own reads
        text = repr(sig) + self.config.model_dump_json()
        digests = self.comm.all_gather_object(hashlib.sha256(text.encode()).hexdigest())
        if len(set(digests)) == 1:
            return
        sigs = self.comm.all_gather_object((sig, self.config.model_dump()))
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

    def _bound_collectives(self) -> None:
        """From here on every collective of the engine waits at most comm_timeout_s, when the config gives
        it, whoever created the process group (Comm.bound); a group torch cannot bound is named in one line
        with what to set instead. Not given, the groups keep their own timeouts (a group zerodp creates has
        the key's default)."""
        given = "comm_timeout_s" in self.config.model_fields_set
        seconds = self.config.comm_timeout_s
        for reason in self.comm.bound(seconds if given else None):
            if self.comm.everyone.rank == 0:
                print(f"[zerodp] comm_timeout_s={seconds:g} cannot bound zerodp's collectives on {reason}; they wait "
                      f"as long as that group's own timeout: create it with timeout=datetime.timedelta(seconds="
                      f"{seconds:g}) instead", file=sys.stderr, flush=True)

    def _cast_and_sync_untrained(self, groups: list[list[nn.Parameter]], sharded: list[nn.Parameter],
                                 filling: Filling) -> None:
        """Frozen parameters kept whole (stages 0-2) and floating buffers: working precision, rank 0's
        values (frozen parameters read from weights are every rank's already: fill.start read them).
        The `sharded` frozen parameters (stage 3) are the flat buffers', filled like the trained ones."""
        trained = {id(p) for g in groups + [sharded] for p in g}
        read = {id(p) for p in self.module.parameters()} if filling.from_files else set()
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if id(t) in trained:
                continue
            if t.is_floating_point() and t.dtype != self.dtype:
                set_local(t, local(t).data.to(self.dtype))
            if id(t) not in read:
                self.comm.broadcast(local(t).data)

    def _flat_buffers(self, groups: list[list[nn.Parameter]], frozen: list[nn.Parameter] | None, filling: Filling
                      ) -> tuple[Layout, list[torch.Tensor]]:
        """The parameters become views into flat buckets holding rank 0's weights; returns the layout
        and this rank's fp32 values of each trained bucket, which the masters start from."""
        zero, comm = self.config.zero_optimization, self.comm
        layout = Layout.build(groups, self.spec, comm, zero, frozen)
        fp32_shards = fill.fill(layout.groups, filling, comm, layout.rank, self.dtype, self.device,
                                self.spec.gathers_per_unit, self.offload_param,
                                zero.offload_param.pin_memory and can_pin(), frozen=layout.frozen)
        if self.config.seed is not None:  # after the initialisers, which draw rank 0's values
            seed_everything(self.config.seed + comm.rank)
        return layout, fp32_shards

    def _used_parameters(self, layout: Layout) -> UsedParameters | None:
        """Steps only the parameters that got a gradient (PyTorch's semantics); None when
        step_unused_parameters steps every one, the unused with a zero gradient (DeepSpeed's)."""
        if self.config.zero_optimization.step_unused_parameters:
            return None
        return UsedParameters(layout, self.comm)

    def _partitioned(self, optimizer: OptimizerLike, layout: Layout,
                     fp32_shards: list[torch.Tensor]) -> PartitionedOptimizer:
        zero = self.config.zero_optimization
        offload = zero.offload_optimizer
        return PartitionedOptimizer(optimizer, layout, fp32_shards, self.comm, self.spec, offload.device == "cpu",
                                    offload.pin_memory, zero.allgather_bucket_size, zero.sub_group_size,
                                    self.used_only)

    def _forward_order(self) -> ForwardOrder | None:
        """Stage 0 gathers nothing and stage 3 gathers per unit already."""
        if self.config.zero_optimization.overlap_param_gather and self.spec.gathers_after_step:
            return ForwardOrder(self.module, self.partitioned_optimizer)
        return None

    def _gatherer(self, layout: Layout) -> Gatherer | None:
        if not self.spec.gathers_per_unit:
            return None
        names = {id(m): n for n, m in self.module.named_modules()}
        return Gatherer(self.units, layout, self.comm, self.config.zero_optimization.stage3_prefetch_bucket_size,
                        self.offload_param, unit_names=[names.get(id(root), "") for root in self.units.roots])

    def _reducer(self, layout: Layout) -> Reducer:
        config, zero = self.config, self.config.zero_optimization
        acc_dtype = config.grad_accum_dtype or (torch.float32 if self.gas > 1 else self.dtype)
        done = None if self.gatherer is None else self.gatherer.gradients_done
        placements = GradPlacements(layout, self.comm, names_of(self.module)) if self.comm.tp is not None else None
        return Reducer(layout, self.comm, self.spec, acc_dtype, zero.overlap_comm, on_bucket_done=done,
                       comm_dtype=config.communication_dtype, prescale=config.prescale_gradients,
                       predivide=config.gradient_predivide_factor, bucket_numel=zero.reduce_bucket_size,
                       grad_placements=placements)

    def _scheduler(self, lr_scheduler: Callable | None):
        """The given scheduler factory, else the config's, built on the partitioned optimizer."""
        if lr_scheduler is None and self.config.scheduler is not None:
            lr_scheduler = self.config.scheduler.build
        return lr_scheduler(self.optimizer) if lr_scheduler is not None else None

    # ---- the training step ----------------------------------------------------------------------
    @_names_peer_failure("the forward pass (stage 3 / overlap_param_gather wait for parameter gathers)")
    def __call__(self, *args, **kwargs):
        if self.dtype != torch.float32:
            args, kwargs = cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)
        if self.buffer_sync is not None and (self.gatherer is None or self.gatherer.uneven is None):
            self.buffer_sync.before_forward()  # (not in an uneven_forwards block: a collective no agreement covers)
        if self.module.training:
            self.monitor.saw_inputs(args)
        with self.monitor.span("forward"):
            return self.module(*args, **kwargs)

    @_names_peer_failure("engine.backward() (the gradient reduction)")
    def backward(self, loss: torch.Tensor) -> None:
        """Scale (fp16) and divide by the accumulation steps, run autograd, reduce the buckets."""
        self._refuse_without_training("backward()")
        # Kept on device, unsynced: step() reports which rank's loss was non-finite.
        seen = loss.detach()
        if isinstance(seen, DTensor):  # loss parallel: a Replicate DTensor (full_tensor: its value, no collective)
            seen = seen.full_tensor()
        self._window_loss = seen if self._window_loss is None else self._window_loss + seen.float()
        self._scale_used = self.scaler.scale
        factor = self._scale_used / self.gas
        if factor != 1:
            loss = loss.float() * factor
        communicate = self.is_gradient_accumulation_boundary() and not self._no_sync
        self._unsynced = self._no_sync or (self._unsynced and not communicate)
        with self.monitor.span("backward"):
            self.reducer.begin(communicate=communicate)
            loss.backward()
            self.reducer.finish_backward()
            if self.used_only is not None:
                self.used_only.after_backward(self.reducer.arrived)
            if self.gatherer is not None:
                self.gatherer.release_all()
        self.micro_steps += 1

    def _refuse_without_training(self, call: str) -> None:
        if not self.spec.trains:
            raise RuntimeError(f"{call} on an engine with nothing to train: it was built without an optimizer "
                               "for a model whose parameters all have requires_grad=False (a reference or "
                               "teacher model), so it runs forward only; run it under torch.no_grad(), or give "
                               "zerodp.initialize an optimizer and set requires_grad=True on what to train")

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next backward() ends an accumulation, i.e. the step() after it updates."""
        return self.micro_steps - self._stepped_at + 1 >= self.gas

    @_names_peer_failure("engine.step() (gradient reduction, norm all_reduce, parameter all_gather)")
    def step(self) -> None:
        """Once gradient_accumulation_steps backward() calls have been made since the last update:
        reduce, unscale, clip, update, all-gather. Otherwise nothing.

        More backward() calls than that before step() (two at gradient_accumulation_steps 1) all
        add to this update, as PyTorch's loss.backward() twice then optimizer.step() does; step()
        with no backward() since the last update changes nothing, as PyTorch's does without grads."""
        self._refuse_without_training("step()")
        if self._no_sync:
            raise RuntimeError("step() inside no_sync(): call it after the block, once a backward() outside "
                               "no_sync() has reduced the gradients")
        if self.micro_steps - self._stepped_at < self.gas:
            return
        if self._unsynced:
            raise RuntimeError("step() with gradients from backward() inside no_sync() that no backward() "
                               "outside it has reduced yet: every rank would step on its own gradients; "
                               "run the last backward() of the accumulation outside no_sync()")
        micro, loss = self.micro_steps - self._stepped_at, self._window_loss
        with self.monitor.span("step"):
            self._step()
        if self.gatherer is not None:
            self.gatherer.stepped(self.global_steps)
        # Read when the monitor reports the step (a step later on a GPU): by then a decision left on
        # the device has been settled, and these say what they would have said at once.
        self.monitor.after_step(self.global_steps, loss, micro, self._grad_norm,
                                lambda: self.optimizer.param_groups[0]["lr"], self.scaler.scale,
                                lambda: self._skipped)

    def _step(self) -> None:
        """The update itself (step() decided that one is due)."""
        self._settle()
        if self._refused is not None:  # raised here, where every rank is, whichever read settled it
            error, self._refused = self._refused, None
            raise error
        self._stepped_at = self.micro_steps
        if self.gatherer is not None:
            self.gatherer.release_all()  # gathered copies are about to go stale
        with self.monitor.span("reduce_wait"):
            self.reducer.wait()
        grads = self.reducer.shard_grads()
        if self.reducer.grad_placements is not None:  # tensor parallelism: partial gradients summed over tp
            self.reducer.grad_placements.sum_over_tp(grads)
        flags = step_flags(self._window_loss, self.comm.everyone.rank)  # (with tp: the rank in the world)
        if self.used_only is None:
            norm_sq, flags = self.partitioned_optimizer.grad_norm_squared(grads, flags)
        else:  # the used bits ride in the same all-reduce
            norm_sq, flags = self.used_only.norm_and_agree(self.partitioned_optimizer, grads, flags)
        self._grad_norm, coef = clip_coefficient(norm_sq, self._scale_used, self.clip)
        if self._on_device and (self.used_only is None or self.used_only.uniform()):
            self._step_on_device(grads, coef, norm_sq, flags)
        else:
            self._step_on_host(grads, coef, norm_sq, flags)

    def _step_on_host(self, grads: list[torch.Tensor], coef: torch.Tensor | None, norm_sq: torch.Tensor,
                      flags: torch.Tensor | None) -> None:
        """The decision read here (read_back same_step), and acted on at once."""
        # The one host sync of the step, in every precision, on values every rank agrees on: a
        # non-finite norm (fp16 overflow, a nan/inf gradient) or loss anywhere skips the step.
        skip = not step_is_finite(norm_sq, flags, self.comm)
        if skip:
            self._skipped += 1
        else:
            self.partitioned_optimizer.step(grads, coef, defer_gather=self.forward_order is not None)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        if self.gatherer is not None and not skip:
            self.gatherer.refresh_persistent()
        self.scaler.update(skip)
        if self.used_only is not None:
            self.used_only.end_window(stepped=not skip)
        self.reducer.zero()
        self._window_loss = None
        self.global_steps += 1
        # Last, so that a NonFiniteError leaves a consistent engine (gradients freed, step counted).
        self.non_finite.after_step(self.global_steps, not skip, flags, self.scaler, self._scale_used,
                                   self.grad_norm if skip else 0.0)

    def _step_on_device(self, grads: list[torch.Tensor], coef: torch.Tensor | None, norm_sq: torch.Tensor,
                        flags: torch.Tensor | None) -> None:
        """The decision left on the device (read_back next_step): the fused optimizer skips on its
        found_inf; what the host does with the decision waits for _settle, in the next step."""
        skip = skip_on_device(norm_sq, flags)
        self.partitioned_optimizer.step(grads, coef, defer_gather=self.forward_order is not None, found_inf=skip)
        if self.gatherer is not None:
            self.gatherer.refresh_persistent()  # a skipped step left the masters as they were: the same values
        if self.used_only is not None:
            self.used_only.end_window(stepped=True)  # _settle takes it back if the step was skipped
        self.reducer.zero()
        self._window_loss = None
        self.global_steps += 1
        self._pending = pending_step(self.global_steps, skip, self._grad_norm, flags, self._scale_used)

    def _settle(self) -> None:
        """The host's part of a step decided on the device: the scheduler steps after a taken step;
        a skipped one is counted, logged and judged by the policy, whose error the next step() raises
        (a read of the engine's state on one rank only must not leave the others in a collective)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        finite, norm, flags = pending.read()
        if finite:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self._skipped += 1
            if self.used_only is not None:
                self.used_only.unstep()
        try:
            self.non_finite.after_step(pending.step, finite, flags, self.scaler, pending.scale_used,
                                       norm if not finite else 0.0)
        except NonFiniteError as e:
            self._refused = e

    @contextmanager
    def no_sync(self):
        """As DDP's no_sync: backward() inside reduces nothing; its gradients join those of the next
        backward() outside, which reduces them all. Stages 0-1 only: stages 2-3 reduce-scatter every
        gradient as backward produces it, to keep only a shard."""
        if self.spec.keeps_gradient_shard:
            raise RuntimeError(f"no_sync() is incompatible with ZeRO stage {self.stage}, which partitions "
                               "gradients as backward produces them; use stage 0 or 1, or "
                               "gradient_accumulation_steps, which reduces once per step in stage 1")
        if self._no_sync:
            raise RuntimeError("no_sync() is already active: it cannot be entered again inside itself")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def timings(self) -> dict[str, float]:
        """Milliseconds of each phase of the last step (forward, backward, reduce_wait, step, gather),
        with wall_clock_breakdown; {} without it."""
        return self.monitor.timings()

    def wait_for_parameters(self) -> None:
        """With overlap_param_gather, step() returns while the updated parameters are still being
        gathered and the next forward waits for them; call this to read them directly before that.
        A step decided on the device (non_finite.read_back) is settled too."""
        self._settle()
        self.partitioned_optimizer.wait_for_parameters()

    # ---- the spec's facts, read by name (zerodp.deepspeed, checkpoint/, plan/, the tests) ------------
    @property
    def stage(self) -> int:
        return self.spec.stage

    @property
    def batch(self) -> BatchSizes:
        return self.spec.batch

    @property
    def gas(self) -> int:
        """Gradient accumulation steps: backward() calls per optimizer step."""
        return self.spec.gas

    @property
    def shard_size(self) -> int:
        return self.spec.shard_size

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def units(self) -> Units | None:
        return self.spec.units

    @property
    def offload_param(self) -> bool:
        return self.spec.offload_param

    # ---- state ----------------------------------------------------------------------------------
    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm of the last step, before clipping (inf/nan after an fp16 overflow)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job (torch.distributed's default group)."""
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        """This process's index on its machine: torchrun's LOCAL_RANK (0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def world_size(self) -> int:
        """The data-parallel ranks the model is trained on (the engine's process group)."""
        return self.comm.world_size

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm or loss (reading it settles a step decided on
        the device: a wait for that step's device work)."""
        self._settle()
        return self._skipped

    def get_lr(self) -> list[float]:
        """Each param group's lr for the next step (settles a step decided on the device)."""
        self._settle()
        return [g["lr"] for g in self.optimizer.param_groups]

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def zero_grad(self) -> None:
        """Nothing to do: gradients live in the engine's buffers and are cleared by step()."""

    @contextmanager
    def gathered_parameters(self, params: Iterable[nn.Parameter] | None = None, modifier_rank: int | None = None):
        """Within the block the given parameters (default: all) are whole on every rank (stage 3 gathers
        and releases them; other stages always hold them whole). Changes made inside are not kept,
        unless modifier_rank is given: that rank's values then become every rank's weights and masters.
        Forwards inside gather nothing, so ranks may run different numbers of them (generate() of any
        length: the whole model in working precision on every rank, gathered once, bounded by
        comm_timeout_s); uneven_forwards() does it without the whole model."""
        self.wait_for_parameters()
        wanted = None if params is None else {id(p) for p in params}
        buckets = [b for b in self.layout.gathered
                   if wanted is None or any(id(s.param) in wanted for s in b.slots)]
        if self.gatherer is not None and any(b.index not in self.gatherer.gathered for b in buckets):
            self.gathered_state.entering("a gathered_parameters block")  # a lone state_dict() elsewhere learns of it
        with self.gatherer.gathered_parameters(buckets) if self.gatherer is not None else nullcontext():
            yield
            if modifier_rank is not None:
                self.partitioned_optimizer.adopt_working(buckets, modifier_rank, wanted)

    @contextmanager
    def uneven_forwards(self):
        """Forwards inside the block (under torch.no_grad()) may differ in number between ranks: generate()
        stopping at different lengths, an eval loop over data that does not divide the ranks. At stage 3,
        each unit's gather is agreed first, and a rank that leaves the block early keeps joining the
        others' gathers until every rank has left it (stage3.UnevenForwards); one small all_reduce per
        unit, no prefetch. Call it on every rank. Stages 0-2 gather nothing in a forward: only no_grad.
        Where the whole model fits on each rank, `gathered_parameters()` costs no collective per forward."""
        with torch.no_grad(), self.gatherer.uneven_forwards() if self.gatherer is not None else nullcontext():
            yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights of every rank, keyed like module.state_dict(), each tensor whole (joined over
        the tp group under tensor parallelism; collective). It gathers the whole model on every rank: files
        are written without that (zerodp.checkpoint.export_engine, from engine_weights, one bucket at a time)."""
        if self.gathered_state is not None:
            self.gathered_state.entering("full_state_dict()")
        weights = engine_weights(self)
        values = {name: t.clone() for name, t in weights.stream}
        return {name: values[weights.ties.get(name, name)] for name in weights.shapes}

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        keep_last: int | None = None) -> str:
        """Sharded checkpoint of everything needed to resume (collective: call on every rank)."""
        self.wait_for_parameters()
        if self.gathered_state is not None:
            self.gathered_state.entering("save_checkpoint()")
        return self._checkpoints().save_checkpoint(self, save_dir, tag, client_state, keep_last)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, optimizer_states: bool = True,
                        lr_scheduler_states: bool = True, module_only: bool = False) -> dict:
        """Restore a checkpoint saved on any world size; returns its client_state (collective).
        module_only restores the weights alone (no optimizer, scheduler, counters or RNG)."""
        self._settle()
        return self._checkpoints().load_checkpoint(self, load_dir, tag, optimizer_states, lr_scheduler_states,
                                                   module_only)

    def _checkpoints(self) -> CheckpointIO:
        if self.checkpoint_io is None:
            raise RuntimeError("this Engine was built without checkpoint_io, so it cannot save or load "
                               "checkpoints; build it with zerodp.initialize, or call "
                               "zerodp.checkpoint.save_checkpoint(engine, ...) / load_checkpoint(engine, ...)")
        return self.checkpoint_io

    @property
    def pending_micro_steps(self) -> int:
        """backward() calls since the last update that no step() has applied yet."""
        return self.micro_steps - self._stepped_at

    def drop_gradients(self) -> None:
        """The weights were replaced (a checkpoint was loaded): the gradients and the last norm are gone."""
        self.reducer.zero()
        self._grad_norm = None
        self._pending = None  # a loaded scheduler and counters replace what it would have changed
        self._refused = None

    def resume_counters(self, global_steps: int, skipped_steps: int) -> None:
        """A checkpoint's step counts, restarting at an accumulation boundary (the accumulation steps
        may differ from the saved run's when the world size did), with the loss scale now in force."""
        self.global_steps, self._skipped = global_steps, skipped_steps
        self.micro_steps = self._stepped_at = global_steps * self.gas
        self._scale_used = self.scaler.scale

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by category, counted from the tensors the engine owns."""
        return memory_report(self, self.reducer, self.partitioned_optimizer, self.gatherer is not None)

    # ---- the layout's model states, for checkpoint/, plan/ and the compatibility layers -----------
    # (self.layout: the buckets, this rank's shard, every trained parameter's slot; layout.py)
    def master_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 master of each bucket, by bucket index (the whole bucket in stage 0). Written
        in place, they become the weights at the next weights_from_masters()."""
        return self.partitioned_optimizer.masters

    def stepped_tensors(self) -> list[list[torch.Tensor]]:
        """Per bucket, what the optimizer steps: [its master shard], or, where it steps whole parameters,
        a view of the master in each owned parameter's shape (its state is keyed by these)."""
        return self.partitioned_optimizer.stepped

    @property
    def masters_are_copies(self) -> bool:
        """The fp32 masters are tensors of their own (mixed precision, offload), not the working shards."""
        return self.partitioned_optimizer.separate

    def full_master(self, b: Bucket) -> torch.Tensor:
        """Bucket b's fp32 master values from every rank (collective in stages 1-3)."""
        return self.partitioned_optimizer.full_master(b, self.partitioned_optimizer.masters[b.index])

    def full_frozen(self, b: Bucket) -> torch.Tensor:
        """Stage 3's frozen bucket b, whole, in fp32, from every rank's working shard (collective)."""
        full = torch.empty(b.numel, dtype=b.owned.dtype, device=self.device)
        self.comm.shard_gather(full, b.owned.to(self.device))
        return full.float()

    def weights_from_masters(self) -> None:
        """The working parameters from the fp32 masters, on every rank (collective): after the masters
        were written (a checkpoint loaded)."""
        self.partitioned_optimizer.all_gather()
        if self.gatherer is not None:
            self.gatherer.refresh_persistent()  # stage 3 keeps small parameters whole

    def on_new_gradient_buffer(self, callback: Callable[[torch.Tensor, str], None]) -> None:
        """callback(tensor, "grad" or "bucket") with each gradient or reduce buffer the reducer makes."""
        self.reducer.on_new_buffer.append(callback)

    def watch_gathers(self, watcher: Callable[[Bucket, BucketState], None]) -> None:
        """Stage 3: watcher(bucket, its state) now and at each gather and release of a bucket."""
        self.gatherer.watch(watcher)

    def step_counts(self) -> dict[str, int] | None:
        """Parameter name -> the optimizer steps it took, where unused parameters make them differ (saved
        in zerodp.json); None when every parameter takes every step."""
        if self.used_only is None:
            return None
        return self.used_only.counts_by_name({id(p): n for n, p in self.module.named_parameters()})

    def restore_step_counts(self, masters: list[torch.Tensor], saved: dict[str, int] | None) -> None:
        """After a checkpoint's optimizer state is loaded: each parameter's own step count back (`saved`
        is step_counts() as saved; None: the group's saved step for every one)."""
        if self.used_only is not None:
            names = {id(p): n for n, p in self.module.named_parameters()}
            self.used_only.after_load(self.optimizer, masters, names, saved)

    def advise_on_lone_state_dict(self, advice: str, answer: LoneCall = LoneCall.RAISE) -> None:
        """Stage 3: what a module.state_dict() called on some ranks only suggests instead (a compatibility
        layer names its own saving calls), and whether it raises or returns placeholders (LoneCall)."""
        if self.gathered_state is not None:
            self.gathered_state.advice, self.gathered_state.lone = advice, answer
