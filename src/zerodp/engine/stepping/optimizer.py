"""The partitioned optimizer: fp32 master shards, the user's optimizer on them, norm, clip, gather.

Each bucket's shard owned by this rank gets one fp32 `master` tensor; the user's optimizer is
rewired to step on those tensors only, so its state (Adam's m and v) exists for 1/N of the model.
In fp32 training the master is the shard of the flat working buffer itself (no second copy).
After the step the updated shards are cast to working precision and all-gathered back into the
flat buffers, which the module's parameters are views of.

Whole parameters (optimizer_view.py: Adafactor, Muon, ...): a bucket laid out `whole` holds each parameter
in one rank's shard, and the optimizer steps, instead of the master shard, a view of it in each owned
parameter's shape (`stepped`), its gradient the same view of the gradient shard: its state is in that
shape, and nothing else changes (the masters, offload, the norm and the gather are per bucket as before).

ZeRO-Offload (`offload=True`): masters, their gradients and the optimizer state live in (pinned)
host memory and the user's optimizer steps on the CPU; the device keeps only the working
parameters and the gradient buckets. Gradient shards go out and updated weights come back with
non-blocking copies of one dtype each (offload.py: one host block, casts on the host), and a torch
Adam/AdamW that chose no implementation steps with its fused CPU kernel.

Low precision (low_precision.py, bf16.bf16_master_weights_and_grads / bf16_optimizer_states): between steps
a master is its working shard plus an int16 remainder (`remainders`; the fp32 tensor, which the optimizer
keys its state by, keeps no storage), and the per-element states are bf16. Each sub_group_size part of the
step makes them fp32, steps, and puts them back (`_materialise`, `_settle`); reading the masters
(checkpoints, full_master) makes them fp32 until the next step.

ZeRO-Infinity's disk tier (`disk`: offload_optimizer "nvme"): the same host step, with the masters and the
optimizer state in a file of this rank's, streamed through a bounded pool of host buffers one sub-group at a
time (disk.py); each stepped master is copied to its working shard before it is written back.
Stage 3's working shards on disk (offload_param "nvme", sharding/on_disk.py): each new one goes through a host
buffer of that tier to its file (`_writing`); the step ends when every write is done, on every rank.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext

import torch
from torch.optim import Optimizer

from zerodp.distributed.comm import Comm
from zerodp.distributed.device import can_pin
from zerodp.engine.layout.flat import ALIGN, Bucket
from zerodp.engine.layout.layout import Layout
from zerodp.engine.layout.spec import EngineSpec
from zerodp.engine.sharding.on_disk import ShardsOnDisk
from zerodp.engine.stepping.disk import DiskSettings, DiskTier
from zerodp.engine.stepping.low_precision import (
    OptimizerPrecision,
    StateRounding,
    first_remainder,
    join_master,
    per_element,
    split_master,
)
from zerodp.engine.stepping.offload import HostShards, use_fused_kernel
from zerodp.engine.stepping.optimizer_view import OptimizerLike, has_stepped, rewired
from zerodp.engine.stepping.unused import UsedParameters
from zerodp.engine.tensor_parallel.whole import WholeOverTp
from zerodp.monitor.timers import TimedGathers, gather_phase


class PartitionedOptimizer(TimedGathers):
    def __init__(self, optimizer: OptimizerLike, layout: Layout, fp32_shards: list[torch.Tensor],
                 comm: Comm, spec: EngineSpec, offload: bool = False, pin_memory: bool = True,
                 allgather_bucket_size: int = 500_000_000, sub_group_size: int = 100_000_000,
                 used_only: UsedParameters | None = None, precision: OptimizerPrecision = OptimizerPrecision(),
                 disk: DiskSettings | None = None, params_on_disk: ShardsOnDisk | None = None):
        if disk is not None and precision.low:
            raise ValueError("bf16.bf16_optimizer_states / bf16_master_weights_and_grads with offload_optimizer "
                             "\"nvme\" is not supported: the disk tier streams fp32 masters and states; use "
                             "offload_optimizer \"cpu\" (bf16 states) or none")
        offload = offload or disk is not None  # the disk tier steps on the host too
        self.comm, self.offload = comm, offload
        self.params_on_disk = params_on_disk  # offload_param "nvme": the working shards' file (None: in memory)
        self.precision = precision  # masters and states below fp32 between steps (low_precision.py)
        self.sharded = spec.shards_optimizer  # False (stage 0): every rank steps every bucket whole
        self.gathers_after_step = spec.gathers_after_step
        self.allgather_numel = allgather_bucket_size
        self.sub_group_numel = sub_group_size
        self.pending: deque = deque()  # (bucket index, work) of parameter gathers in flight
        self.used_only = used_only  # parameters without a gradient are not stepped (None: all are)
        self.rank = layout.rank
        self.buckets: list[Bucket] = layout.buckets
        # Tensor parallelism, tp rank > 0: 0 for the gradient rows of parameters that every tp rank holds
        # alike (plain or Replicate: tp rank 0 counts them), 1 for tp shards; None: every row counts.
        self.tp_counted = None
        if comm.tp is not None and comm.tp.rank > 0 and self.buckets:
            rows = torch.cat([b.duplicate_rows(self.rank) for b in self.buckets]).logical_not()
            self.tp_counted = rows.float().to(self.buckets[0].data.device)
        # `separate`: the master is its own fp32 tensor, so updates must be copied to the working buffer.
        # With stage 3's offload_param the working shard is in host memory: the master stays on the
        # device (unless offload) so that the optimizer does not follow it to the host.
        self.separate = bool(self.buckets) and (offload or self.buckets[0].data.dtype != torch.float32
                                                or self.buckets[0].owned.device != self.buckets[0].data.device
                                                or params_on_disk is not None)
        self.host: HostShards | None = None  # offload: masters, gradients and staging in host memory
        self.disk: DiskTier | None = None  # offload to disk: masters and optimizer states in this rank's file
        self.masters = self._masters(fp32_shards, offload and pin_memory and can_pin(), sub_group_size, disk)
        self.set_gather_order(list(range(len(self.buckets))))
        # Whole parameters that are tensor-parallel shards: stepped as the whole matrix, gathered over tp.
        self.whole_over_tp = WholeOverTp(self.buckets, self.rank, comm, self.masters)
        # What the optimizer steps of each bucket: its master shard (flat, element-wise optimizers), or a
        # view of the master in each owned parameter's own shape (whole parameters: optimizer_view.py; a
        # tp shard's whole matrix, whole_over_tp.py).
        self.stepped: list[list[torch.Tensor]] = [self._stepped(b, m) for b, m in zip(self.buckets, self.masters)]
        self.optimizer = self._take(optimizer, layout)  # (and user_params, carried)
        # The user's optimizer object now steps on master shards whose gradients only the engine sets:
        # a step called on it by the user (a PyTorch loop's `optimizer.step()`) would change nothing.
        # torch's step pre-hook lets it say so instead.
        self._stepping = False
        for opt in [self.optimizer, *getattr(self.optimizer, "optimizers", [])]:  # a list's each, too
            opt.register_step_pre_hook(self._only_from_engine)
        # offload: a torch Adam/AdamW that chose no implementation now steps with its fused CPU kernel
        self.fused_on_host = offload and use_fused_kernel(self.optimizer)
        device = self.masters[0].device if self.masters else torch.device("cpu")
        self.rounding = StateRounding(self.rank, device) if precision.bf16_states else None  # bf16 states' noise
        self.remainders: list[torch.Tensor] = []  # compensated masters: what fp32 adds to each working shard
        if precision.compensated_masters:
            self._compensate()
        if self.disk is not None:
            self.disk.open(self.optimizer)  # the masters (and any initial state) go to disk

    def _take(self, optimizer: OptimizerLike, layout: Layout) -> Optimizer:
        """The user's optimizer rewired to step `stepped`. One that has stepped or loaded a state (a DDP
        script's resume, before initialize as nanoGPT does) leaves it in `carried`, to be loaded again onto
        the shards in torch's format (torch_state.py)."""
        # The parameters the user's optimizer was built on, per group, as torch numbers them in its state_dict
        # (a factory's: each group's trained parameters in bucket order): torch_state.py keys the state so.
        self.user_params: list[list[torch.Tensor]] = _user_params(optimizer, layout)
        per_group = [[t for b, ts in zip(self.buckets, self.stepped) if b.group == g.index for t in ts]
                     for g in layout.groups]
        shapes = {id(s.param): layout.shape_of(s) for _, s in layout.slots()}
        self.carried: dict | None = optimizer.state_dict() if has_stepped(optimizer, shapes) else None
        return rewired(optimizer, per_group, shapes)

    def _compensate(self) -> None:
        """Masters from here on: the working shard + an int16 remainder; the fp32 tensors let go of their storage."""
        if self.offload or not self.separate or self.buckets[0].data.dtype != torch.bfloat16:
            raise ValueError("bf16.bf16_master_weights_and_grads needs bf16.enabled and no offload_optimizer")
        if self.params_on_disk is not None:
            raise ValueError("bf16.bf16_master_weights_and_grads with offload_param \"nvme\" is not supported: a "
                             "compensated master is its working shard plus a remainder, and the working shards are "
                             "on disk between uses; use offload_param \"cpu\" or none")
        for k, (b, m) in enumerate(zip(self.buckets, self.masters)):
            if m.untyped_storage().nbytes() != m.numel() * 4:  # a view of a larger block: freed alone, it must own it
                raise RuntimeError(f"bucket {k}'s fp32 master is a view; compensated masters need their own")
            self.remainders.append(first_remainder(m.detach(), b.owned))
            m.untyped_storage().resize_(0)

    def _materialise(self, k: int) -> bool:
        """Compensated masters: master k in fp32 (True if it was not already)."""
        m = self.masters[k]
        if not self.remainders or m.untyped_storage().nbytes() or not m.numel():
            return False
        m.untyped_storage().resize_(m.numel() * 4)
        join_master(self.buckets[k].owned, self.remainders[k], m.detach())
        return True

    def _settle(self, k: int) -> None:
        """Compensated masters: master k back into the working shard and its remainder, its fp32 storage freed."""
        m = self.masters[k]
        if self.remainders and m.untyped_storage().nbytes():
            split_master(m.detach(), self.buckets[k].owned, self.remainders[k])
            m.untyped_storage().resize_(0)

    def materialised_masters(self) -> list[torch.Tensor]:
        """Every master in fp32 (compensated ones stay so until the next step or gather)."""
        for k in range(len(self.masters)):
            self._materialise(k)
        return self.masters

    def _masters(self, fp32_shards: list[torch.Tensor], pin: bool, sub_group_size: int,
                 disk: DiskSettings | None) -> list[torch.Tensor]:
        """The fp32 master of each bucket: in the host block (offload), in host tensors the disk tier empties once
        the optimizer is built on them (disk), or the fresh shards / the working shards themselves."""
        if disk is not None:
            if any(b.whole for b in self.buckets):
                raise ValueError("offload_optimizer \"nvme\" keeps flat fp32 shards on disk; an optimizer that steps "
                                 "whole parameters (Adafactor, Muon, ...) is not supported there: use \"cpu\"")
            masters = [torch.empty(s.numel(), dtype=torch.float32).copy_(s) for s in fp32_shards]
            self.disk = DiskTier(masters, sub_group_size, self.rank, disk)
            return masters
        if self.offload:
            working = self.buckets[0].data.dtype if self.buckets else torch.float32
            self.host = HostShards(fp32_shards, working, pin)
            return self.host.masters
        # The engine hands over fresh fp32 shards whenever the master is separate: they become it.
        return [shard if self.separate else b.owned for b, shard in zip(self.buckets, fp32_shards)]

    def _stepped(self, b: Bucket, m: torch.Tensor) -> list[torch.Tensor]:
        """The tensors the optimizer steps for bucket b, whose master is m (see __init__)."""
        if not b.whole:
            return [m]
        first = self.rank * b.shard_numel
        return [self.whole_over_tp.stepped(b.index, j, m.detach()[lo - first:hi - first].view(s.shape))
                for j, (_, s, lo, hi) in enumerate(b.owned_slots(self.rank))]

    def _only_from_engine(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._stepping:
            raise RuntimeError(f"{type(optimizer).__name__}.step() was called directly, on an optimizer that "
                               "zerodp.initialize rewired to the engine's parameter shards, where it would "
                               "change nothing: call engine.step() instead (it reduces the gradients, clips, "
                               "steps this optimizer and gathers the new weights)")

    def grad_norm_squared(self, grads: list[torch.Tensor], flags: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum of squares of the full gradient, on every rank (inf/nan if any rank overflowed), and
        `flags` (non_finite.step_flags) summed over ranks in the same one all-reduce. Stage 0's
        gradients are already identical on every rank, so its norm needs no reduction; its flags
        (a loss may be non-finite on one rank with every gradient finite) get a small one of their own."""
        local = self._local_norm_squared(grads)
        if self.comm.replica_rank > 0:  # hierarchical: count each shard once, not once per copy
            local = torch.zeros_like(local)
        flags = local.new_zeros(0) if flags is None else flags.to(local.device)
        if not self.sharded:
            if self.comm.world_size > 1 and flags.numel():
                self.comm.all_reduce(flags)
            return local, flags
        both = torch.cat([local.reshape(1), flags])
        # With tensor parallelism, over dp x tp: tp shards sum, and every rank makes one decision.
        self.comm.everyone.all_reduce(both)
        return both[0], both[1:]

    def _local_norm_squared(self, grads: list[torch.Tensor]) -> torch.Tensor:
        device = self.buckets[0].data.device if self.buckets else torch.device("cpu")
        local = torch.zeros((), dtype=torch.float64, device=device)
        if grads:
            # fp32 norms of ALIGN-element rows, summed in fp64: within 1e-8 (relative) of an fp64
            # norm with no fp64 copy of the gradients, and independent of the bucket layout, since
            # every parameter starts a row.
            rows = torch.cat([torch.linalg.vector_norm(g.view(-1, ALIGN), dim=1, dtype=torch.float32) for g in grads])
            if self.tp_counted is not None:  # tp: rows every tp rank holds alike count on tp rank 0 only
                rows = rows * self.tp_counted
            local = rows.double().square().sum()
        return local

    def step(self, grads: list[torch.Tensor], coef: torch.Tensor | None, defer_gather: bool = False,
             found_inf: torch.Tensor | None = None) -> None:
        """Scale the shard gradients by `coef` (unscale x clip), step, and gather the new weights.
        found_inf (a fused optimizer's, 1.0 or 0.0 on the device): the kernel skips the step on 1.0."""
        self.wait_for_parameters()  # the last gather writes the working shards the step rewrites
        if self.host is not None:
            self.host.receive_gradients(grads)
        if self.offload:  # (on disk too) the host steps: its scale is a host tensor
            coef = None if coef is None else coef.cpu()
        # A fused optimizer (Adam/AdamW fused=True) divides by `grad_scale` inside its kernel, as
        # for torch's GradScaler: unscale and clip with no pass of their own over the gradients.
        fold = coef is not None and getattr(self.optimizer, "_step_supports_amp_scaling", False)
        if fold:
            self.optimizer.grad_scale = coef.reciprocal()
        if found_inf is not None:
            self.optimizer.found_inf = found_inf
        self._stepping = True
        try:
            if self.disk is not None:
                self._step_from_disk(grads, coef, fold)
            else:
                self._step_sub_groups(grads, coef, fold)
        finally:
            self._stepping = False
            self.optimizer.__dict__.pop("found_inf", None)
        if fold:
            del self.optimizer.grad_scale
        self.all_gather(defer=defer_gather)

    def _step_sub_groups(self, grads: list[torch.Tensor], coef: torch.Tensor | None, fold: bool) -> None:
        """The user's optimizer stepped over the master shards, `sub_group_size` elements at a time."""
        for part in self.sub_groups([g.numel() for g in grads], grads[0].dtype if grads else torch.float32):
            for k in part:
                self._materialise(k)
                self.masters[k].grad = (self.host.grads[k] if self.host is not None else
                                        grads[k] if grads[k].dtype == torch.float32 else grads[k].float())
            self._step_part(part, coef, fold)
            for k in part:
                self._settle(k)

    def _step_from_disk(self, grads: list[torch.Tensor], coef: torch.Tensor | None, fold: bool) -> None:
        """The sub-groups streamed from disk, each stepped and sent to its working shard; an I/O error on any
        rank is raised on every rank (before the gather that would leave the others waiting)."""
        error = None
        try:
            self.disk.stream(self.optimizer, grads, lambda part: self._step_part(part, coef, fold), self._send)
        except OSError as e:
            error = e
        self.comm.agree(error, "the optimizer step (offload_optimizer \"nvme\")")

    def _send(self, k: int, m: torch.Tensor) -> None:
        with self._writing(self.buckets[k]):
            self.buckets[k].owned.copy_(m)

    def _writing(self, b: Bucket):
        """b.owned in host memory to be written (offload_param "nvme": a buffer, then written to the file)."""
        return self.params_on_disk.updating(b) if self.params_on_disk is not None else nullcontext()

    def _step_part(self, part: list[int], coef: torch.Tensor | None, fold: bool) -> None:
        """One optimizer.step() over masters[part], their gradients set."""
        masters = [self.masters[k] for k in part]
        if coef is not None and not fold:
            torch._foreach_mul_([m.grad for m in masters], coef)
        whole = [k for k in part if self.buckets[k].whole]
        for k in whole:
            self.whole_over_tp.gather(k, self.masters[k], self.buckets[k].data.device)
            self._whole_gradients(k)
        stepped = [t for k in part for t in self.stepped[k]]
        if self.rounding is not None:
            self.rounding.widen(self.optimizer, stepped)
        if self.used_only is None:
            self.optimizer.step()  # parameters whose .grad is None are left alone
        else:
            with self.used_only.only_used(self.optimizer, self.masters, [k for k in part if not self.buckets[k].whole]):
                self.optimizer.step()
        if self.rounding is not None:
            self.rounding.narrow(self.optimizer, stepped)
        for m in masters:
            m.grad = None
        for k in whole:
            self.whole_over_tp.put_back(k, self.masters[k])
            for t in self.stepped[k]:
                t.grad = None

    def _whole_gradients(self, k: int) -> None:
        """Bucket k's owned parameters get their gradients in their own shape (views of the master's
        gradient); a parameter that no rank used in this step gets none, so the optimizer leaves it alone
        (unused.py's semantics, here given by the optimizer itself)."""
        b, g = self.buckets[k], self.masters[k].grad
        first = self.rank * b.shard_numel
        used = None if self.used_only is None else self.used_only.used_slots(k)
        for j, (t, (_, s, lo, hi)) in enumerate(zip(self.stepped[k], b.owned_slots(self.rank))):
            if used is not None and not used[j]:
                t.grad = None
            elif not self.whole_over_tp.gathers(k, j):  # (a gathered matrix has its whole gradient already)
                t.grad = g[lo - first:hi - first].view(s.shape)

    def sub_groups(self, numels: list[int], grad_dtype: torch.dtype) -> list[list[int]]:
        """Buckets stepped together. Low-precision gradients need an fp32 copy for the step: taken
        `sub_group_size` elements at a time (DeepSpeed's sub_group_size), that copy is at most
        4 bytes x max(sub_group_size, largest shard); fp32 gradients are stepped in one call."""
        if (self.offload or grad_dtype == torch.float32) and not self.precision.low:
            return [list(range(len(numels)))] if numels else []
        parts, size = [[]], 0
        for k, n in enumerate(numels):
            if parts[-1] and size + n > self.sub_group_numel:
                parts.append([])
                size = 0
            parts[-1].append(k)
            size += n
        return parts

    def step_copy_bytes(self, numels: list[int], grad_dtype: torch.dtype) -> int:
        """Bytes of the largest fp32 gradient copy one optimizer.step() call makes (0 if none). With
        offload, the device's fp32 temporary of a gradient shard in a third dtype (HostShards). Low
        precision adds the part's fp32 master and states (per element: as many as the states hold now). On disk
        the gradients go into the pool's buffers (disk.py), counted there."""
        if self.disk is not None:
            return 0
        if self.precision.low:
            first = next(iter(self.optimizer.state.items()), None)
            states = len(per_element(first[1], first[0], torch.bfloat16)) if first and self.rounding else 0
            per = (4 if self.remainders else 0) + 4 * states + (4 if grad_dtype != torch.float32 else 0)
            return max((per * sum(numels[k] for k in part) for part in self.sub_groups(numels, grad_dtype)), default=0)
        if self.host is not None:
            third = grad_dtype not in (torch.float32, self.host.working)
            on_device = bool(self.buckets) and self.buckets[0].data.device.type != "cpu"
            return 4 * max(numels, default=0) if third and on_device else 0
        if grad_dtype == torch.float32:
            return 0
        return max((4 * sum(numels[k] for k in part) for part in self.sub_groups(numels, grad_dtype)), default=0)

    @gather_phase
    def all_gather(self, defer: bool = False) -> None:
        """Copy each master shard into the working buffer and gather every rank's shard.

        Stage 3 gathers nothing here: modules gather their parameters when they next run. At most
        `allgather_bucket_size` elements are in flight at once (the oldest gather is waited for).
        Buckets go in `gather_order` (the next forward's order once known). With `defer` the last
        gathers are left in flight for `wait_for_parameters` (overlap_param_gather).
        """
        self.wait_for_parameters()
        in_flight = 0
        for k in self.gather_order:
            b, m = self.buckets[k], self.masters[k]
            if self.disk is not None:
                if not self.disk.sent:  # (a step sent each master as it stepped it)
                    self._send(k, self.disk.master(k))
            elif self.host is not None:
                with self._writing(b):
                    self.host.send_weights(k, b.owned)
            elif self.remainders:
                self._settle(k)  # (masters read or written since the step: their new values split)
            elif self.separate:
                with self._writing(b):  # (a buffer written to disk after it: the copy must be done by then)
                    b.owned.copy_(m, non_blocking=self.params_on_disk is None)
            if self.gathers_after_step:
                while self.pending and in_flight + b.numel > self.allgather_numel:
                    in_flight -= self.buckets[self.pending[0][0]].numel
                    self.pending.popleft()[1].wait()
                self.pending.append((k, self.comm.shard_gather(b.data, b.owned, async_op=True)))
                in_flight += b.numel
        if self.host is not None:
            self.host.send_done()
        if self.disk is not None:
            self.disk.sent = False
        if self.params_on_disk is not None:
            self._flush_parameters()
        if not defer:
            self.wait_for_parameters()

    def _flush_parameters(self) -> None:
        """Every working shard written to its file; a failed write on any rank is raised on every rank."""
        error = None
        try:
            self.params_on_disk.flush()
        except OSError as e:
            error = e
        self.comm.agree(error, "writing the updated parameter shards (offload_param \"nvme\")")

    def adopt_working(self, buckets: list[Bucket], params: set[int] | None) -> None:
        """The sharded module wrote one rank's working values of `params` (ids; None: all) into `buckets`
        (whole on every rank, ShardedModule.gathered_parameters' modifier_rank): the fp32 masters take
        them. The other parameters' masters keep their fp32 values; frozen buckets have none."""
        if not self.separate:  # the masters are the working shards themselves
            return
        with self.in_memory():
            self._adopt(buckets, params)

    def _adopt(self, buckets: list[Bucket], params: set[int] | None) -> None:
        for b in buckets:
            if b.frozen:
                continue
            lo = self.rank * b.shard_numel
            whole = bool(self.remainders) and self.masters[b.index].untyped_storage().nbytes() > 0
            for _, s, start, end in b.owned_slots(self.rank):
                if params is None or id(s.param) in params:
                    if self.remainders:  # the working value is the master: no remainder left
                        self.remainders[b.index][start - lo:end - lo].zero_()
                    if not self.remainders or whole:
                        self.masters[b.index][start - lo:end - lo].copy_(b.data[start:end])

    @gather_phase
    def wait_for_parameters(self, upto: int | None = None) -> None:
        """Wait for the parameter gathers in flight: all, or those of gather_order[:upto]."""
        while self.pending and (upto is None or self.position[self.pending[0][0]] < upto):
            self.pending.popleft()[1].wait()

    def set_gather_order(self, order: list[int]) -> None:
        self.wait_for_parameters()
        self.gather_order = order
        self.position = {k: i for i, k in enumerate(order)}

    def in_memory(self):
        """A context in which every master and optimizer state is a tensor in host memory (on disk they are
        read in, and written back after it): for checkpoints and anything else that reads them as tensors."""
        return self.disk.resident(self.optimizer) if self.disk is not None else nullcontext()

    def full_master(self, b: Bucket, m: torch.Tensor) -> torch.Tensor:
        """One bucket's fp32 master values from every rank (collective in stages 1-2)."""
        fresh = self._materialise(b.index)
        if self.disk is not None:
            m = self.disk.master(b.index)
        if not self.sharded:
            full = m.detach().clone()
        else:
            full = torch.empty(b.numel, dtype=torch.float32, device=b.data.device)
            self.comm.shard_gather(full, m.detach().to(b.data.device))
        if fresh:  # read only: the fp32 copy goes again
            m.untyped_storage().resize_(0)
        return full

    def bytes(self) -> dict[str, int]:
        """Bytes of fp32 master and optimizer state; on the host when offloaded, on disk with the disk tier
        (then also the file's bytes and the host buffers it streams through)."""
        if self.disk is not None:
            return {**self.disk.bytes(), "offload_gradients": 0}
        master = sum(m.numel() * 4 for m in self.masters) if self.separate and not self.remainders else 0
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        host = self.host.bytes() if self.host is not None else {"offload_gradients": 0}
        return {"fp32_master": master, "master_remainders": sum(r.numel() * 2 for r in self.remainders),
                "optimizer_states": state, **host}


def _user_params(optimizer: OptimizerLike, layout: Layout) -> list[list[torch.Tensor]]:
    if isinstance(optimizer, Optimizer):
        return [list(g["params"]) for g in optimizer.param_groups]
    return [[s.param for b in g.buckets for s in b.slots] for g in layout.groups]


def clip_coefficient(norm_sq: torch.Tensor, loss_scale: float, clip: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(true gradient norm, multiplier that unscales and clips), computed on device without a sync.

    The multiplier follows torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), capped at 1.
    """
    norm = norm_sq.sqrt().float() / loss_scale
    if clip <= 0:
        return norm, (None if loss_scale == 1 else torch.full_like(norm, 1 / loss_scale))
    coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
    return norm, coef if loss_scale == 1 else coef / loss_scale

