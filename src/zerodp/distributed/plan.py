"""How each collective zerodp issues is carried out on this backend: `CollectivePlan`, one decision.

ZeRO's gradient reduce-scatter and parameter all-gather move DDP's bytes on NCCL, but on gloo the two
together cost about 3x one all-reduce of the same bytes. Each can be done through an all-reduce instead:

  * reduce-scatter as all-reduce: the whole bucket is summed in place (DDP's bytes) and each rank keeps
    its chunk; the bucket's other chunks end up summed too, where the native op leaves them as they were;
  * all-gather as all-reduce: the output bucket is zeroed but for this rank's chunk and summed in place
    (x + 0 + ... + 0 is x exactly, in any dtype).

Both are the same sums as the native ops (for two ranks bit for bit; for more, a sum in another order, within
fp32 rounding). Both work in the buffers the caller gives (the reduce bucket, the gathered bucket): no bytes
beyond them; the reduction's result occupies the whole bucket instead of one shard of it
(`CollectivePlan.whole_bucket_bytes`, in memory_report).

Which is faster depends on the backend and the size, so it is measured: on gloo, `decide` times each
implementation at two sizes (`PROBE_SIZES`, `probe`: in turns, each one's fastest run), once per process and
group shape, at set-up before the model's memory is taken; a bucket takes the choice of the probed size nearest
its own. Rank 0's times decide
and are broadcast, so every rank runs the same implementation. NCCL and every other backend keep
their native ops; the fake backend and a world of one have nothing to choose. The config key `collectives`
forces one implementation ("native" or "all_reduce") instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

IMPLEMENTATIONS = ("native", "all_reduce")
OPS = ("reduce_scatter", "all_gather")
CHOICES = ("auto", *IMPLEMENTATIONS)  # the config key's values

# torch >= 2.13 calls the flat collectives all_gather_single / reduce_scatter_single and warns on the old
# names, which are all that torch 2.11 has.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

PROBE_REPEATS = 5
# The probed sizes, in elements, capped by what the model shards: gloo's reduce-scatter falls behind an
# all-reduce from about 256K fp32 elements (2 ranks, this machine); above 1M the cost per byte holds, and the
# probe stays short (a few ms per run on 2 ranks) and small.
PROBE_SIZES = (1 << 16, 1 << 20)
_PROBED: dict[tuple, dict] = {}  # (backend, ranks, sizes) -> rank 0's times: one probe per process and shape


@dataclass(frozen=True)
class CollectivePlan:
    """For each of zerodp's sharding collectives, the implementation used, by bucket size.

    choices: (op, numel, implementation) for each probed size; a bucket takes the choice of the probed size
    nearest its own (on a log scale). None probed: every op native. why: how the choice was made."""

    backend: str
    choices: tuple[tuple[str, int, str], ...] = ()
    why: str = "native ops"
    said: bool = True  # False: nothing was there to choose (no peers, nothing sharded): the set-up line is silent

    def implementation(self, op: str, numel: int) -> str:
        sized = [(abs(math.log(max(numel, 1)) - math.log(n)), impl) for o, n, impl in self.choices if o == op]
        return min(sized)[1] if sized else "native"

    def describe(self) -> str:
        """One phrase for the set-up line: what each op runs as, and why ("" when there was nothing to choose)."""
        if not self.said:
            return ""
        parts = []
        for op in OPS:
            impls = sorted({impl for o, _, impl in self.choices if o == op} or {"native"})
            by_size = ", ".join(f"{_count(n)}: {impl}" for o, n, impl in self.choices if o == op)
            what = impls[0] if len(impls) == 1 else f"by size ({by_size})"
            parts.append(f"{op.replace('_', '-')} {what}")
        return f"collectives on {self.backend}: {', '.join(parts)} ({self.why})"

    def whole_bucket_bytes(self, bucket_numels: list[int], element_size: int, shard_size: int) -> int:
        """What a reduction this plan sums whole holds beyond the shard the native op delivers, for the largest
        such bucket: the rest of the reduce bucket, which the reducer holds anyway (counted in reduce_buckets;
        memory_report states it, adds nothing)."""
        extra = [(n - n // shard_size) * element_size for n in bucket_numels
                 if self.implementation("reduce_scatter", n) == "all_reduce"]
        return max(extra, default=0)


def _count(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1 << 10 else str(n)


def forced(backend: str, implementation: str) -> CollectivePlan:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"collectives={implementation!r}: expected one of {', '.join(CHOICES)}")
    return CollectivePlan(backend, tuple((op, 1, implementation) for op in OPS),
                          "native ops" if implementation == "native" else "forced by the config key 'collectives'")


def pick(backend: str, times: dict[tuple[str, int, str], float]) -> CollectivePlan:
    """The plan from measured seconds per (op, numel, implementation): the fastest at each op and size
    (native on a tie)."""
    sizes = sorted({(op, n) for op, n, _ in times})
    choices = tuple((op, n, min(IMPLEMENTATIONS, key=lambda impl: (times[op, n, impl], impl != "native")))
                    for op, n in sizes)
    return CollectivePlan(backend, choices, "measured at set-up")


def decide(comm, choice: str, sharded_numel: int) -> CollectivePlan:
    """Collective over comm.everyone when it probes: the plan for `comm` (its shard group runs the sharding
    collectives) when the model shards `sharded_numel` elements. Every rank returns the same plan."""
    plan = without_probe(comm.backend, choice, comm.shard.world_size, comm.is_fake(), sharded_numel)
    if plan is not None:
        return plan
    sizes = _agreed_sizes(comm, sharded_numel)
    key = (comm.backend, tuple(dist.get_process_group_ranks(comm.shard.group)), sizes)
    if key not in _PROBED:
        _PROBED[key] = probe(comm.shard.group, sizes)
    keys = sorted(_PROBED[key])
    ranks0 = torch.tensor([_PROBED[key][k] for k in keys], dtype=torch.float64)
    _from_rank0(comm, ranks0)  # rank 0's times decide, so every rank picks alike
    return pick(comm.backend, dict(zip(keys, ranks0.tolist())))


def without_probe(backend: str, choice: str, shard_world: int, fake: bool, sharded_numel: int
                  ) -> CollectivePlan | None:
    """The plan when nothing needs measuring (None: probe): a forced choice, nothing sharded, no peers (a
    world of one, the fake backend), or a backend other than gloo, whose own ops are kept (NCCL's cost what
    one all-reduce does already)."""
    if choice != "auto":
        return forced(backend, choice)
    if not sharded_numel:
        return CollectivePlan(backend, why="nothing sharded", said=False)
    if shard_world == 1 or fake:
        return CollectivePlan(backend, why="nothing to choose: no peers", said=False)
    if backend != "gloo":
        return CollectivePlan(backend, why=f"{backend}'s own ops")
    return None


def _agreed_sizes(comm, sharded_numel: int) -> tuple[int, ...]:
    """PROBE_SIZES, none above what the model shards, whole shards each; rank 0's, so the probe runs the same
    sizes everywhere."""
    world = comm.shard.world_size
    sizes = torch.tensor([-(-min(n, sharded_numel) // world) * world for n in PROBE_SIZES], dtype=torch.int64)
    _from_rank0(comm, sizes)
    return tuple(sorted(set(sizes.tolist())))


def _from_rank0(comm, t: torch.Tensor) -> None:
    """Rank 0's `t` on every rank of comm.everyone, past Comm's tally and watchers: the probe's control
    messages are not training traffic."""
    group = comm.everyone.group
    dist.broadcast(t, dist.get_global_rank(group, 0), group=group)


def probe(group: dist.ProcessGroup, sizes: tuple[int, ...], repeats: int = PROBE_REPEATS, clock=time.perf_counter
          ) -> dict[tuple[str, int, str], float]:
    """Collective on `group`: the fastest of `repeats` seconds of each op's implementations at each size (fp32),
    after one untimed round. The implementations take turns round by round (A B A B, not A A B B) and each keeps
    its minimum: on a shared machine a neighbour's burst then slows one round of each, and the minimum is the
    run it least disturbed (load only ever adds time). Every rank measures; the caller keeps rank 0's."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    runs = {}
    for n in sizes:
        bucket, out = torch.zeros(n), torch.zeros(n // world)
        for op in OPS:
            for impl in IMPLEMENTATIONS:
                def run(op=op, impl=impl, bucket=bucket, out=out):
                    if op == "reduce_scatter":
                        return reduce_scatter(impl, group, out, bucket, rank, world, False)
                    return all_gather(impl, group, bucket, bucket.view(world, -1)[rank], rank, world, False)
                runs[op, n, impl] = run
    samples: dict[tuple[str, int, str], list[float]] = {key: [] for key in runs}
    for _ in range(repeats + 1):
        for key, run in runs.items():
            start = clock()
            run()
            samples[key].append(clock() - start)
    return {key: min(s[1:]) for key, s in samples.items()}


class Finished:
    """An async collective's handle whose wait() also does what must follow it (copy this rank's chunk out)."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        if self.then is not None:
            self.then()
            self.then = None
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


def reduce_scatter(impl: str, group, out: torch.Tensor, inp: torch.Tensor, rank: int, world: int, async_op: bool):
    """Sum `inp` over the group's ranks into `out` (this rank's chunk; may alias it). As all-reduce, `inp` is
    summed whole in place."""
    if impl == "native":
        return _reduce_scatter_single(out, inp, group=group, async_op=async_op)
    mine = inp.view(world, -1)[rank]
    then = None if mine.data_ptr() == out.data_ptr() else (lambda: out.copy_(mine.view_as(out)))
    work = dist.all_reduce(inp, group=group, async_op=async_op)
    if async_op:
        return Finished(work, then)
    if then is not None:
        then()
    return None


def all_gather(impl: str, group, out: torch.Tensor, inp: torch.Tensor, rank: int, world: int, async_op: bool):
    """Every rank's `inp` concatenated into `out` (`inp` may be this rank's chunk of it). As all-reduce,
    `out` is zeroed but for this rank's chunk and summed in place, as integers: each byte then has one nonzero
    summand, so every bit arrives as it was sent (a float sum would turn -0.0 into +0.0 and quiet a NaN's
    payload, which is where packed 4-bit words stored as bf16 live)."""
    if impl == "native":
        return _all_gather_single(out, inp, group=group, async_op=async_op)
    chunks = out.view(world, -1)
    if chunks[rank].data_ptr() != inp.data_ptr():
        chunks[rank].copy_(inp.view(-1))
    chunks[:rank].zero_()
    chunks[rank + 1:].zero_()
    flat = out.view(-1)
    words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.uint8)
    return dist.all_reduce(words, group=group, async_op=async_op)
