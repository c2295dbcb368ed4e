"""Gradient hooks, buckets, and their overlapped reduction.

As backward accumulates each parameter's gradient, a `post_accumulate_grad` hook copies it into
its bucket and frees it (a tensor-parallel gradient first brought to its parameter's placement:
grad_placement.py). A bucket whose parameters have all arrived is launched asynchronously
while backward goes on (`overlap_comm`):
  stage 0: all_reduce of the bucket (plain data parallelism, every rank keeps everything);
  stage 1: gradients accumulate in a full bucket; reduce_scatter once, at the boundary micro-step;
  stage 2, 3: gradients pass through a pooled bucket buffer and are reduce_scattered every
           micro-step; each rank keeps only its shard. In stage 3 a bucket whose gradients have all
           arrived is also handed to `on_bucket_done`, which frees its gathered parameters.
Buckets are launched strictly in index order so that every rank issues the same collectives in the
same order, whatever order its hooks fire in (unused parameters differ between ranks).

Two states, each a named type, decide what happens (FSDP2's TrainingState / ShardedState):
  `Pass`   what a gradient arriving now does: IDLE outside engine.backward() (an error), ACCUMULATE
           (summed into its bucket; stages 0, 1 before the boundary micro-step), REDUCE (summed, and
           its bucket becomes ready once its last gradient is in).
  `Window` what the gradient buffers hold since zero(): EMPTY (the window's first backward: the first
           gradient into each place is copied, not added), SUMMED (local sums of full buckets, or this
           rank's reduced shards), REDUCED (full buckets hold the reduced mean; the next backward()
           first reopens them, `_reopen`).
Launch rule: in a REDUCE pass the lowest bucket not yet launched is launched as soon as it is ready,
and then the next while it is ready too; finish_backward() makes every bucket ready (a bucket no
gradient reached takes part as zeros) and launches the rest.
Retire rule: reductions retire oldest first: at once without overlap_comm, when a new pool buffer
would exceed the pool, and all of them at wait() (before the step; at the end of each backward with
sharded gradients; before a REDUCED window is reopened). Retiring applies the post factor; a full
bucket sent as a copy (another dtype) takes its reduced values back; a reduced shard goes into the
gradient, copied in an EMPTY window, added in a SUMMED one, or already there when the reduce_scatter
wrote straight into it (`InFlight.into_grad`), and its pool buffer goes back to the pool.

The mean over ranks is taken as DeepSpeed takes it: each rank divides its gradients by the predivide
factor f before the sum and the sum is multiplied by f / N after it; `prescale_gradients` divides by
N before instead. Unset, f is DeepSpeed's: 1 in stage 0 (its engine sums, then divides), N in stages
1-3 (its ZeRO reduce-scatter divides first, which also keeps an fp16 sum from overflowing).
`comm_dtype` (communication_data_type) is the dtype gradients are summed in, e.g. fp32 for bf16 ones.
"""

from __future__ import annotations

from collections import deque
from enum import Enum, auto
from typing import Callable, NamedTuple

import torch

from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import Bucket, local
from zerodp.engine.layout.layout import Layout
from zerodp.engine.layout.spec import EngineSpec
from zerodp.engine.tensor_parallel.grads import GradPlacements
from zerodp.sizes import POOL_BUFFERS  # the reduce pool's buffers (why: there)



class Pass(Enum):
    """What a gradient arriving now does; begin() sets it for a backward, finish_backward() ends it."""

    IDLE = auto()        # outside engine.backward(): an error (loss.backward() was called directly)
    ACCUMULATE = auto()  # summed into its bucket; nothing is launched (a micro-step before the boundary)
    REDUCE = auto()      # summed, and its bucket launched by the launch rule once its last gradient is in


class Window(Enum):
    """What the gradient buffers hold, from one zero() to the next (an accumulation window)."""

    EMPTY = auto()    # nothing: in the window's first backward each first arrival is copied, not added
    SUMMED = auto()   # earlier micro-steps' gradients (full buckets' local sums, or reduced shards)
    REDUCED = auto()  # full buckets (stages 0, 1) hold the reduced mean: a further backward reopens them


class Kept(Enum):
    """What survives a micro-step's reduction until the step: fixed at set-up by the stage and shard size."""

    BUCKET = auto()  # the full bucket, summed in place (stages 0, 1; and any stage on one rank, where a
                     # shard is the whole bucket): no pool
    SHARD = auto()   # this rank's shard of the bucket (stages 2, 3): each micro-step's gradients pass
                     # through a pooled buffer that is reduce-scattered into it


class InFlight(NamedTuple):
    """A launched reduction, until it retires."""

    bucket: int             # its index
    work: object            # the async collective's handle
    into_grad: bool         # the reduce_scatter writes this rank's gradient shard itself: no copy after
    sent: torch.Tensor      # what was sent: the reduce buffer, or a copy of it in the reduction's dtype


class Reducer:
    def __init__(self, layout: Layout, comm: Comm, spec: EngineSpec, acc_dtype: torch.dtype,
                 overlap_comm: bool, on_bucket_done: Callable[[Bucket], None] | None = None,
                 comm_dtype: torch.dtype | None = None, prescale: bool = False,
                 predivide: float | None = None, bucket_numel: int | None = None,
                 grad_placements: GradPlacements | None = None):
        self.comm, self.overlap = comm, overlap_comm
        # Stage 0 all-reduces whole buckets; stages 1-3 reduce-scatter each to the rank that owns its shard.
        self.scatters = spec.shards_optimizer
        # Tensor parallelism: each slot's gradient brought to its parameter's placement (None: no tp)
        self.grad_placements = grad_placements
        self.on_bucket_done = on_bucket_done
        # Called with each buffer the reducer makes and what it holds ("grad": a bucket's gradient,
        # "bucket": a reduce buffer of the pool): the memory planner (plan/peak.py) labels them.
        self.on_new_buffer: list[Callable[[torch.Tensor, str], None]] = []
        self.kept = Kept.SHARD if spec.keeps_gradient_shard and comm.shard_size > 1 else Kept.BUCKET  # fixed
        self.buckets: list[Bucket] = layout.buckets
        # The dtype of the reduce buffers: the gradients' own, unless communication_data_type says otherwise.
        self.dtype = comm_dtype or (self.buckets[0].data.dtype if self.buckets else acc_dtype)
        world = comm.world_size  # the mean is over every rank, also with hierarchical sharding
        if predivide is None:
            predivide = float(world) if self.scatters else 1.0
        # Multiply by `pre` before the sum and by `post` after it: their product is 1 / world.
        self.pre, self.post = (1.0 / world, 1.0) if prescale else (1.0 / predivide, predivide / world)
        if world == 1:
            self.pre = self.post = 1.0
        self.rank = layout.rank
        # The gradient that survives until the step: a full bucket (stages 0, 1) or the rank's
        # shard (stages 2, 3), accumulated across micro-steps in `acc_dtype`. Like PyTorch's
        # zero_grad(set_to_none=True) it exists only from a window's first gradient to the end of
        # the step, so the next forward and the start of backward (where activations peak) run
        # without it.
        self.acc_dtype = acc_dtype
        self.grads: list[torch.Tensor | None] = [None] * len(self.buckets)  # by bucket; None: freed
        # With sharded gradients, the pool buffer each bucket's gradients are summed in this micro-step.
        self.buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        # Reduce buffers: made during backward, freed at its end for the same reason.
        self.pool: list[torch.Tensor] = []
        self.live: list[int] = []  # sizes of the pool buffers that exist now (free or in use)
        self.pool_peak = 0         # most elements the pool has held at once
        self.pool_numel = None if bucket_numel is None else POOL_BUFFERS * bucket_numel
        self.inflight: deque[InFlight] = deque()  # launched, not retired: oldest first
        self.window = Window.EMPTY          # what `grads` hold (the launch and retire rules read it)
        self.backward_pass = Pass.IDLE      # what a gradient arriving now does
        # This backward's progress, by bucket (begin() resets it):
        self.pending: list[int] = []         # gradients still to arrive
        self.arrived: list[bytearray] = []   # per slot: 1 once its gradient arrived (unused.py reads it)
        self.ready = bytearray()             # 1: may be launched (all arrived, or the backward ended)
        self.next_launch = 0                 # the lowest bucket not launched yet
        self._handles = [s.param.register_post_accumulate_grad_hook(self._make_hook(b.index, i))
                         for b in self.buckets for i, s in enumerate(b.slots)]

    def remove_hooks(self) -> None:
        """Gradients stay on the parameters again (the engine is being destroyed)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- backward -------------------------------------------------------------------------------
    def begin(self, communicate: bool) -> None:
        """Before a micro-step's backward; `communicate` is true when its buckets must be reduced."""
        if self.window is Window.REDUCED:
            self._reopen()
        self.backward_pass = Pass.REDUCE if communicate or self.kept is Kept.SHARD else Pass.ACCUMULATE
        self.pending = [len(b.slots) for b in self.buckets]
        self.arrived = [bytearray(len(b.slots)) for b in self.buckets]
        self.ready = bytearray(len(self.buckets))
        self.next_launch = 0

    def _make_hook(self, k: int, i: int):
        def hook(p: torch.nn.Parameter) -> None:
            self._on_grad(k, i, p)
        return hook

    def _on_grad(self, k: int, i: int, p: torch.nn.Parameter) -> None:
        if self.backward_pass is Pass.IDLE:
            raise RuntimeError("a gradient arrived outside engine.backward(): call "
                               "engine.backward(loss) rather than loss.backward()")
        if self.ready[k]:
            raise RuntimeError(f"parameter of shape {tuple(p.shape)} received a second gradient after "
                               "its bucket was reduced (reentrant checkpointing around shared "
                               "parameters?); use torch.utils.checkpoint(use_reentrant=False)")
        b, slot = self.buckets[k], self.buckets[k].slots[i]
        target = self._target(k)[slot.offset:slot.offset + slot.numel]
        # Pool buffers and new gradient buffers start zeroed: a first arrival is a copy, not an add.
        grad = self._in_placement(k, i, p.grad).reshape(-1)
        if not self.arrived[k][i] and (self.kept is Kept.SHARD or self.window is Window.EMPTY):
            target.copy_(grad)
        else:
            target.add_(grad)
        p.grad = None
        if not self.arrived[k][i]:
            self.arrived[k][i] = 1
            self.pending[k] -= 1
            if self.pending[k] == 0:
                if self.on_bucket_done is not None:
                    self.on_bucket_done(b)
                if self.backward_pass is Pass.REDUCE:
                    self._mark_ready(k)

    def _in_placement(self, k: int, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Slot i of bucket k's gradient as this rank's local tensor in its parameter's placement (a
        tensor-parallel gradient: its local shard, cut or marked for the step's tp sum; grad_placement.py)."""
        if self.grad_placements is None:
            return local(grad)
        return self.grad_placements.policies[k][i].local_grad(grad)

    def _target(self, k: int) -> torch.Tensor:
        """Where bucket k's gradients are summed this micro-step."""
        if self.kept is Kept.BUCKET:
            return self._grad(k)
        if self.buffers[k] is None:
            self.buffers[k] = self._acquire(self.buckets[k].numel)
        return self.buffers[k][:self.buckets[k].numel]

    def _mark_ready(self, k: int) -> None:
        self.ready[k] = 1
        while self.next_launch < len(self.buckets) and self.ready[self.next_launch]:
            self._launch(self.next_launch)
            self.next_launch += 1

    def finish_backward(self) -> None:
        """After autograd: launch what unused parameters held back, in order, then end the micro-step."""
        if self.backward_pass is Pass.REDUCE:
            for k in range(self.next_launch, len(self.buckets)):
                if self.kept is Kept.SHARD:
                    self._target(k)  # a bucket nobody touched still takes part, as zeros
                self.ready[k] = 1
            while self.next_launch < len(self.buckets):
                self._launch(self.next_launch)
                self.next_launch += 1
        reduced = self.backward_pass is Pass.REDUCE and self.kept is Kept.BUCKET
        self.backward_pass = Pass.IDLE
        if self.kept is Kept.SHARD:
            self.wait()
            self.pool.clear()
            self.live.clear()
        self.window = Window.REDUCED if reduced else Window.SUMMED

    def _reopen(self) -> None:
        """Another backward() in a window whose full buckets were already reduced (two backward()
        calls before one step() at gradient_accumulation_steps 1): the next reduction must give the
        reduced mean so far plus the new gradients' mean. Its reductions may still be in flight,
        so wait before any hook adds into them. Stage 0 holds the mean on every rank, which the next
        all_reduce of (mean + g) / N sums back; stage 1's reduce_scatter left only the owned chunk
        reduced (the rest is this rank's own gradient / N): that chunk becomes N x mean, the rest 0."""
        self.wait()
        self.window = Window.SUMMED
        if not self.scatters or self.comm.world_size == 1:
            return
        for b, grad in zip(self.buckets, self.grads):
            if grad is not None:
                # (S x mean on each of the N/S copies of the chunk when sharding is hierarchical)
                owned = b.shard(grad, self.rank) * self.comm.shard_size
                grad.zero_()
                b.shard(grad, self.rank).copy_(owned)

    def _grad(self, k: int) -> torch.Tensor:
        """Bucket k's gradient buffer, made on first use in a window: zeroed for a full bucket (its
        padding and any parameter without a gradient must read 0); a shard is wholly overwritten."""
        if self.grads[k] is None:
            b = self.buckets[k]
            make = torch.empty if self.kept is Kept.SHARD else torch.zeros
            self.grads[k] = make(b.shard_numel if self.kept is Kept.SHARD else b.numel, dtype=self.acc_dtype,
                                 device=b.data.device)
            self._made(self.grads[k], "grad")
        return self.grads[k]

    def _made(self, buffer: torch.Tensor, kind: str) -> None:
        for callback in self.on_new_buffer:
            callback(buffer, kind)

    # ---- communication --------------------------------------------------------------------------
    def _launch(self, k: int) -> None:
        b = self.buckets[k]
        buf = self._target(k)
        # A full bucket (stages 0, 1) in another dtype than the reduction's goes through a copy.
        sent = buf if buf.dtype == self.dtype else buf.to(self.dtype)
        if self.pre != 1.0:
            sent.mul_(self.pre)
        # In an EMPTY window a shard of the right dtype is reduced straight into the gradient.
        into_grad = self.kept is Kept.SHARD and self.window is Window.EMPTY and self.acc_dtype == buf.dtype
        if not self.scatters:
            work = self.comm.all_reduce(sent, async_op=True)
        else:
            out = self._grad(k) if into_grad else b.shard(sent, self.rank)
            work = self.comm.shard_reduce(out, sent, async_op=True)
        self.inflight.append(InFlight(k, work, into_grad, sent))
        if not self.overlap:
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        k, work, into_grad, sent = self.inflight.popleft()
        work.wait()
        b = self.buckets[k]
        if self.kept is Kept.BUCKET:  # the reduced values: the whole bucket (stage 0) or the owned chunk
            reduced = b.shard(sent, self.rank) if self.scatters else sent
            if self.post != 1.0:
                reduced.mul_(self.post)
            if sent is not self.grads[k]:
                (b.shard(self.grads[k], self.rank) if self.scatters else self.grads[k]).copy_(reduced)
        else:
            shard = self._grad(k) if into_grad else b.shard(self._target(k), self.rank)
            if self.post != 1.0:
                shard.mul_(self.post)
            if not into_grad:
                if self.window is Window.EMPTY:
                    self._grad(k).copy_(shard)
                else:
                    self._grad(k).add_(shard)
            self.pool.append(self.buffers[k])
            self.buffers[k] = None

    def wait(self) -> None:
        """Every launched reduction has finished and its result is in `grads`."""
        while self.inflight:
            self._retire_oldest()

    def _acquire(self, numel: int) -> torch.Tensor:
        """A zeroed buffer of at least `numel` elements: the smallest free one that fits, else a new
        one of exactly this bucket's size (buckets differ in size; the pool stays as small as they)."""
        while True:
            fits = [i for i, b in enumerate(self.pool) if b.numel() >= numel]
            if fits:
                return self.pool.pop(min(fits, key=lambda i: self.pool[i].numel())).zero_()
            full = len(self.live) >= POOL_BUFFERS or (
                self.pool_numel is not None and sum(self.live) + numel > self.pool_numel)
            if self.inflight and full:
                self._retire_oldest()
                continue
            buf = torch.zeros(numel, dtype=self.dtype, device=self.buckets[0].data.device)
            self.live.append(numel)
            self.pool_peak = max(self.pool_peak, sum(self.live))
            self._made(buf, "bucket")
            return buf

    # ---- results --------------------------------------------------------------------------------
    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient for each bucket (its shard; the whole bucket in stage 0).
        Valid after the boundary micro-step's backward, until zero()."""
        grads = [self._grad(k) for k in range(len(self.buckets))]
        if self.kept is Kept.SHARD:
            return grads
        return [b.shard(a, self.rank) for b, a in zip(self.buckets, grads)]

    def zero(self) -> None:
        """Free the gradients (set_to_none) and start a new accumulation window."""
        self.grads = [None] * len(self.buckets)
        self.window = Window.EMPTY

    def bytes(self) -> dict[str, int]:
        """Bytes of the gradients while they exist, and the most the reduce-buffer pool has held."""
        size = torch.empty((), dtype=self.acc_dtype).element_size()
        grads = sum((b.shard_numel if self.kept is Kept.SHARD else b.numel) * size for b in self.buckets)
        sent = torch.empty((), dtype=self.dtype).element_size()
        # the collective plan's reduce-scatter as all-reduce sums the whole bucket, not one shard of it
        whole = (self.comm.plan.whole_bucket_bytes([b.numel for b in self.buckets], sent, self.comm.shard_size)
                 if self.scatters else 0)
        return {"gradients": grads, "reduce_buckets": self.pool_peak * sent, "reduce_whole_bucket": whole}
