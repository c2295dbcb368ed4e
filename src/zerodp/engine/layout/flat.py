"""Flat, contiguous, padded parameter buffers and their partition across ranks.

Each optimizer param group gets one flat working-precision buffer. The buffer is cut into buckets
of about `reduce_bucket_size` elements, filled with parameters in reverse registration order (the
order backward produces their gradients). Every bucket is padded to a multiple of
`partitions * ALIGN` and split into `partitions` equal shards: rank r owns shard r of every bucket.

Why shard per bucket rather than once per group: a bucket's gradient can then be reduce-scattered
the moment backward has produced it, straight into the owning shards, with no reduce-to-owner
loop and no copy (the layout FSDP and picotron use). Each rank still owns exactly 1/N.

A param group whose optimizer needs whole parameters (optimizer_view.py) is laid out `whole`: its
parameters are dealt whole to the shards of their bucket (`_deal`), each shard padded to the fullest, so a
rank's shard holds whole parameters (about 1/N, plus its share of the imbalance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

# Every parameter and every shard starts on a 64-element boundary (128 B in bf16): aligned views
# keep vectorised kernels and tensor-core GEMMs on their fast paths.
ALIGN = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- a parameter's local tensor -------------------------------------------------------------------
# A tensor-parallel parameter (a DTensor from torch's parallelize_module) holds only its local shard;
# ZeRO partitions that shard over the data-parallel ranks. The functions below are the one place that
# knows where a parameter's local values live: everything else lays out, fills, points and reads
# through them. (torch has no public way to re-point a DTensor at other storage; `_local_tensor` is
# what its dispatch unwraps, so a view assigned there is what the module computes with.)

def local(t: torch.Tensor) -> torch.Tensor:
    """The values this rank holds of `t`: a DTensor's local shard (a tensor-parallel parameter or its
    gradient), else `t` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def set_local(p: torch.Tensor, view: torch.Tensor) -> None:
    """Point p's local values at `view` (a DTensor keeps its placements: the module still sees one)."""
    if isinstance(p, DTensor):
        p._local_tensor = view
    else:
        p.data = view


_set_data = torch.Tensor.data.__set__  # p.data = v, callable from map() without a Python frame


def local_setter(params: list[torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """set_local for these parameters, as plain `p.data = v` (no Python frame per call) when none is a DTensor."""
    return set_local if any(isinstance(p, DTensor) for p in params) else _set_data


def tp_duplicate(p: torch.Tensor) -> bool:
    """Whether every tensor-parallel rank holds the same values of p (a plain parameter, or a DTensor
    Replicate on the tp mesh): its gradient is counted once in the global norm, not once per tp rank.
    A plain parameter marked as a tensor-parallel shard the Megatron way (`tensor_model_parallel`, or
    DeepSpeed's `model_parallel`: a model given with an mpu) is this rank's own."""
    if isinstance(p, DTensor):
        return all(pl.is_replicate() for pl in p.placements)
    return not (getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


def tp_parts(p: torch.Tensor) -> int:
    """Into how many equal parts of its split dimension p's tensor-parallel shard is cut: a _StridedShard
    DTensor's split_factor (a fused Linear's q | k | v, each part split over tp, so each rank holds its
    slice of every part), else 1 (the shard is one block of the whole tensor)."""
    if isinstance(p, DTensor):
        return next((pl.split_factor for pl in p.placements if isinstance(pl, _StridedShard)), 1)
    return 1


def join_tp(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """The whole tensor from every tp rank's shard (in tp rank order) split along `dim`; with `parts` > 1
    (tp_parts) each shard holds its slice of each part, so the whole is joined part by part."""
    if parts == 1:
        return torch.cat(shards, dim)
    pieces = [shard.chunk(parts, dim) for shard in shards]
    return torch.cat([piece[j] for j in range(parts) for piece in pieces], dim)


def place_tp_shard(whole: torch.Tensor, shard: torch.Tensor, dim: int, offset: int, parts: int = 1) -> None:
    """Copy one tp rank's shard into `whole` (join_tp one shard at a time): `offset` is the earlier tp
    ranks' shards' size along `dim`; with `parts` > 1 each of the shard's parts goes into its part."""
    part_size = whole.shape[dim] // parts
    for j, piece in enumerate(shard.chunk(parts, dim)):
        whole.narrow(dim, j * part_size + offset // parts, piece.shape[dim]).copy_(piece)


@dataclass(frozen=True)
class TpPlacement:
    """A parameter's tensor-parallel facts, read once from the parameter when it is laid out (`placement_of`)
    and by every part after: the norm's row flags, the owned-elements count, the whole-matrix gather, the
    checkpoint's pieces."""

    duplicate: bool = True   # every tp rank holds the same values (tp_duplicate): counted once, never joined
    parts: int = 1           # tp_parts: a fused q | k | v's parts, each split over tp
    dim: int | None = None   # the dimension the tp shards join along, where the parameter says it; None if not


def placement_of(p: torch.Tensor) -> TpPlacement:
    """p's TpPlacement. A marked shard that does not say its dimension gets dim None: the set-up checks that
    need it (tensor_parallel.placements.shard_dim) raise there, naming the parameter."""
    if tp_duplicate(p):
        return TpPlacement()
    if isinstance(p, DTensor):
        dim = next((pl.dim % p.dim() for pl in p.placements if isinstance(pl, Shard)), None)
    else:
        dim = getattr(p, "partition_dim", None)
        dim = dim % p.dim() if isinstance(dim, int) and -p.dim() <= dim < p.dim() else None
    return TpPlacement(duplicate=False, parts=tp_parts(p), dim=dim)


@dataclass
class Slot:
    """One parameter's place in its bucket, with its tensor-parallel facts."""

    param: nn.Parameter
    offset: int
    numel: int          # of local(param): a tensor-parallel parameter's local shard
    shape: torch.Size
    tp: TpPlacement = TpPlacement()  # read once, at layout (placement_of)


@dataclass
class Bucket:
    """A run of parameters that is reduced, stepped and gathered as one unit."""

    index: int                 # global launch order (the same on every rank)
    group: int                 # optimizer param group
    start: int                 # offset in the group's flat buffer
    numel: int                 # padded to a multiple of partitions * ALIGN
    partitions: int
    slots: list[Slot] = field(default_factory=list)
    persistent: bool = False           # stage 3: stays gathered (its units are under the persistence threshold)
    whole: bool = False                # each parameter lies whole in one shard (a shape-aware optimizer's)
    frozen: bool = False               # stage 3's frozen parameters: no gradient, master or optimizer state
    data: torch.Tensor | None = None   # the whole bucket, working precision (stage 3: gathered on demand)
    owned: torch.Tensor | None = None  # this rank's shard of it, which the optimizer updates
    # Each slot's view of `data`, made while its storage was whole: stage 3 points each parameter at
    # its view when gathered. (Sliced from the freed storage later, a view is an error on real tensors;
    # aliased later through param.data, on fake tensors it silently regrows the storage, which
    # `zerodp estimate` would count.)
    views: list[torch.Tensor] = field(default_factory=list)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.partitions

    def owned_slots(self, rank: int) -> Iterator[tuple[int, Slot, int, int]]:
        """(i, slot i, lo, hi) for each slot with elements in rank's shard: [lo, hi) are those elements,
        in bucket coordinates (the shard starts at rank * shard_numel)."""
        first = rank * self.shard_numel
        last = first + self.shard_numel
        for i, s in enumerate(self.slots):
            lo, hi = max(s.offset, first), min(s.offset + s.numel, last)
            if lo < hi:
                yield i, s, lo, hi

    def shard(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's equal slice of a bucket-sized tensor (padding falls on the last ranks)."""
        return t.view(self.partitions, self.shard_numel)[rank]

    def duplicate_rows(self, rank: int) -> torch.Tensor:
        """One flag per ALIGN-element row of rank's shard: True where the row belongs to a parameter that
        every tensor-parallel rank holds alike (tp_duplicate). Every parameter starts a row, so no row
        holds two parameters."""
        rows = torch.zeros(self.shard_numel // ALIGN, dtype=torch.bool)
        first = rank * self.shard_numel
        for _, s, lo, hi in self.owned_slots(rank):
            if s.tp.duplicate:
                rows[(lo - first) // ALIGN:_round_up(hi - first, ALIGN) // ALIGN] = True
        return rows

    def flatten(self, dtype: torch.dtype) -> torch.Tensor:
        """The current parameter values laid out as this bucket, gaps zeroed."""
        device = self.slots[0].param.device
        out = torch.zeros(self.numel, dtype=dtype, device=device)
        for s in self.slots:
            out[s.offset:s.offset + s.numel].copy_(local(s.param).detach().reshape(-1))
        return out


@dataclass
class FlatGroup:
    """One optimizer param group's parameters as a single flat buffer of buckets."""

    index: int
    buckets: list[Bucket]
    numel: int
    data: torch.Tensor | None = None
    # the dtype its buffers hold: None, the working precision (trained groups); a frozen group's own storage
    # dtype (Layout.build: one frozen group per dtype), whose bits are moved and never cast
    dtype: torch.dtype | None = None

    def allocate(self, dtype: torch.dtype, fp32_buckets: Iterable[torch.Tensor], rank: int,
                 sharded: bool = False, host_shards: bool = False, pin: bool = False,
                 store: Callable[[Bucket, torch.Tensor], None] | None = None) -> None:
        """Allocate the flat buffer, fill it, and turn every parameter into a view of it.

        fp32_buckets: each bucket's values in turn, whole; or, when sharded, only this rank's shard of
        it (a rank that builds on meta never holds a whole stage-3 bucket it does not need). Taken one
        at a time, so a generator keeps one bucket in memory.
        sharded (stage 3): the flat buffer holds only this rank's shards; each bucket gets a
        buffer of its own for the gathered parameters, whose storage is freed between uses.
        host_shards (stage 3's offload_param): that flat buffer of shards is in host memory (pinned
        with `pin`); only the gathered buffers are on the device.
        store (stage 3's offload_param "nvme", sharding/on_disk.py): where each bucket's shard goes instead of
        a flat buffer (`store(b, its values)`, b.owned an empty tensor of `dtype` until then); no flat buffer.
        """
        if not self.buckets:
            return
        device = self.buckets[0].slots[0].param.device
        size = sum(b.shard_numel for b in self.buckets) if sharded else self.numel
        if store is not None:
            self.data = None
        elif host_shards:
            self.data = torch.empty(size, dtype=dtype, device="cpu", pin_memory=pin)
        else:
            self.data = torch.empty(size, dtype=dtype, device=device)
        offset, fp32_buckets = 0, iter(fp32_buckets)
        for b in self.buckets:
            full = next(fp32_buckets)  # not zip(): it would hold the last bucket's values while making the next
            whole = full.numel() == b.numel
            if sharded:
                b.data = torch.empty(b.numel, dtype=dtype, device=device)
                if store is not None:
                    b.owned = torch.empty(0, dtype=dtype)
                    store(b, b.shard(full, rank) if whole else full)
                else:
                    b.owned = self.data[offset:offset + b.shard_numel]
                    b.owned.copy_(b.shard(full, rank) if whole else full)
                offset += b.shard_numel
            else:
                b.data = self.data[b.start:b.start + b.numel]
                b.owned = b.shard(b.data, rank)  # a view: filled by the copy below
            if whole:
                b.data.copy_(full)
            b.views = [b.data[s.offset:s.offset + s.numel].view(s.shape) for s in b.slots]
            for s, view in zip(b.slots, b.views):
                set_local(s.param, view)
            if not whole:  # stage 3 from a shard: the gathered buffer holds nothing until a gather fills it
                b.data.untyped_storage().resize_(0)
            del full  # before the next bucket's values are made: one bucket staged at a time, not two


def lay_out(param_groups: list[list[nn.Parameter]], partitions: int, bucket_numel: int,
            unit_of: dict[int, int] | None = None,
            persistent: set[int] | frozenset = frozenset(), whole: Sequence[bool] = ()) -> list[FlatGroup]:
    """Lay out buckets and shards; allocates nothing. A parameter never spans two buckets.

    unit_of (stage 3): id(param) -> its unit (units.py). A unit's parameters of one group are never
    split between buckets; consecutive units share a bucket up to `bucket_numel` elements (0: a
    bucket per unit), and the units in `persistent` share one only with each other.
    whole: per group, whether its parameters must each lie whole in one shard (optimizer_view.py): such a
    bucket grows to at least `partitions` x its largest parameter, so that the others can balance it,
    and its parameters are dealt to the shards by size (`_deal`), each shard padded to the fullest.
    """
    groups, index = [], 0
    loads = [0] * partitions  # elements each shard of whole-parameter buckets holds so far, for balance
    for g, params in enumerate(param_groups):
        buckets, start = [], 0
        current: Bucket | None = None
        is_whole = g < len(whole) and whole[g]
        for run in _runs(list(reversed(params)), unit_of):
            keep = unit_of is not None and unit_of[id(run[0])] in persistent
            limit = bucket_numel
            if is_whole and current is not None:  # room for the others to balance its largest parameter
                limit = max(limit, partitions * max([s.numel for s in current.slots] + [local(p).numel() for p in run]))
            if current is None or (current.slots and (keep != current.persistent
                                                      or _fill(current) + _run_numel(run) > limit)):
                if current is not None:
                    start = _close(current, start, loads)
                    buckets.append(current)
                current = Bucket(index=index, group=g, start=start, numel=0, partitions=partitions, persistent=keep,
                                 whole=is_whole)
                index += 1
            for p in run:
                current.slots.append(Slot(p, _fill(current), local(p).numel(), local(p).shape, placement_of(p)))
        if current is not None:
            start = _close(current, start, loads)
            buckets.append(current)
        groups.append(FlatGroup(index=g, buckets=buckets, numel=start))
    return groups


def _runs(params: list[nn.Parameter], unit_of: dict[int, int] | None) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one unit (each parameter alone without units)."""
    if unit_of is None:
        return [[p] for p in params]
    runs: list[list[nn.Parameter]] = []
    for p in params:
        if runs and unit_of[id(p)] == unit_of[id(runs[-1][0])]:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _run_numel(run: list[nn.Parameter]) -> int:
    """Elements a run adds to a bucket: every parameter but the last aligned."""
    return sum(_round_up(local(p).numel(), ALIGN) for p in run[:-1]) + local(run[-1]).numel()


def _fill(b: Bucket) -> int:
    if not b.slots:
        return 0
    last = b.slots[-1]
    return _round_up(last.offset + last.numel, ALIGN)


def _close(b: Bucket, start: int, loads: list[int]) -> int:
    if b.whole and b.partitions > 1:
        _deal(b, loads)
    else:
        b.numel = _round_up(max(_fill(b), 1), b.partitions * ALIGN)
    return start + b.numel


def _deal(b: Bucket, loads: list[int]) -> None:
    """Deal a bucket's parameters whole to its shards, largest first, each to the shard with the fewest
    elements (ties: the rank with the fewest over all buckets so far, which balances the ranks' optimizer
    states); every shard is then padded to the fullest one's size (equal shards: reduce_scatter and
    all_gather need them)."""
    fill = [0] * b.partitions
    placed: list[tuple[int, int, Slot]] = []  # (shard, offset in it, slot)
    for s in sorted(b.slots, key=lambda s: -s.numel):
        r = min(range(b.partitions), key=lambda r: (fill[r], loads[r], r))
        placed.append((r, fill[r], s))
        fill[r] += _round_up(s.numel, ALIGN)
        loads[r] += s.numel
    shard = max(_round_up(max(fill), ALIGN), ALIGN)
    b.numel = shard * b.partitions
    for r, offset, s in placed:
        s.offset = r * shard + offset
    b.slots.sort(key=lambda s: s.offset)
