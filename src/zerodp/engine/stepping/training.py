"""Training added to a sharded module: gradients reduced into buckets during backward, the user's optimizer
stepped on this rank's fp32 master shards, the loss scale, clipping, and the step's outcome settled once.

Built only where something trains (the Engine, engine.py); a frozen model is its ShardedModule alone. It reads
the sharded part's layout and, at stage 3, tells its gatherer when gradients are in (release) and when a step
changed the weights (refresh); it subscribes to the sharded part's writes (`adopted`) to keep its masters equal
to weights written through gathered_parameters(modifier_rank=...).

One step, one path (`_update`): the decision (every rank's gradient norm and loss finite?) is made on the host,
read at once, or left on the device (non_finite.read_back next_step) and read a step later; either way it
becomes a PendingStep that `_settle` alone acts on: the scheduler steps after a taken step, a skipped one is
counted, the loss scale moves, and the non-finite policy judges it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from zerodp.config import Config
from zerodp.distributed.device import can_pin
from zerodp.engine.layout.flat import Bucket
from zerodp.engine.sharding.memory import whole_parameter_shares
from zerodp.engine.sharding.module import ShardedModule
from zerodp.engine.stepping.disk import DiskSettings
from zerodp.engine.stepping.forward_order import ForwardOrder
from zerodp.engine.stepping.low_precision import OptimizerPrecision
from zerodp.engine.stepping.non_finite import (
    NonFiniteError,
    NonFinitePolicy,
    PendingStep,
    decided_step,
    decides_on_device,
    pending_step,
    skip_on_device,
    step_flags,
    step_is_finite,
)
from zerodp.engine.stepping.optimizer import OptimizerLike, PartitionedOptimizer, clip_coefficient
from zerodp.engine.stepping.precision import LossScaler
from zerodp.engine.stepping.reducer import Reducer
from zerodp.engine.stepping.torch_state import TorchFormat
from zerodp.engine.stepping.unused import UsedParameters
from zerodp.engine.tensor_parallel.grads import GradPlacements, names_of
from zerodp.monitor.step import StepMonitor


class Training:
    """The stepping half of an Engine, over one ShardedModule."""

    def __init__(self, sharded: ShardedModule, optimizer: OptimizerLike, lr_scheduler: Callable | None):
        config, comm, spec = sharded.config, sharded.comm, sharded.spec
        self.sharded = sharded  # the model, its layout and (stage 3) its gatherer
        self.used_only = self._used_parameters(config)  # the parameters a step updates (unused.py); None: all
        # the user's optimizer on this rank's fp32 master shards, and the all-gather of the result
        self.partitioned_optimizer = self._partitioned(optimizer, config, sharded.take_fp32_shards())
        self.optimizer: Optimizer = self.partitioned_optimizer.optimizer  # the torch optimizer it steps
        # its state_dict() / load_state_dict() in a plain optimizer's format over the model's parameters
        po = self.partitioned_optimizer
        self.torch_format = TorchFormat(self.optimizer, po.user_params, po.buckets, po.masters, comm,
                                        sharded.layout.rank, spec.shards_optimizer, config.comm_timeout_s,
                                        on_disk=po.disk is not None)
        if po.carried is not None:  # the optimizer came with a state (a script's resume): onto the shards
            self.optimizer.load_state_dict(po.carried)
        sharded.adopted.append(self.partitioned_optimizer.adopt_working)  # weights written: masters follow
        self.forward_order = self._forward_order(config)  # overlap_param_gather's gather order; None without it
        self.reducer = self._reducer(config)  # gradients into buckets during backward, reduced (-scattered)
        self.scaler = LossScaler.from_config(config)  # fp16's dynamic loss scale; a fixed 1 otherwise
        self.lr_scheduler = self._scheduler(lr_scheduler, config)  # stepped after each step taken; None: none
        self.clip = config.gradient_clipping  # the global gradient norm is clipped to this (0: no clipping)
        self.clip_once: float | None = None  # clip_grad_norm_'s max_norm for the coming step; None: not called
        # the coming step's reduced gradient shards, norm and flags, when clip_grad_norm_ reduced them early
        self.reduced: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None] | None = None
        self.micro_steps = self.global_steps = 0  # backward() calls, optimizer steps (taken or skipped)
        self.stepped_at = 0  # micro_steps at the last update: the accumulation window starts there
        self.skipped = 0  # steps skipped for a non-finite gradient norm or loss
        self.scale_used = self.scaler.scale  # the loss scale this window's backward() calls multiplied by
        self.grad_norm: torch.Tensor | None = None  # the last step's global norm, before clipping
        self.non_finite = NonFinitePolicy(config, comm.everyone.rank)  # what a non-finite step does: skip, log, raise
        # non_finite.read_back: steps skipped on the device, their decision read a step later
        self.on_device = decides_on_device(config, self.optimizer, self.partitioned_optimizer.offload,
                                           self.scaler, spec.device)
        self.pending: PendingStep | None = None  # the last step, until the host has read its decision
        self.refused: NonFiniteError | None = None  # the policy's error from a settled step, for step() to raise
        self.window_loss: torch.Tensor | None = None  # the window's losses summed, for step_flags
        self.in_no_sync = self.unsynced = False  # inside no_sync(); gradients not yet reduced since
        comm.traffic.reset()  # the byte tally counts training, not set-up
        # steps_per_print, wall_clock_breakdown, monitors, comms_logger (zerodp.monitor)
        self.monitor = StepMonitor(config, comm, spec.device)
        self.monitor.instrument_gathers(self.partitioned_optimizer, sharded.gatherer)

    # ---- set-up -------------------------------------------------------------------------------------
    def _used_parameters(self, config: Config) -> UsedParameters | None:
        """Steps only the parameters that got a gradient (PyTorch's semantics); None when
        step_unused_parameters steps every one, the unused with a zero gradient (DeepSpeed's)."""
        if config.zero_optimization.step_unused_parameters:
            return None
        return UsedParameters(self.sharded.layout, self.sharded.comm)

    def _partitioned(self, optimizer: OptimizerLike, config: Config,
                     fp32_shards: list[torch.Tensor]) -> PartitionedOptimizer:
        zero, s = config.zero_optimization, self.sharded
        offload = zero.offload_optimizer
        precision = OptimizerPrecision(compensated_masters=config.bf16.bf16_master_weights_and_grads,
                                       bf16_states=config.bf16.bf16_optimizer_states)
        if offload.device != "nvme":
            return PartitionedOptimizer(optimizer, s.layout, fp32_shards, s.comm, s.spec, offload.device == "cpu",
                                        offload.pin_memory, zero.allgather_bucket_size, zero.sub_group_size,
                                        self.used_only, precision, params_on_disk=s.on_disk)
        # The disk tier: a missing, unwritable or full nvme_path (or too few buffers) on any rank is raised on
        # every rank, before the first collective that would leave the others waiting.
        disk = DiskSettings.from_config(config, offload.pin_memory and can_pin())
        error = part = None
        try:
            part = PartitionedOptimizer(optimizer, s.layout, fp32_shards, s.comm, s.spec, True, offload.pin_memory,
                                        zero.allgather_bucket_size, zero.sub_group_size, self.used_only, precision,
                                        disk, s.on_disk)
        except (OSError, ValueError) as e:
            error = e
        s.comm.agree(error, "zerodp.initialize (offload_optimizer \"nvme\")")
        return part

    def _forward_order(self, config: Config) -> ForwardOrder | None:
        """Stage 0 gathers nothing and stage 3 gathers per unit already."""
        if config.zero_optimization.overlap_param_gather and self.sharded.spec.gathers_after_step:
            return ForwardOrder(self.sharded.module, self.partitioned_optimizer)
        return None

    def _reducer(self, config: Config) -> Reducer:
        zero, s = config.zero_optimization, self.sharded
        acc_dtype = config.grad_accum_dtype or (torch.float32 if s.spec.gas > 1 else s.spec.dtype)
        done = None if s.gatherer is None else s.gatherer.gradients_done
        placements = GradPlacements(s.layout, s.comm, names_of(s.module)) if s.comm.tp is not None else None
        return Reducer(s.layout, s.comm, s.spec, acc_dtype, zero.overlap_comm, on_bucket_done=done,
                       comm_dtype=config.communication_dtype, prescale=config.prescale_gradients,
                       predivide=config.gradient_predivide_factor,
                       bucket_numel=s.layout.bucket_numel or zero.reduce_bucket_size, grad_placements=placements)

    def _scheduler(self, lr_scheduler: Callable | None, config: Config):
        """The given scheduler factory, else the config's, built on the partitioned optimizer."""
        if lr_scheduler is None and config.scheduler is not None:
            lr_scheduler = config.scheduler.build
        return lr_scheduler(self.optimizer) if lr_scheduler is not None else None

    # ---- backward -----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Scale (fp16) and divide by the accumulation steps (unless scale_wrt_gas is False: the caller's loss
        is already its share of the step, as DeepSpeed's backward(loss, scale_wrt_gas=False)), run autograd,
        reduce the buckets."""
        seen = loss.detach()  # kept on device, unsynced: step() reports which rank's loss was non-finite
        if isinstance(seen, DTensor):  # loss parallel: a Replicate DTensor (full_tensor: its value, no collective)
            seen = seen.full_tensor()
        self.window_loss = seen if self.window_loss is None else self.window_loss + seen.float()
        self.scale_used = self.scaler.scale
        factor = self.scale_used / (self.sharded.spec.gas if scale_wrt_gas else 1)
        if factor != 1:
            loss = loss.float() * factor
        communicate = self.is_gradient_accumulation_boundary() and not self.in_no_sync
        self.unsynced = self.in_no_sync or (self.unsynced and not communicate)
        gatherer = self.sharded.gatherer
        with self.monitor.span("backward"):
            self.reducer.begin(communicate=communicate)
            loss.backward()
            self.reducer.finish_backward()
            if self.used_only is not None:
                self.used_only.after_backward(self.reducer.arrived)
            if gatherer is not None:
                gatherer.release_all()
        self.micro_steps += 1

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next backward() ends an accumulation, i.e. the step() after it updates."""
        return self.micro_steps - self.stepped_at + 1 >= self.sharded.spec.gas

    @contextmanager
    def no_sync(self):
        """As DDP's no_sync: backward() inside reduces nothing; its gradients join those of the next
        backward() outside, which reduces them all. Stages 0-1 only: stages 2-3 reduce-scatter every
        gradient as backward produces it, to keep only a shard."""
        spec = self.sharded.spec
        if spec.keeps_gradient_shard:
            raise RuntimeError(f"no_sync() is incompatible with ZeRO stage {spec.stage}, which partitions "
                               "gradients as backward produces them; use stage 0 or 1, or "
                               "gradient_accumulation_steps, which reduces once per step in stage 1")
        if self.in_no_sync:
            raise RuntimeError("no_sync() is already active: it cannot be entered again inside itself")
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> None:
        """Once gradient_accumulation_steps backward() calls have been made since the last update:
        reduce, unscale, clip, update, all-gather. Otherwise nothing (see Engine.step)."""
        if self.in_no_sync:
            raise RuntimeError("step() inside no_sync(): call it after the block, once a backward() outside "
                               "no_sync() has reduced the gradients")
        if self.micro_steps - self.stepped_at < self.sharded.spec.gas:
            return
        if self.unsynced:
            raise RuntimeError("step() with gradients from backward() inside no_sync() that no backward() "
                               "outside it has reduced yet: every rank would step on its own gradients; "
                               "run the last backward() of the accumulation outside no_sync()")
        micro, loss = self.micro_steps - self.stepped_at, self.window_loss
        with self.monitor.span("step"):
            self._step()
        if self.sharded.gatherer is not None:
            self.sharded.gatherer.stepped(self.global_steps)
        # Read when the monitor reports the step (a step later on a GPU): by then a decision left on
        # the device has been settled, and these say what they would have said at once.
        self.monitor.after_step(self.global_steps, loss, micro, self.grad_norm,
                                lambda: self.optimizer.param_groups[0]["lr"], self.scaler.scale,
                                lambda: self.skipped)

    def _step(self) -> None:
        """The update itself (step() decided that one is due)."""
        grads, norm_sq, flags = self.reduced if self.reduced is not None else self._reduce()
        clip = self.clip if self.clip_once is None else min(c for c in (self.clip, self.clip_once) if c > 0)
        self.reduced, self.clip_once = None, None
        self.stepped_at = self.micro_steps
        self.grad_norm, coef = clip_coefficient(norm_sq, self.scale_used, clip)
        self._update(grads, coef, norm_sq, flags)

    def _reduce(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """The step's gradient shards, reduced, with their global squared norm and the step's flags."""
        self.settle()
        self._raise_refused()
        if self.sharded.gatherer is not None:
            self.sharded.gatherer.release_all()  # gathered copies are about to go stale
        with self.monitor.span("reduce_wait"):
            self.reducer.wait()
        grads = self.reducer.shard_grads()
        if self.reducer.grad_placements is not None:  # tensor parallelism: partial gradients summed over tp
            self.reducer.grad_placements.sum_over_tp(grads)
        flags = step_flags(self.window_loss, self.sharded.comm.everyone.rank)  # (with tp: the rank in the world)
        if self.used_only is None:
            norm_sq, flags = self.partitioned_optimizer.grad_norm_squared(grads, flags)
        else:  # the used bits ride in the same all-reduce
            norm_sq, flags = self.used_only.norm_and_agree(self.partitioned_optimizer, grads, flags)
        return grads, norm_sq, flags

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the step about to be taken: called after its last backward()
        and before step(), it reduces the gradients (the step's own reduction, done now), returns their
        global norm before clipping, and step() clips them to max_norm (and to gradient_clipping, if lower)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"engine.clip_grad_norm_ computes the 2-norm (zerodp's global gradient norm), got "
                             f"norm_type={norm_type}")
        if not max_norm > 0:
            raise ValueError(f"engine.clip_grad_norm_ expects max_norm > 0, got {max_norm}")
        if self.micro_steps - self.stepped_at < self.sharded.spec.gas or self.in_no_sync or self.unsynced:
            raise RuntimeError(
                f"engine.clip_grad_norm_({max_norm}) is called once per step, after its last backward() and "
                f"before step(): {self.micro_steps - self.stepped_at} of gradient_accumulation_steps="
                f"{self.sharded.spec.gas} backward() calls (outside no_sync) have been made since the last step; "
                "or set the config key gradient_clipping, which clips every step")
        if self.reduced is None:
            self.reduced = self._reduce()
        self.clip_once = float(max_norm)
        return (self.reduced[1].sqrt().float() / self.scale_used)

    def _update(self, grads: list[torch.Tensor], coef: torch.Tensor | None, norm_sq: torch.Tensor,
                flags: torch.Tensor | None) -> None:
        """Step or skip, on one decision every rank agrees on: a non-finite norm (fp16 overflow, a nan/inf
        gradient) or loss anywhere skips the step. On the host the decision is read here (the one host sync
        of the step) and acted on at once; on the device (read_back next_step) the fused optimizer skips on
        its found_inf, and the host reads the decision a step later. Either way `settle` acts on it."""
        on_device = self.on_device and (self.used_only is None or self.used_only.uniform())
        defer = self.forward_order is not None
        if on_device:
            skip = skip_on_device(norm_sq, flags)
            self.partitioned_optimizer.step(grads, coef, defer_gather=defer, found_inf=skip)
            taken = True  # as far as the host knows: settle() takes a skipped one back
        else:
            taken = step_is_finite(norm_sq, flags, self.sharded.comm)
            if taken:
                self.partitioned_optimizer.step(grads, coef, defer_gather=defer)
        if self.sharded.gatherer is not None and taken:
            self.sharded.gatherer.refresh_persistent()  # (skipped on the device: the masters' unchanged values)
        if self.used_only is not None:
            self.used_only.end_window(stepped=taken)
        self.reducer.zero()
        self.window_loss = None
        self.global_steps += 1
        self.pending = (pending_step(self.global_steps, skip, self.grad_norm, flags, self.scale_used) if on_device
                        else decided_step(self.global_steps, taken, self.grad_norm, flags, self.scale_used))
        if not on_device:
            self.settle()
            self._raise_refused()  # at once: the engine is consistent (gradients freed, step counted)

    def settle(self) -> None:
        """The host's part of the last step, once its decision is read: the scheduler steps after a taken
        step; a skipped one is counted and logged, and the loss scale moves; the policy's error is kept for
        step() to raise (a read of the engine's state on one rank only must not leave the others in a
        collective)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        finite, norm, flags = pending.read()
        if finite:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped += 1
            if self.used_only is not None and pending.on_device:
                self.used_only.unstep()
        if not pending.on_device:  # (a step decided on the device has a fixed loss scale: decides_on_device)
            self.scaler.update(not finite)
        try:
            self.non_finite.after_step(pending.step, finite, flags, self.scaler, pending.scale_used,
                                       norm if not finite else 0.0)
        except NonFiniteError as e:
            self.refused = e

    def _raise_refused(self) -> None:
        if self.refused is not None:  # raised where every rank is, whichever read settled it
            error, self.refused = self.refused, None
            raise error

    def wait_for_parameters(self) -> None:
        """The step's decision settled and the updated parameters' gathers (overlap_param_gather) done."""
        self.settle()
        self.partitioned_optimizer.wait_for_parameters()

    # ---- the model states, for checkpoint/ and the compatibility layers -------------------------------
    # (sharded.layout: the buckets, this rank's shard, every trained parameter's slot; layout.py)
    def master_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 master of each bucket, by bucket index (the whole bucket in stage 0). Written
        in place, they become the weights at the next weights_from_masters(). Compensated masters
        (bf16.bf16_master_weights_and_grads) are made fp32 for it, until the next step."""
        return self.partitioned_optimizer.materialised_masters()

    @contextmanager
    def model_states_in_memory(self):
        """A context in which master_shards(), the optimizer's state and the parameter shards are tensors in host
        memory: with the disk tiers (offload_optimizer / offload_param "nvme") they are read in for its body and
        written back after it, which a checkpoint's save or load needs (this rank's states are then in host
        memory at once); otherwise they always are."""
        with self.partitioned_optimizer.in_memory(), self.sharded.shards_in_memory():
            yield

    def stepped_tensors(self) -> list[list[torch.Tensor]]:
        """Per bucket, what the optimizer steps: [its master shard], or, where it steps whole parameters,
        a view of the master in each owned parameter's shape (its state is keyed by these)."""
        return self.partitioned_optimizer.stepped

    @property
    def masters_are_copies(self) -> bool:
        """The fp32 masters are tensors of their own (mixed precision, offload), not the working shards."""
        return self.partitioned_optimizer.separate

    @property
    def pending_micro_steps(self) -> int:
        """backward() calls since the last update that no step() has applied yet."""
        return self.micro_steps - self.stepped_at

    def on_new_gradient_buffer(self, callback: Callable[[torch.Tensor, str], None]) -> None:
        """callback(tensor, "grad" or "bucket") with each gradient or reduce buffer the reducer makes."""
        self.reducer.on_new_buffer.append(callback)

    def bytes(self) -> dict[str, int]:
        """What training holds on this rank (memory.memory_report): gradients and reduce buckets, fp32 masters
        and optimizer states (with offload, the host's copies), the step's transient fp32 gradient copy, and
        where parameters are stepped whole, this rank's share of the states beside 1/N of them."""
        layout, comm = self.sharded.layout, self.sharded.comm
        grads, opt = self.reducer.bytes(), self.partitioned_optimizer
        out = {"gradients": grads["gradients"], **opt.bytes(), "reduce_buckets": grads["reduce_buckets"],
               "reduce_whole_bucket": grads["reduce_whole_bucket"],
               # without offload, optimizer.step() feeds the optimizer `grad.float()` for non-fp32 gradients,
               # sub_group_size elements at a time
               "step_transient": opt.step_copy_bytes([b.shard_numel for b in layout.buckets], self.reducer.acc_dtype)}
        if any(b.whole for b in layout.buckets):
            tp = comm.tp.world_size if comm.tp is not None else 1
            out.update(whole_parameter_shares(layout.owned_numel(tp), layout.rank,
                                              out["fp32_master"] + out["optimizer_states"]))
        return out

    def full_master(self, b: Bucket) -> torch.Tensor:
        """Bucket b's fp32 master values from every rank (collective in stages 1-3)."""
        return self.partitioned_optimizer.full_master(b, self.partitioned_optimizer.masters[b.index])

    def drop_gradients(self) -> None:
        """The weights were replaced (a checkpoint was loaded): the gradients and the last norm are gone."""
        self.reducer.zero()
        self.grad_norm = None
        self.pending = None  # a loaded scheduler and counters replace what it would have changed
        self.refused = None

    def resume_counters(self, global_steps: int, skipped_steps: int) -> None:
        """A checkpoint's step counts, restarting at an accumulation boundary (the accumulation steps
        may differ from the saved run's when the world size did), with the loss scale now in force."""
        self.global_steps, self.skipped = global_steps, skipped_steps
        self.micro_steps = self.stepped_at = global_steps * self.sharded.spec.gas
        self.scale_used = self.scaler.scale

    def remove_hooks(self) -> None:
        """The gradient hooks and the forward's gather waits removed (DeepSpeed's destroy)."""
        self.reducer.remove_hooks()
        if self.forward_order is not None:
            self.forward_order.remove_hooks()

    def weights_from_masters(self) -> None:
        """The working parameters from the fp32 masters, on every rank (collective): after the masters
        were written (a checkpoint loaded)."""
        self.partitioned_optimizer.all_gather()
        if self.sharded.gatherer is not None:
            self.sharded.gatherer.refresh_persistent()  # stage 3 keeps small parameters whole

    def step_counts(self) -> dict[str, int] | None:
        """Parameter name -> the optimizer steps it took, where unused parameters make them differ (saved
        in zerodp.json); None when every parameter takes every step."""
        if self.used_only is None:
            return None
        return self.used_only.counts_by_name({id(p): n for n, p in self.sharded.module.named_parameters()})

    def restore_step_counts(self, masters: list[torch.Tensor], saved: dict[str, int] | None) -> None:
        """After a checkpoint's optimizer state is loaded: each parameter's own step count back (`saved`
        is step_counts() as saved; None: the group's saved step for every one)."""
        if self.used_only is not None:
            names = {id(p): n for n, p in self.sharded.module.named_parameters()}
            self.used_only.after_load(self.optimizer, masters, names, saved)
