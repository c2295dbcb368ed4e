"""Shape-aware optimizers on tensor-parallel shards: each matrix gathered whole over tp for its step.

A whole-parameter optimizer (optimizer_view.py: Muon, Adafactor, a user's row norms) must see a parameter
whole. With tensor parallelism a rank holds only its tp shard of a matrix (a DTensor's Shard(d), a
Megatron shard's `partition_dim`), and the dp rank that owns the parameter (flat.lay_out's `whole`) owns
that shard whole; stepped as it is, Muon would orthogonalise one piece of the matrix as if it were the
matrix. So, for its step, the owner gathers over the tp group its reduced gradient shard and its fp32
master shard into the whole matrix's gradient and master, the user's optimizer steps that whole-shaped
tensor (its state in the whole shape), and the owner copies its own tp slice back into its master shard.
Every tp rank of the owner computes the same update from the same whole tensors, redundantly: exact, and
deterministic (Moonlight's "Distributed Muon" does the same over its shards).

The tp ranks of one dp rank own the same parameters in the same order: the layout of a whole-parameter
group depends only on the local sizes of its parameters, equal on every tp rank (`refusal` refuses uneven
tp splits in such a group at set-up, by name); one set-up exchange checks it (`_check_alike`), so the
gathers, one all_gather over tp per bucket with such shards, are entered by every tp rank in the same order.

Memory: during the step the owner holds each such matrix whole (tp x its shard) in fp32, value and
gradient; between steps their storage is released. The optimizer's state of such a parameter is the whole
matrix's, on each tp rank of the owner (tp x what it would be for the shard), the same on each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import Bucket, place_tp_shard, tp_duplicate, tp_parts
from zerodp.engine.tensor_parallel.placements import shard_dim


def refusal(name: str, p: torch.Tensor, tp_size: int | None) -> str | None:
    """Why parameter `name`, in a whole-parameter optimizer's group, cannot be stepped as its whole matrix
    gathered over tp (`tp_size`: the tp group's size, None without one), or None. Local: no collective."""
    if tp_duplicate(p) or tp_size == 1:
        return None
    if tp_size is None:
        return (f"'{name}' is marked as a tensor-parallel shard (tensor_model_parallel / model_parallel) but "
                "zerodp was given no tensor-parallel group to gather the whole matrix over: pass the mpu")
    if not isinstance(p, DTensor):  # a Megatron shard says its axis, or nothing
        dim = getattr(p, "partition_dim", None)
        if not isinstance(dim, int) or not -p.dim() <= dim < p.dim():
            return (f"'{name}' is marked as a tensor-parallel shard but its partition_dim is {dim!r}, so the axis its "
                    "tp shards join along is unknown; set p.partition_dim (Megatron's attribute: 0 for a column-"
                    "parallel weight, 1 for a row-parallel one)")
        if getattr(p, "partition_stride", 1) != 1:
            return (f"'{name}' has partition_stride {p.partition_stride}: its tp shards interleave, and only "
                    "partition_stride=1 is joined into the whole matrix")
        return None  # (Megatron splits evenly: the set-up exchange checks the shards' shapes agree)
    dim = shard_dim(name, p, p.dim())
    parts = tp_parts(p)
    if p.shape[dim] % (tp_size * parts):  # (a DTensor's shape is the whole tensor's)
        return (f"'{name}' is split over tp along dimension {dim} of size {p.shape[dim]}, which is not divisible by "
                f"the tp size {tp_size}{f' x {parts} parts' if parts > 1 else ''}: its tp shards are of unequal "
                "sizes, so the tp ranks' whole-parameter layouts would differ; make the dimension divisible")
    return None


@dataclass
class _Matrix:
    """One owned tp shard that is stepped as its whole matrix."""

    lo: int               # its elements [lo, hi) in its bucket's master shard
    hi: int
    shape: torch.Size     # this rank's tp shard
    dim: int              # the axis the tp shards join along
    parts: int            # flat.tp_parts: a fused q | k | v's parts, each split over tp
    whole: torch.Tensor   # what the optimizer steps: fp32, the whole matrix's shape; storage only in a step


class WholeOverTp:
    """Which owned parameters of whole-parameter buckets are tp shards, and their gather for the step."""

    def __init__(self, buckets: list[Bucket], rank: int, comm: Comm, masters: list[torch.Tensor]):
        self.tp = comm.tp  # the tensor-parallel group (None: none)
        size = 1 if comm.tp is None else comm.tp.world_size
        # bucket index -> owned slot j (its place in PartitionedOptimizer.stepped[k]) -> its matrix
        self.matrices: dict[int, dict[int, _Matrix]] = {}
        if size == 1:
            return
        for b, m in zip(buckets, masters):
            first = rank * b.shard_numel
            for j, (_, s, lo, hi) in enumerate(b.owned_slots(rank) if b.whole else ()):
                if s.tp.duplicate:
                    continue
                dim = s.tp.dim  # (refusal checked it, naming the parameter, at set-up)
                shape = list(s.shape)
                shape[dim] *= size
                whole = torch.empty(shape, dtype=m.dtype, device=m.device)
                whole.untyped_storage().resize_(0)
                self.matrices.setdefault(b.index, {})[j] = _Matrix(lo - first, hi - first, s.shape, dim,
                                                                    s.tp.parts, whole)
        if any(b.whole and not s.tp.duplicate for b in buckets for s in b.slots):
            self._check_alike(buckets, comm)

    def _check_alike(self, buckets: list[Bucket], comm: Comm) -> None:
        """The one set-up exchange: each dp rank's tp ranks own the same tp shards, bucket by bucket, in
        the same order (they gather them together). Over the world, so every rank decides alike."""
        if comm.is_fake():
            return
        mine = [[(j, tuple(x.shape), x.dim) for j, x in self.matrices.get(b.index, {}).items()]
                for b in buckets if b.whole]
        seen: dict[int, list] = {}
        for dp_rank, theirs in comm.everyone.all_gather_object((comm.rank, mine)):
            if seen.setdefault(dp_rank, theirs) != theirs:
                raise RuntimeError(f"the tensor-parallel ranks of data-parallel rank {dp_rank} own different "
                                   "tensor-parallel shards of a whole-parameter optimizer's parameters, so "
                                   "they cannot gather the whole matrices together; this is a zerodp bug "
                                   f"(their owned shards: {seen[dp_rank]} and {theirs})")

    def stepped(self, k: int, j: int, view: torch.Tensor) -> torch.Tensor:
        """What the optimizer steps for bucket k's owned slot j: its whole matrix, else `view` itself."""
        x = self.matrices.get(k, {}).get(j)
        return view if x is None else x.whole

    def gathers(self, k: int, j: int) -> bool:
        return j in self.matrices.get(k, ())

    def gather(self, k: int, master: torch.Tensor, device: torch.device) -> None:
        """Before the step: bucket k's tp-shard matrices whole, value and gradient (`master.grad`), from
        one all_gather over tp (on `device`, the collectives' one) of this rank's shards of both."""
        matrices = self.matrices.get(k)
        if not matrices:
            return
        values, grads = master.detach(), master.grad
        mine = torch.cat([t[x.lo:x.hi] for x in matrices.values() for t in (values, grads)]).to(device)
        everyone = torch.empty(self.tp.world_size * mine.numel(), dtype=mine.dtype, device=device)
        self.tp.all_gather(everyone, mine)
        everyone = everyone.to(master.device).view(self.tp.world_size, -1)
        at = 0
        for x in matrices.values():
            n = x.hi - x.lo
            x.whole.untyped_storage().resize_(x.whole.numel() * x.whole.element_size())
            x.whole.grad = torch.empty_like(x.whole)
            for target in (x.whole.detach(), x.whole.grad):
                for r in range(self.tp.world_size):
                    place_tp_shard(target, everyone[r, at:at + n].view(x.shape), x.dim, r * x.shape[x.dim], x.parts)
                at += n

    def put_back(self, k: int, master: torch.Tensor) -> None:
        """After the step: this tp rank's slice of each stepped whole matrix into its master shard; the
        whole values and gradients released."""
        for x in self.matrices.get(k, {}).values():
            mine = master.detach()[x.lo:x.hi].view(x.shape)
            mine.copy_(_tp_slice(x.whole.detach(), x.dim, self.tp.rank, self.tp.world_size, x.parts))
            x.whole.grad = None
            x.whole.untyped_storage().resize_(0)


def _tp_slice(whole: torch.Tensor, dim: int, rank: int, size: int, parts: int) -> torch.Tensor:
    """Tp rank `rank`'s equal shard of `whole` along `dim` (with `parts` > 1, its slice of each part)."""
    return torch.cat([part.chunk(size, dim)[rank] for part in whole.chunk(parts, dim)], dim)
