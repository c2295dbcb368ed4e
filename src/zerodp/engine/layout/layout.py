"""The bucket layout: which parameters sit in which bucket of which group, and which shard is this rank's.

Made once by the engine (`Layout.build`) and handed to the reducer, the partitioned optimizer, the
used-parameter tracker and stage 3's gatherer; `checkpoint/`, `plan/` and `memory.py` read it as
`engine.layout`. Nothing else derives the bucket list or this rank's shard index again.

Shapes: a slot's shape is the shape of the tensor this rank holds for the parameter, and every reader
of a trained parameter's shape asks `shape_of` (a stage-3 parameter between uses is an empty tensor,
so its own `.shape` says nothing). Tensor parallelism puts a parameter's local shard here: `build` lays
out what this rank holds, and `shape_of` is where a local shape and the global one part.

Frozen parameters at stage 3 (`frozen`): more flat groups, one per storage dtype (EngineSpec.kept_dtype: a
bf16 base under an fp32 config stays bf16, a 4-bit base's packed words stay packed), laid out by the same
units, whose buckets come after every trained one (`buckets` and the bucket indices the reducer and the
optimizer use are the trained ones alone). Stage 3 gathers `gathered` (both); nothing reduces or steps a
frozen bucket, and it has no master: its working shard is its only copy, moved as raw bytes (FSDP2 and
DeepSpeed ZeRO-3 ask for one storage dtype per group for the same reason: a gather moves one dtype). A
bitsandbytes weight's per-block quantisation state (formats.block_state: absmax, SCB) is laid out the same way,
right after its weight, in the group of its own dtype. Below stage 3 frozen parameters are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from zerodp.config import ZeroConfig
from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import Bucket, FlatGroup, Slot, lay_out, local
from zerodp.engine.layout.spec import EngineSpec
from zerodp.engine.layout.units import layout as stage3_layout


# reduce_bucket_size left at its default on gloo, whose collectives run on the host: the reduction of one bucket
# overlaps the backward of the next, and in stages 1-2 the forward waits for each bucket's all-gather in turn, so a
# model in one bucket (the default holds 50M elements) exposes all of its communication. There buckets hold about
# 1/OVERLAP_BUCKETS of the model (benchmarks/RESULTS.md, "Overlap on gloo": the small GPT at micro-batch 2 x 64 on
# 2 ranks, stage 2 from 0.58x DDP's tokens/s to 1.09x, medians of 5 interleaved rounds), and none under
# MIN_OVERLAP_BUCKET elements, 1 MiB of fp32 as DDP's first bucket: a small model is not cut into collectives
# that each cost gloo's fixed price per call for little to hide.
OVERLAP_BUCKETS = 8
MIN_OVERLAP_BUCKET = 1 << 18


def bucket_numel(zero: ZeroConfig, backend: str, trained_numel: int) -> int:
    """The elements a bucket holds at stages 0-2: reduce_bucket_size as the config gives it; left at its default
    on gloo, about 1/OVERLAP_BUCKETS of the `trained_numel` elements (at least MIN_OVERLAP_BUCKET). Every rank
    holds the same model and config, so every rank lays out the same buckets."""
    if "reduce_bucket_size" in zero.model_fields_set or backend != "gloo":
        return zero.reduce_bucket_size
    return min(zero.reduce_bucket_size, max(MIN_OVERLAP_BUCKET, -(-trained_numel // OVERLAP_BUCKETS)))


@dataclass(frozen=True)
class Layout:
    """Every optimizer param group's buckets, and this rank's place in their shards."""

    groups: list[FlatGroup]    # one flat buffer of buckets per optimizer param group
    rank: int                  # this rank's shard of every bucket (0 in stage 0, which shards nothing)
    # stage 3's frozen parameters, one group per storage dtype (FlatGroup.dtype), sharded and gathered like
    # the rest (no gradient, master or optimizer state); empty: frozen parameters are whole on every rank,
    # outside the flat buffers (stages 0-2)
    frozen: tuple[FlatGroup, ...] = ()
    bucket_numel: int | None = None  # stages 0-2: the elements a bucket was laid out to hold (`bucket_numel`)
    buckets: list[Bucket] = field(init=False)  # every trained group's buckets, by index (launch order)
    gathered: list[Bucket] = field(init=False)  # stage 3: every bucket, trained then frozen, by index

    def __post_init__(self) -> None:
        for b in self.frozen_buckets:
            b.frozen = True
        object.__setattr__(self, "buckets", [b for g in self.groups for b in g.buckets])
        object.__setattr__(self, "gathered", self.buckets + self.frozen_buckets)

    @classmethod
    def build(cls, param_groups: list[list[nn.Parameter]], spec: EngineSpec, comm: Comm, zero: ZeroConfig,
              frozen: list[torch.Tensor] | None = None, own_dtype: frozenset[int] = frozenset()) -> Layout:
        """Stages 0-2: buckets of about reduce_bucket_size (stage 0 unsplit); stage 3: whole units
        (units.layout), `frozen` (EngineSpec.shards_frozen) in groups of their own after the trained ones,
        one per storage dtype (EngineSpec.kept_dtype; the tensors in `own_dtype`, by id, in their own:
        bitsandbytes' quantisation state, which formats.with_block_state puts among `frozen`). A group whose
        optimizer steps whole parameters (EngineSpec.whole_parameters) has each parameter whole in one shard
        (optimizer_view.py); a frozen group is never stepped, so never whole. Allocates nothing: setup/fill.py's
        fill() makes the buffers."""
        whole = tuple(spec.whole_parameters(g) for g in range(len(param_groups)))
        if not spec.gathers_per_unit:
            shards, rank = (comm.shard_size, comm.shard_rank) if spec.shards_optimizer else (1, 0)
            numel = bucket_numel(zero, comm.backend, sum(local(p).numel() for g in param_groups for p in g))
            return cls(lay_out(param_groups, shards, numel, whole=whole), rank, bucket_numel=numel)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in frozen or ():
            by_dtype.setdefault(p.dtype if id(p) in own_dtype else spec.kept_dtype(p), []).append(p)
        groups = stage3_layout(param_groups + list(by_dtype.values()), spec.units, comm.shard_size, zero, whole)
        trained = len(param_groups)
        for g, dtype in zip(groups[trained:], by_dtype):
            g.dtype = dtype
        return cls(groups[:trained], comm.shard_rank, tuple(groups[trained:]))

    @property
    def frozen_buckets(self) -> list[Bucket]:
        """Stage 3's buckets of frozen parameters (none below stage 3)."""
        return [b for g in self.frozen for b in g.buckets]

    def frozen_slots(self) -> Iterator[tuple[Bucket, Slot]]:
        """Every sharded frozen parameter's slot with its bucket, in bucket order."""
        return _slots_of(self.frozen_buckets)

    def by_frozen_param(self) -> dict[int, tuple[Bucket, Slot]]:
        """id(parameter) -> its bucket and slot, for every sharded frozen parameter."""
        return {id(s.param): (b, s) for b, s in self.frozen_slots()}

    def slots(self) -> Iterator[tuple[Bucket, Slot]]:
        """Every trained parameter's slot with its bucket, in bucket order."""
        return _slots_of(self.buckets)

    def by_param(self) -> dict[int, tuple[Bucket, Slot]]:
        """id(parameter) -> its bucket and slot, for every trained parameter."""
        return {id(s.param): (b, s) for b, s in self.slots()}

    def shape_of(self, s: Slot) -> torch.Size:
        """The shape of the parameter in slot `s`, as saved and exported."""
        return s.shape

    def owned_slots(self, b: Bucket) -> Iterator[tuple[int, Slot, int, int]]:
        """Bucket.owned_slots for this rank's shard: (i, slot i, lo, hi), [lo, hi) in bucket coordinates."""
        return b.owned_slots(self.rank)

    def shard_start(self, b: Bucket) -> int:
        """Where this rank's shard of bucket `b` starts, in bucket coordinates."""
        return self.rank * b.shard_numel

    def owned_numel(self, tp_size: int = 1) -> list[int]:
        """Elements of parameters each rank's shards hold (padding not counted): its share of the masters
        and optimizer states. Whole parameters make the shares unequal (flat.lay_out's `_deal`). With
        tensor parallelism (`tp_size` > 1) a tp shard stepped whole counts tp_size times: its owner steps
        the whole matrix gathered over tp, its state in that shape (whole_over_tp.py)."""
        out = [0] * (self.buckets[0].partitions if self.buckets else 1)
        for b in self.buckets:
            for r in range(b.partitions):
                out[r] += sum((hi - lo) * (tp_size if b.whole and not s.tp.duplicate else 1)
                              for _, s, lo, hi in b.owned_slots(r))
        return out


def _slots_of(buckets: list[Bucket]) -> Iterator[tuple[Bucket, Slot]]:
    """Each slot of `buckets` with its bucket, in bucket order."""
    return ((b, s) for b in buckets for s in b.slots)


def frozen_params(module: nn.Module, groups: list[list[nn.Parameter]]) -> list[nn.Parameter]:
    """The model's parameters that no optimizer group trains, in registration order."""
    trained = {id(p) for g in groups for p in g}
    return [p for p in module.parameters() if id(p) not in trained]
