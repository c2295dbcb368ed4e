"""A tensor-parallel gradient brought to its parameter's placement before it enters a bucket.

A bucket slot holds this rank's local tensor of its parameter (layout.py): a gradient may enter it only in
the parameter's own placement over the tp mesh. torch's DTensor hands back some gradients in another one:
  - `Partial(sum)` for a `Replicate` parameter: a `SequenceParallel` norm's weight, each tp rank holding
    only its slice of the sequence's contribution. It must be summed over the tp group (as FSDP2 does by
    redistributing it, and Megatron by all-reducing its `sequence_parallel` LayerNorm gradients);
  - `Replicate` for a `Shard` parameter: a vocabulary-parallel embedding (`RowwiseParallel(input_layouts=
    Replicate())`) whose backward returns the whole table's gradient. It is cut to this rank's shard,
    locally (no communication).
A gradient already in its parameter's placement goes in as it is. Anything else is refused by name when
it arrives (a `GradientPlacementError` raised from the gradient hook: placements are decided by the
model's plan, the same on every rank that computes that gradient, so every such rank raises there).

Which slots are summed over tp is decided once at set-up, per slot, not per arrival: every `Replicate` DTensor
parameter and every plain parameter marked `sequence_parallel` (Megatron's attribute, with an mpu) is
summed over tp at every step, whatever its gradient turned out to be, so that every rank of the world sums
the same slots (a parameter unused on one dp rank still holds the others' partial sums after the dp
reduce). A `Replicate` gradient of such a parameter enters its slot divided by tp, so the sum restores it
(exactly, for a power-of-two tp). The sum is done once per step, on the dp-reduced shards, in one
collective over the tp group (sums commute: sum over tp of the sum over dp and micro-steps is the same
number; Megatron's finalize_model_grads also all-reduces them once, after the dp reduce): 1/dp of the
elements a sum per bucket before the reduce would move, and one collective instead of one per bucket.
It needs the summed slots to lie alike in every tp rank's buckets, which one set-up exchange over tp checks;
uneven tp shards (a dimension not divisible by tp) can move them. Then a Partial gradient is summed in its
hook instead (DTensor's redistribute: one all_reduce per such gradient), and a plain parameter marked
sequence_parallel, whose gradient cannot say it is partial, is refused at set-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import local
from zerodp.engine.layout.layout import Layout


class GradientPlacementError(ValueError):
    """A gradient arrived in a placement zerodp cannot bring to its parameter's."""


@dataclass(frozen=True)
class GradPolicy:
    """What one slot's gradient needs to be in its parameter's placement, decided at set-up."""

    name: str                 # the parameter's name, for errors
    placements: tuple | None  # the parameter's placements over tp; None: a plain tensor (as is)
    summed: bool              # the slot is summed over tp at every step (GradPlacements.sum_over_tp)
    tp: int                   # tp ranks: a Replicate gradient of a summed slot enters divided by it
    cut: tuple[int, int, int] | None  # (dim, start, length) of this rank's Shard of the whole tensor

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's gradient in the slot's shape (a view or a new tensor; never the summed one)."""
        if self.placements is None or not isinstance(grad, DTensor) or self.tp == 1:
            return local(grad)  # (over one tp rank, every placement is the whole tensor)
        if tuple(grad.placements) == self.placements or _normal(grad.placements, grad.ndim) == self.placements:
            return grad._local_tensor / self.tp if self.summed and self.tp > 1 else grad._local_tensor
        if all(pl.is_replicate() for pl in self.placements) and all(_partial_sum(pl) for pl in grad.placements):
            if self.summed:
                return grad._local_tensor
            # The tp ranks' buckets differ (uneven tp shards): summed here, one all_reduce for this gradient
            return grad.redistribute(placements=self.placements)._local_tensor
        if all(pl.is_replicate() for pl in grad.placements) and not self.summed:
            if self.cut is not None:
                dim, start, length = self.cut
                return grad._local_tensor.narrow(dim, start, length)
            return grad.redistribute(placements=self.placements)._local_tensor  # _StridedShard: torch's own cut
        raise GradientPlacementError(
            f"parameter '{self.name}' has placements {self.placements} over the 'tp' mesh, but its gradient "
            f"arrived as {tuple(grad.placements)}: zerodp brings a Partial(sum) gradient of a Replicate parameter "
            "(summed over tp) and a Replicate gradient of a Shard parameter (cut to this rank's shard) to their "
            "parameter's placement, and takes a gradient already in it as it is. Change the tensor-parallel plan "
            "so that this parameter's gradient is in one of those placements")


def _normal(placements, ndim: int) -> tuple:
    """Placements with each Shard's dim counted from the front (Shard(-1) of a matrix is Shard(1))."""
    return tuple(Shard(pl.dim % ndim) if type(pl) is Shard else pl for pl in placements)


def _partial_sum(pl) -> bool:
    return pl.is_partial() and getattr(pl, "reduce_op", "sum") == "sum"


def _summed(p: torch.Tensor, comm: Comm) -> bool:
    """Whether p's gradient is summed over tp at every step: a Replicate DTensor (its gradient may be
    Partial), or a plain parameter Megatron marks sequence_parallel (its gradient always is)."""
    if comm.tp is None or comm.tp.world_size == 1:
        return False
    if isinstance(p, DTensor):
        return all(pl.is_replicate() for pl in p.placements)
    return bool(getattr(p, "sequence_parallel", False))


def _cut(p: torch.Tensor) -> tuple[int, int, int] | None:
    """Where this rank's Shard lies in the whole tensor along its one split dimension; None for a
    Replicate parameter or a _StridedShard one (its shard is no single box: DTensor cuts it)."""
    if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements):
        return None
    if len(p.placements) != 1 or type(p.placements[0]) is not Shard:
        return None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    dim = p.placements[0].dim % p.dim()
    return dim, offset[dim], shape[dim]


class GradPlacements:
    """Every slot's GradPolicy, by bucket and slot, and the step's one tp sum of the summed slots."""

    def __init__(self, layout: Layout, comm: Comm, names: dict[int, str]):
        self.comm = comm
        self.layout = layout
        summed = {id(s.param) for _, s in layout.slots() if _summed(s.param, comm)}
        uneven = self._uneven(summed)
        marked = [names.get(id(s.param), "?") for _, s in layout.slots()
                  if id(s.param) in summed and not isinstance(s.param, DTensor)]
        if uneven is not None and marked:  # a plain gradient does not say it is partial: refused here, not later
            raise GradientPlacementError(f"parameter '{marked[0]}' is marked sequence_parallel: {uneven}")
        tp = comm.tp.world_size if comm.tp is not None else 1
        self.policies: list[list[GradPolicy]] = [
            [GradPolicy(names.get(id(s.param), f"of shape {tuple(s.shape)}"),
                        _normal(s.param.placements, s.param.ndim) if isinstance(s.param, DTensor) else None,
                        id(s.param) in summed and uneven is None, tp, _cut(s.param))
             for s in b.slots] for b in layout.buckets]
        # (bucket, lo, hi) in shard coordinates of each summed slot's part of this rank's shard
        self.ranges = [(b.index, lo - layout.shard_start(b), hi - layout.shard_start(b))
                       for b in layout.buckets for i, s, lo, hi in layout.owned_slots(b)
                       if self.policies[b.index][i].summed]

    def _uneven(self, summed: set[int]) -> str | None:
        """None when every tp rank lays out the summed slots alike (one set-up collective over tp when there
        are any), else why not."""
        comm = self.comm
        if not summed or comm.tp is None or comm.tp.world_size == 1 or comm.is_fake():
            return None
        where = [(b.index, s.offset, s.numel, b.numel) for b, s in self.layout.slots() if id(s.param) in summed]
        everyone = comm.tp.all_gather_object(where)
        if all(w == everyone[0] for w in everyone):
            return None
        return ("its gradient, a partial sum on each tp rank, is summed over tp on the reduced shards, but the tp "
                "ranks' buckets differ (a parameter's tp shards are of unequal sizes: a dimension not divisible by "
                "tp); make every split dimension divisible by the tp size")

    def sum_over_tp(self, grads: list[torch.Tensor]) -> None:
        """The step's one tp sum: each summed slot's part of this rank's reduced gradient shard, in place
        (`grads`: the reducer's shard_grads, by bucket)."""
        if not self.ranges:
            return
        parts = [grads[k][lo:hi] for k, lo, hi in self.ranges]
        flat = torch.cat(parts)
        self.comm.tp.all_reduce(flat)
        for part, summed in zip(parts, flat.split([p.numel() for p in parts])):
            part.copy_(summed)


def names_of(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in `module`, for the errors."""
    return {id(p): n for n, p in module.named_parameters()}
