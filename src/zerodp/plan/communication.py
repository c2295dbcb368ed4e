"""The communication of one training step, planned for N GPUs from one machine (`zerodp estimate --comm`).

Bytes: what each rank sends per step, by collective and by process group, counted as `Comm.traffic`
counts the real collectives (a ring: reduce_scatter and all_gather send (n-1)/n of the full buffer,
all_reduce twice that), so the plan and a run agree byte for byte (tests/test_hierarchical.py):
  stage 0     all_reduce of every gradient bucket over the world, once per step;
  stages 1-3  reduce_scatter of every bucket inside the shard group (S ranks; fp32 in stages 0-1 when
              gradients accumulate over micro-steps, the working precision otherwise), and with
              hierarchical sharding (S < N) all_reduce of its 1/S shard across the replica group
              (N/S ranks); once per step in stage 1, every micro-step in stages 2-3;
  stages 1-2  all_gather of the updated parameters inside the shard group, once per step;
  stage 3     all_gather of each bucket of units (blocks by default, engine/layout/units.py) before its
              forward and once in the backward, every micro-step, except the buckets of the model's
              own unit and of the last one, which stay gathered into the backward (units under
              stage3_param_persistence_threshold stay gathered);
  stages 1-3  one all_reduce of the squared gradient norm and two flags (24 bytes) over the world, with
              one fp64 "used" bit per trainable parameter tensor (8 bytes each, unused.py); stage 0
              sends the flags (16 bytes) and those bits in an all_reduce of their own.
Links: ranks r, r+1, ... fill a node of `gpus_per_node`; a group whose ranks all sit in one node uses
the intra-node link (NVLink), any other group the inter-node one (InfiniBand): a ring runs at its
slowest hop. Time of a collective kind: calls x hops x latency + bytes / bandwidth, hops being n-1 for
reduce_scatter / all_gather and 2(n-1) for all_reduce (the ring's steps).
Step: the gradient reduction overlaps the backward pass (2/3 of the compute), stage 3's gathers the
whole forward and backward (prefetch); the stage 1-2 parameter all_gather follows the optimizer step
and is exposed. Step time = compute + exposed communication.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerodp.plan.formulas import WORKING_BYTES
from zerodp.plan.units import human

if TYPE_CHECKING:  # torch-free at import: estimate's --help answers before torch loads
    from torch import nn

NORM_BYTES = 24  # the fp64 squared norm and the two non-finite flags (optimizer.grad_norm_squared)
FLAG_BYTES = 16  # the two flags alone: stage 0's norm is local, its flags still need every rank


@dataclass(frozen=True)
class Links:
    """Per-GPU bandwidth (GB/s, 1e9 bytes) and per-hop latency (µs) of the two links."""

    intra_gbs: float = 150.0   # NVLink: NCCL bus bandwidth of an A100 node is ~230 GB/s; leave headroom
    inter_gbs: float = 23.0    # InfiniBand HDR, one 200 Gb/s NIC per GPU (25 GB/s), ~90% achieved
    intra_us: float = 3.0
    inter_us: float = 8.0

    def speed(self, link: str) -> tuple[float, float]:
        """(bytes per second, seconds per hop)."""
        if link == "intra":
            return self.intra_gbs * 1e9, self.intra_us * 1e-6
        return self.inter_gbs * 1e9, self.inter_us * 1e-6


@dataclass(frozen=True)
class Job:
    """What the plan needs of a training job. `numel`: elements of all buckets (padded, as the engine
    lays them out, or Ψ); `buckets`: reduce buckets (stage 3: whole units, small ones coalesced);
    `gathered`: stage 3's gathers per micro-step and their elements (None: every bucket twice), as
    stage3.planned_gathers counts them."""

    numel: int
    world: int
    stage: int
    shard_size: int | None = None   # S; None = N (flat)
    element_size: int = 2
    buckets: int = 1
    gas: int = 1
    gpus_per_node: int = 8
    gathered: tuple[int, int] | None = None  # (buckets, elements); None = all of them
    # Trainable parameter tensors: each one's "got a gradient" bit (fp64) rides in the norm's all_reduce
    # (unused.py); 0 with zero_optimization.step_unused_parameters true, which sends none.
    params: int = 0


@dataclass(frozen=True)
class Transfer:
    """One collective kind on one group, per step and rank."""

    op: str
    group: str      # "world", or "shard" / "replica" with hierarchical sharding
    link: str       # "intra" or "inter"
    ranks: int      # ranks in the group
    calls: int
    bytes: float    # sent by each rank per step

    def seconds(self, links: Links) -> float:
        bandwidth, latency = links.speed(self.link)
        hops = (self.ranks - 1) * (2 if self.op == "all_reduce" else 1)
        return self.calls * hops * latency + self.bytes / bandwidth


def _ring(n: int, nbytes: float) -> float:
    return nbytes * (n - 1) / n


def transfers(job: Job) -> list[Transfer]:
    """Every collective of one step, as each rank sends it."""
    n = job.world
    s = job.shard_size or n
    if n % s:
        raise ValueError(f"shard size {s} must divide the world size {n}")
    hier = s < n
    payload = job.numel * job.element_size
    # Stages 0-1 accumulate gradients across micro-steps in fp32 and reduce that buffer (reducer.py).
    grads = job.numel * (4 if job.stage < 2 and job.gas > 1 else job.element_size)

    def t(op: str, group: str, ranks: int, calls: int, nbytes: float) -> Transfer:
        return Transfer(op, group, _link(group, ranks, s, n, job.gpus_per_node), ranks, calls, nbytes)

    if n == 1:
        return []
    bits = 8 * job.params
    if job.stage == 0:  # the flags and used bits in an all_reduce of their own
        return [t("all_reduce", "world", n, job.buckets + 1, 2 * _ring(n, grads) + 2 * _ring(n, FLAG_BYTES + bits))]
    passes = 1 if job.stage == 1 else job.gas
    shard = "shard" if hier else "world"
    out = [t("reduce_scatter", shard, s, passes * job.buckets, passes * _ring(s, grads))]
    if hier:
        out.append(t("all_reduce", "replica", n // s, passes * job.buckets, passes * 2 * _ring(n // s, grads / s)))
    if job.stage < 3:
        out.append(t("all_gather", shard, s, job.buckets, _ring(s, payload)))
    else:
        calls, numel = job.gathered or (2 * job.buckets, 2 * job.numel)
        out.append(t("all_gather", shard, s, job.gas * calls, job.gas * _ring(s, numel * job.element_size)))
    out.append(t("all_reduce", "world", n, 1, 2 * _ring(n, NORM_BYTES + bits)))
    return [x for x in out if x.ranks > 1]


def _link(group: str, ranks: int, s: int, n: int, per_node: int) -> str:
    """Shard groups are S consecutive ranks; a replica group strides by S over the whole world."""
    if group == "shard":
        one_node = ranks <= per_node and per_node % ranks == 0
    else:
        one_node = n <= per_node
    return "intra" if one_node else "inter"


@dataclass(frozen=True)
class StepTime:
    compute: float
    reduce: float     # gradient reduce_scatter / all_reduce: overlaps backward
    gather: float     # parameter all_gather (+ the norm's all_reduce)
    exposed: float

    @property
    def step(self) -> float:
        return self.compute + self.exposed

    @property
    def hidden(self) -> bool:
        return self.exposed <= 0.05 * self.compute


def step_time(job: Job, compute_s: float, links: Links = Links()) -> StepTime:
    """Compute plus the communication that the compute cannot hide (see the module docstring)."""
    reduce = gather = 0.0
    for x in transfers(job):
        gradients = x.op == "reduce_scatter" or (x.op == "all_reduce" and (x.group == "replica" or job.stage == 0))
        if gradients:
            reduce += x.seconds(links)
        else:
            gather += x.seconds(links)
    if job.stage == 3:
        exposed = max(0.0, reduce + gather - compute_s)
    else:
        exposed = max(0.0, reduce - 2 / 3 * compute_s) + gather
    return StepTime(compute_s, reduce, gather, exposed)


# ---- `zerodp estimate --comm` ---------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = Links()
    g = ap.add_argument_group("communication plan (--comm)")
    g.add_argument("--comm", action="store_true", help="print the bytes each rank sends per step and a step-time model")
    g.add_argument("--shard-size", type=int, nargs="+", default=[0], metavar="S",
                   help="hierarchical sharding groups (mics_shard_size); 0 = flat (S = N)")
    g.add_argument("--gpus-per-node", type=int, help="default 8 (with --tp: T when larger)")
    g.add_argument("--intra-gbs", type=float, default=d.intra_gbs, help="NVLink GB/s per GPU")
    g.add_argument("--inter-gbs", type=float, default=d.inter_gbs, help="InfiniBand GB/s per GPU")
    g.add_argument("--intra-us", type=float, default=d.intra_us, help="NVLink latency per ring hop, µs")
    g.add_argument("--inter-us", type=float, default=d.inter_us, help="InfiniBand latency per ring hop, µs")
    g.add_argument("--compute-s", type=float, help="measured compute time of one step (forward + backward)")
    g.add_argument("--tflops", type=float, default=150.0,
                   help="without --compute-s: achieved TFLOP/s per GPU; compute = 6Ψ·tokens (8Ψ checkpointed)")


def jobs_for(model: nn.Module, world: int, stage: int, shard: int, element_size: int, bucket_numel: int,
             gas: int, per_node: int, persistence: int = 100_000) -> Job:
    """The plan's Job for a model (on any device, meta included) laid out as the engine would.
    Stage 3: the engine's default units and buckets (engine/layout/units.py), the last unit taken to be the
    last one registered (a transformer's last block)."""
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = sum(1 for p in model.parameters() if p.requires_grad)  # tied weights once, as parameters() gives
    if stage != 3:
        return Job(psi, world, stage, shard or world, element_size, max(1, math.ceil(psi / bucket_numel)), gas,
                   per_node, params=params)
    from zerodp.config import (
        ZeroConfig,  # late: `zerodp estimate --help` stays torch-free
    )
    from zerodp.engine.sharding.gather import kept_last, planned_gathers, unit_buckets
    from zerodp.engine.layout.units import find_units, layout

    zero = ZeroConfig(stage=3, stage3_param_persistence_threshold=persistence)
    units = find_units(model, zero.stage3_unit)
    # the engine's layout: the trained group, then the frozen one (gathered, never reduced)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    groups = layout([[p for p in model.parameters() if p.requires_grad]] + ([frozen] if frozen else []), units,
                    shard or world, zero)
    trained, buckets = groups[0].buckets, [b for g in groups for b in g.buckets]
    last = max((u for u, used in enumerate(units.uses) if used and u != units.outer), default=None)
    kept = kept_last(last, [] if last is None else unit_buckets(units, buckets)[last], zero.stage3_prefetch_bucket_size)
    return Job(sum(b.numel for b in trained), world, stage, shard or world, element_size, len(trained), gas, per_node,
               planned_gathers(units, buckets, kept), params=params)


def render(args: argparse.Namespace, plan_model, console) -> None:
    """estimate's section hook (estimate.SECTION_MODULES): with --comm, the two tables below."""
    if not args.comm:
        return
    import torch

    with torch.device("meta"):
        model, _ = plan_model.build()
    console.print(*section(args, model, args.micro_batch * args.seq * args.gas, WORKING_BYTES[args.dtype]))


def section(args: argparse.Namespace, model: nn.Module, tokens_per_gpu: int, element_size: int):
    """The rich tables `zerodp estimate --comm` prints: bytes by collective and link, and step times."""
    from rich.table import Table

    links = Links(args.intra_gbs, args.inter_gbs, args.intra_us, args.inter_us)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    flops = (8 if getattr(args, "checkpointing", False) else 6) * psi * tokens_per_gpu
    compute = args.compute_s if args.compute_s is not None else flops / (args.tflops * 1e12)
    where = (f"--compute-s {args.compute_s}" if args.compute_s is not None
             else f"{flops:.3g} FLOP at {args.tflops:g} TFLOP/s")
    per_node = args.gpus_per_node or 8
    bytes_t = Table(title=f"Bytes each rank sends per step ({per_node} GPUs per node)")
    for c in ("N", "S", "stage", "collective", "group", "link", "calls", "bytes", "time"):
        bytes_t.add_column(c, justify="right" if c in ("N", "S", "stage", "calls", "bytes", "time") else "left")
    steps = Table(title=f"Step time: compute {compute * 1e3:.1f} ms ({where}); links NVLink {links.intra_gbs:g} GB/s "
                        f"{links.intra_us:g} µs, InfiniBand {links.inter_gbs:g} GB/s {links.inter_us:g} µs per hop")
    for c in ("N", "S", "stage", "intra-node", "inter-node", "reduce", "gather", "exposed", "step", "hidden"):
        steps.add_column(c, justify="right")
    for world in args.world:
        for s in args.shard_size:
            if s and (world % s or s > world):
                continue
            for stage in args.stage:
                if stage == 0 and s and s != world:
                    continue
                job = jobs_for(model, world, stage, s, element_size, args.reduce_bucket_size, args.gas,
                               per_node)
                xs = transfers(job)
                for x in xs:
                    bytes_t.add_row(str(world), str(s or world), str(stage), x.op, x.group, x.link, str(x.calls),
                                    _bytes(x.bytes), _ms(x.seconds(links)))
                t = step_time(job, compute, links)
                by = {k: sum(x.bytes for x in xs if x.link == k) for k in ("intra", "inter")}
                steps.add_row(str(world), str(s or world), str(stage), _bytes(by["intra"]), _bytes(by["inter"]),
                              _ms(t.reduce), _ms(t.gather), _ms(t.exposed), _ms(t.step), "yes" if t.hidden else "no")
    return bytes_t, steps


def _bytes(n: float) -> str:
    return human(n, ".1f")


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"
