"""ZeRO over the data-parallel dimension of a tensor-parallel model, planned (`zerodp estimate --tp T`).

The seed's headline runs (100B on 400 V100s, 170B trainable) were ZeRO-2 *with* Megatron tensor
parallelism inside a node: every GPU holds 1/T of each weight matrix, and ZeRO partitions that local
shard over the D = N/T data-parallel ranks. Per GPU, with Ψ parameters (norms and biases that tensor
parallelism replicates are under 0.1% of a large transformer and are counted as split):
  model states  DESIGN.md's formula for Ψ/T parameters on D ranks: stage 2 in bf16 (2Ψ + 14Ψ/D)/T
  activations   Korthikanti et al. 2022, eq. 2 without sequence parallelism and with fused attention
                (no score matrix): s·b·h·(10 + 24/T) bytes per layer in 16-bit (plan/formulas.activation_estimate,
                which gives 34 s·b·h at T = 1); checkpointed, each layer keeps its 2·s·b·h input and
                one layer is live in the recompute; the logits split over T (vocabulary-parallel head)
  tp traffic    Megatron's two all-reduces of s·b·h activations per layer in the forward and two in the
                backward (two more when checkpointing recomputes the forward), every micro-step; a ring
                all-reduce sends 2(T-1)/T of the buffer per GPU; embeddings and loss left out
  ZeRO traffic  reduce-scatter + all-gather of the local Ψ/T (stage 3: 1.5x) among the D ranks holding
                the same tensor-parallel shard; bucketing, norms and flags left out (--comm counts those)
Ranks fill nodes tp-first (rank = d·T + t), as torchtitan's and Megatron's meshes do: the tp group sits
inside a node when T <= GPUs per node, and each data-parallel group crosses nodes.

Beside each plan, tensor parallelism alone (Megatron without ZeRO: stage 0, 16Ψ/T of model states) at
the same T and at the smallest T whose model states and activations fit --gpu-memory: the seed's 10x
was ZeRO letting T stay inside a node where tensor parallelism alone must cross nodes. T splits the
attention heads (as `zerodp train --tp` and Megatron do), so only the divisors of the model's heads
are tried (powers of two for a model of unknown shape); a T that does not divide N plans on the
largest multiple of T below N, and the table says how many GPUs that leaves idle.

These are formulas, not measurements: zerodp trains a tensor-parallel model (`zerodp train --tp`,
`zerodp.initialize(device_mesh=...)`), but estimate's measured step runs a model without tp.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from zerodp.plan.formulas import WORKING_BYTES, activation_estimate, formula
from zerodp.plan.units import human, parse_bytes

SEED_GPU_MEMORY = 32 * 2**30  # the seed's V100s


@dataclass(frozen=True)
class TensorParallelPlan:
    """One (N, T, stage) job's per-GPU memory and traffic, by the formulas above."""

    world: int
    tp: int
    stage: int
    model_states: int  # bytes per GPU (device; host with offload is left to the main table)
    activations: int | None  # bytes per GPU, None for a model of unknown shape
    tp_bytes: float  # each GPU sends per step in tensor-parallel all-reduces
    zero_bytes: float  # each GPU sends per step in ZeRO's collectives over its data-parallel group
    tp_inside_node: bool

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def total(self) -> int:
        return self.model_states + (self.activations or 0)


def plan(psi: int, shape, world: int, tp: int, stage: int, dtype: str = "bf16", micro_batch: int = 1,
         seq: int = 1024, gas: int = 1, checkpointing: bool = False, gpus_per_node: int = 8) -> TensorParallelPlan:
    """The per-GPU figures of Ψ parameters on `world` GPUs as (world/tp data-parallel) x (tp tensor-parallel).
    shape: n_layer, n_embd, vocab_size (PlanModel.shape()), or None."""
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} must divide the world {world}: the world is data-parallel x tensor-parallel")
    dp, w = world // tp, WORKING_BYTES[dtype]
    local = math.ceil(psi / tp)
    states = formula(local, dp, stage, dtype, "adamw", gas)
    acts = tp_bytes = None
    if shape is not None:
        sbh = seq * micro_batch * shape.n_embd
        acts = activation_estimate(shape, micro_batch, seq, dtype, checkpointing, tp)
        all_reduces = (6 if checkpointing else 4) * shape.n_layer * gas
        tp_bytes = all_reduces * 2 * (tp - 1) / tp * sbh * w
    zero = (3 if stage == 3 else 2) * (dp - 1) / dp * local * w if dp > 1 else 0.0
    return TensorParallelPlan(world, tp, stage, states, acts, tp_bytes or 0.0, zero, tp <= gpus_per_node)


def tp_sizes(shape, world: int, limit: int = 4096) -> list[int]:
    """The tensor-parallel sizes a model can be split into on `world` GPUs, ascending: the divisors of its
    attention heads (a head is never split), or the powers of two up to `limit` when its heads are unknown;
    at most `world` either way."""
    heads = getattr(shape, "n_head", None)
    if heads:
        return [t for t in range(1, min(heads, world) + 1) if heads % t == 0]
    return [2**k for k in range(limit.bit_length()) if 2**k <= min(limit, world)]


def smallest_fitting_tp(psi: int, shape, world: int, gpu_memory: int, limit: int = 4096, **kw) -> int | None:
    """The smallest T of tp_sizes at which tensor parallelism alone (stage 0) fits `gpu_memory` on the
    largest multiple of T within `world` GPUs (model states and activations); None if none does."""
    for tp in tp_sizes(shape, world, limit):
        if plan(psi, shape, world // tp * tp, tp, 0, **kw).total <= gpu_memory:
            return tp
    return None


# ---- `zerodp estimate --tp` -----------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("tensor parallelism (--tp)")
    g.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel degree: each GPU holds 1/T of every weight matrix and ZeRO partitions it "
                        "over the N/T data-parallel ranks; T must divide the model's attention heads (planned "
                        "from formulas; `zerodp train --tp` trains this way)")
    g.add_argument("--gpu-memory", type=parse_bytes, default=SEED_GPU_MEMORY, metavar="BYTES",
                   help="per-GPU memory the --tp table checks against (default 32GiB, the seed's V100)")


def check(ap: argparse.ArgumentParser, args: argparse.Namespace, shape=None) -> None:
    """--tp's flags, before anything is built (shape: the model's, PlanModel.shape(), or None)."""
    if args.tp < 1:
        ap.error("--tp must be at least 1")
    if args.tp == 1:
        return
    bad = [w for w in args.world if w % args.tp]
    if bad:
        ap.error(f"--tp {args.tp} must divide every --world (not {', '.join(map(str, bad))}): "
                 "N GPUs are N/T data-parallel ranks x T tensor-parallel ones")
    heads = getattr(shape, "n_head", None)
    if heads and heads % args.tp:
        ap.error(f"--tp {args.tp} does not divide the model's {heads} attention heads, which tensor parallelism "
                 f"splits whole; use one of {', '.join(map(str, tp_sizes(shape, heads)[1:]))}")
    if args.measure in ("fake", "real"):
        ap.error(f"--measure {args.measure} measures zerodp's step on a model without tensor parallelism; --tp plans "
                 "from the formulas (leave --measure out, or --measure none)")
    for flag, given in (("--fit", args.fit is not None), ("--offload-optimizer", args.offload_optimizer),
                        ("--offload-param", args.offload_param), ("--fsdp2", args.fsdp2), ("--plain", args.plain),
                        ("--comm", args.comm)):
        if given:
            ap.error(f"{flag} is not planned with --tp yet; the --tp table gives model states, activations and traffic")


def render(args: argparse.Namespace, plan_model, console) -> None:
    """estimate's section hook (estimate.SECTION_MODULES): with --tp > 1, the table below."""
    if args.tp > 1:
        console.print(table(args, plan_model))


def table(args: argparse.Namespace, plan_model):
    """Per --world and --stage: zerodp + tp, tensor parallelism alone at the same T, and at the
    smallest T at which it fits --gpu-memory."""
    from rich import box
    from rich.table import Table

    from zerodp.plan.communication import Links
    psi, shape = plan_model.num_params(), plan_model.shape()
    per_node, links = gpus_per_node(args), Links(args.intra_gbs, args.inter_gbs)
    kw = dict(dtype=args.dtype, micro_batch=args.micro_batch, seq=args.seq, gas=args.gas,
              checkpointing=args.checkpointing, gpus_per_node=per_node)
    title = (f"{plan_model.title()} with tensor parallelism: Ψ = {psi:,}, {args.dtype}, AdamW, micro-batch "
             f"{args.micro_batch} x {args.seq} tokens{', checkpointing' if args.checkpointing else ''}, "
             f"{per_node} GPUs per node; per GPU")
    caption = ("Formulas (plan/tensor_parallel.py), not measured: model states (2Ψ + 14Ψ/D)/T at stage 2 in bf16; "
               "activations Korthikanti et al. eq. 2 (no sequence parallelism); bytes each GPU sends per step, "
               f"timed at NVLink {links.intra_gbs:g} / InfiniBand {links.inter_gbs:g} GB/s (--intra-gbs, --inter-gbs): "
               "tp's all-reduces wait in the forward and backward, ZeRO's overlap the backward. 'tp alone' is "
               f"Megatron without ZeRO (stage 0). fits: total <= {human(args.gpu_memory)} (--gpu-memory).")
    t = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
              title_justify="left", caption_justify="left")
    for col in ("N", "setup", "D x T", "model\nstates", "activ-\nations", "total", "fits", "tp\nsends", "tp\nlink",
                "tp\ntime", "ZeRO\nsends", "ZeRO\ntime"):
        t.add_column(col, justify="left" if col == "setup" else "right", no_wrap=True)
    notes = []
    for world in args.world:
        rows = [(f"zerodp {s}", plan(psi, shape, world, args.tp, s, **kw)) for s in args.stage]
        rows.append(("tp alone", plan(psi, shape, world, args.tp, 0, **kw)))
        rows += _tp_alone_rows(psi, shape, world, args, notes, **kw)
        for name, p in rows:
            tp_speed = links.speed("intra" if p.tp_inside_node else "inter")[0]
            t.add_row(str(p.world), name, f"{p.dp} x {p.tp}", _size(p.model_states),
                      "-" if p.activations is None else _size(p.activations), _size(p.total),
                      "yes" if p.total <= args.gpu_memory else "no",
                      _size(p.tp_bytes), "NVLink" if p.tp_inside_node else "IB",
                      f"{p.tp_bytes / tp_speed:.2f}s", _size(p.zero_bytes),
                      f"{p.zero_bytes / links.speed('inter')[0]:.2f}s")
    t.caption += "".join(f"\n{n}" for n in notes)
    return t


def _tp_alone_rows(psi: int, shape, world: int, args: argparse.Namespace, notes: list[str], **kw) -> list:
    """Tensor parallelism alone at the smallest T that fits (tp_sizes), or, when none does, at the largest
    T the model splits into, with a note saying so; a T that does not divide N is planned on fewer GPUs:
    the row's N and its note say how many."""
    fit = smallest_fitting_tp(psi, shape, world, args.gpu_memory, **kw)
    heads = getattr(shape, "n_head", None)
    if fit is None:
        fit = tp_sizes(shape, world)[-1]
        split = f"that divides its {heads} attention heads" if heads else "(a power of two)"
        notes.append(f"On {world} GPUs tensor parallelism alone fits {human(args.gpu_memory)} at no T {split}; "
                     f"the largest, T = {fit}, is shown.")
    if fit == args.tp:
        return []
    used = world // fit * fit
    if used == world:
        return [("tp alone", plan(psi, shape, world, fit, 0, **kw))]
    notes.append(f"N = {used}: {world} GPUs are not a multiple of T = {fit}; tensor parallelism alone runs on {used} "
                 f"of them ({used // fit} x {fit}) and leaves {world - used} idle.")
    return [("tp alone", plan(psi, shape, used, fit, 0, **kw))]


def _size(n: float) -> str:
    return human(n, ".3g", compact=True)


def gpus_per_node(args: argparse.Namespace) -> int:
    """--gpus-per-node (the --comm section's flag), or by default 8, or T when T is larger: the seed ran its
    16-way tensor parallelism inside 16-GPU DGX-2 nodes."""
    given = getattr(args, "gpus_per_node", None)
    return given if given is not None else max(8, args.tp)
