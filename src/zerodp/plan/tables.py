"""The tables of `zerodp estimate` (estimate.py parses the flags): memory per rank, and --fit.

Every figure is per rank, in bytes shown by `human`. The formula columns are memory.py's; the
peak is measured by peak.py (fake tensors) or measure.py (real tensors), or estimated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from rich import box
from rich.table import Table

from zerodp.plan.formulas import activation_estimate, bucket_estimate, placed
from zerodp.plan.models import PlanModel
from zerodp.plan.setup import PATHS as SETUP_PATHS
from zerodp.plan.setup import formula as setup_formula
from zerodp.plan.setup import largest_bucket
from zerodp.plan.setup import measure as setup_measure
from zerodp.plan.setup import measure_specs as setup_measure_specs
from zerodp.plan.setup import results as setup_results
from zerodp.plan.units import human

_SHORT = {"activations": "act", "optimizer": "optim", "step_temps": "step tmp", "gathered": "gathered"}


def size(n: float) -> str:
    """Bytes to 3 significant digits in binary units: '442 KiB', '1.84 MiB', '29.7 GiB'."""
    return human(n, ".3g")


def _compact(n: float) -> str:
    """size() for a crowded cell: '29.7G'."""
    return human(n, ".3g", compact=True)


def _table(title: str, caption: str, columns: list[str]) -> Table:
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 1), title_justify="left",
                  caption_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == len(columns) - 1 or col == "mode" else "right")
    return table


def _formula(args: argparse.Namespace, psi: int, world: int, stage: int, largest: int | None = None) -> dict[str, int]:
    """Device and host model states, and the bucket pool, for one (N, stage)."""
    # offload_optimizer.pin_memory defaults to true: a GPU job pins the block, which the allocator rounds up
    split = placed(psi, world, stage, args.dtype, "adamw", args.gas, args.offload_optimizer, args.offload_param,
                   pin_memory=True, bf16_states=getattr(args, "bf16_optimizer_states", False),
                   bf16_master=getattr(args, "bf16_master_weights", False))
    split["buckets"] = bucket_estimate(psi, world, stage, args.dtype, args.reduce_bucket_size, largest)
    return split


def _activations(args: argparse.Namespace, model: PlanModel) -> int | None:
    shape = model.shape()
    if shape is None:
        return None
    return activation_estimate(shape, args.micro_batch, args.seq, args.dtype, args.checkpointing)


def _parts(at_peak: dict[str, int], n: int = 2) -> str:
    """The n largest categories, compactly: 'act 797M, params 237M'."""
    top = sorted(((v, k) for k, v in at_peak.items() if v), reverse=True)[:n]
    return ", ".join(f"{_SHORT.get(k, k)} {_compact(v)}" for v, k in top)


# ---- memory per rank ----------------------------------------------------------------------------
def memory_tables(args: argparse.Namespace, model: PlanModel, console) -> list[Table]:
    """The memory table, then the set-up table (plan/setup.py) beside its step peaks."""
    table, peaks, setup = _memory_table(args, model, console)
    return [table, setup_table(args, model, peaks, setup)]


def _memory_table(args: argparse.Namespace, model: PlanModel, console) -> tuple[Table, dict, dict]:
    """The table; per (N, stage) the step's peak (measured, or the estimate; None: neither); the set-up
    peaks measured on fake tensors, by (path, N, stage) (setup.measure)."""
    psi = model.num_params()
    measured = {"fake": "measured on fake tensors", "real": "measured on this machine",
                "none": "estimated"}[args.measure]
    batch = (f"micro-batch {args.micro_batch} x {args.seq} tokens" if model.shape() is not None
             else "the factory's inputs")
    low = [what for what, on in (("bf16 masters", getattr(args, "bf16_master_weights", False)),
                                 ("bf16 states", getattr(args, "bf16_optimizer_states", False))) if on]
    title = (f"{model.title()}: Ψ = {psi:,} parameters, {args.dtype}, AdamW{' (' + ', '.join(low) + ')' if low else ''}, {batch}"
             f"{', checkpointing' if args.checkpointing else ''}; per rank, peak {measured}")
    table = _table(title, _caption(args), ["N", "mode", "model states", "buckets", "host", "total", "peak",
                                           "at the peak"])
    cells = [(w, s) for w in args.world for s in args.stage]
    results = _measure(args, model, cells, console)
    act = _activations(args, model)
    largest = model.largest_module() if 3 in args.stage else None
    peaks = {}
    for (world, stage), r in zip(cells, results["zerodp"]):
        f = _formula(args, psi, world, stage, largest)
        total = f["device"] + f["buckets"]
        row = [str(world), f"zerodp {stage}", size(f["device"]), size(f["buckets"]) if f["buckets"] else "-",
               size(f["host"]) if f["host"] else "-", size(total)]
        if isinstance(r, str):  # not measured: why
            peak = "-" if act is None else "≈ " + size(total + act)
            row += [peak, r if act is None or r != "" else f"act ≈ {_compact(act)} (estimate)"]
            peaks[(world, stage)] = None if act is None else total + act
        else:
            row += [size(r["peak"]), r["parts"]]
            peaks[(world, stage)] = r["peak"]
        table.add_row(*row)
    for r in results["torch"]:
        table.add_row(str(r["spec"]["world"]), r["mode"], size(r["formula"]), "-", "-", size(r["formula"]),
                      size(r["peak"]), _parts(r["at_peak"]))
    return table, peaks, results["setup"]


def setup_table(args: argparse.Namespace, model: PlanModel, step_peaks: dict[tuple[int, int], int | None],
                measured: dict[tuple[str, int, int], int | None]) -> Table:
    """Per (N, stage): the set-up peak of each path (measured on fake tensors where `measured` has it,
    else the formula) beside the step's peak, and the larger of the step and the --setup path's
    set-up, which a plan must fit."""
    psi = model.num_params()
    cells = [(w, s) for w in args.world for s in args.stage]
    title = (f"Set-up peak per rank (build, load, zerodp.initialize) beside the step's: {model.title()}, "
             f"{args.dtype}")
    how = {True: "measured on fake tensors", False: "formula"}
    caption = ("meta: built on meta, each rank materialising its part bucket by bucket (fake: also counts "
               "the initialisers' CPU stand-ins, one module at a time, host memory on a GPU); whole: every "
               "rank builds the whole model in fp32 first (plan/setup.py). plan with: the larger of the "
               f"step and the {args.setup} set-up (--setup).")
    table = _table(title, caption, ["N", "stage", "set-up, meta", "set-up, whole", "step peak", "plan with"])
    for world, stage in cells:
        bucket = largest_bucket(model, psi, stage, args.reduce_bucket_size)
        cell = {}
        for path in SETUP_PATHS:
            got = measured.get((path, world, stage))
            cell[path] = (got, how[True]) if got is not None else (setup_formula(path, psi, world, stage, args.dtype,
                                                                           bucket), how[False])
        step = step_peaks.get((world, stage))
        row = [str(world), str(stage)] + [f"{size(v)} ({'fake' if h == how[True] else 'formula'})"
                                          for v, h in cell.values()]
        row.append(size(step) if step is not None else "-")
        need = max(cell[args.setup][0], step or 0)
        row.append(f"{size(need)} ({'set-up' if cell[args.setup][0] > (step or 0) else 'step'})")
        table.add_row(*row)
    return table


def _caption(args: argparse.Namespace) -> str:
    text = ("model states: device bytes by ZeRO's formula (docs/DESIGN.md); buckets: stage 2-3's reduce "
            "pool; total = the two; host: offloaded states, the pinned block rounded up to a power of two. ")
    if args.measure == "fake":
        text += ("peak: the largest sum of live tensors over two steps (PyTorch's MemTracker), allocator "
                 "rounding and library workspaces not in it" + ("; offload's host part is in it (one CPU)"
                                                                if args.offload_optimizer else "") + ".")
    elif args.measure == "real":
        text += "peak: CUDA's max_memory_allocated, or on CPU the whole process's peak RSS."
    else:
        text += "peak ≈ total + activations (Korthikanti et al.'s 34·s·b·h per layer + logits)."
    return text


def _measure(args: argparse.Namespace, model: PlanModel, cells: list[tuple[int, int]], console) -> dict:
    """Per cell a measured {"peak", "parts"} or a string saying why there is none; FSDP2/plain rows."""
    if args.measure == "none" or (model.kind == "factory" and not _has_inputs(model)):
        why = "" if args.measure == "none" else "no inputs: not measured"
        setup = setup_measure(args, model, cells, console) if args.measure == "fake" else {}
        return {"zerodp": [why] * len(cells), "torch": [], "setup": setup}
    base = {"source": dataclasses.asdict(model), "micro_batch": args.micro_batch, "seq": args.seq,
            "dtype": args.dtype, "checkpointing": args.checkpointing}
    zero = {"offload_optimizer": {"device": "cpu"}} if args.offload_optimizer else {}
    if args.measure == "real":
        from zerodp.plan.measure import measure
        out = []
        for world, stage in cells:
            with console.status(f"measuring N={world} stage={stage} on this machine ..."):
                try:
                    r = measure({**base, "world": world, "stage": stage, "gas": args.gas,
                                 "reduce_bucket_size": args.reduce_bucket_size, "offload": args.offload_optimizer})
                except RuntimeError as e:  # e.g. out of memory: say so, go on
                    out.append("failed: " + str(e).strip().splitlines()[-1][-50:])
                    continue
            rep = r["report"]
            parts = {"states": rep["model_states"], "buckets": rep["reduce_buckets"], "step": rep["step_transient"]}
            out.append({"peak": rep.get("cuda_peak_allocated", r["peak_rss"]), "parts": _parts(parts)})
        return {"zerodp": out, "torch": [], "setup": {}}
    from zerodp.plan.peak import measure_peaks
    specs = [{**base, "mode": "zerodp", "stage": s, "world": w, "reduce_bucket_size": args.reduce_bucket_size,
              "zero_optimization": zero} for w, s in cells]
    gpt = {k: v for k, v in base.items() if k != "source"} | {"model": model.fields}
    specs += [{**gpt, "mode": "fsdp2", "world": w, "reshard_after_forward": r}
              for w in args.world for r in (True, False)] if args.fsdp2 else []
    specs += [{**gpt, "mode": "plain", "world": 1}] if args.plain else []
    setup_specs = setup_measure_specs(args, model, cells)
    with console.status(f"measuring {len(specs)} configurations and their set-up on fake tensors ..."):
        results = measure_peaks(specs + setup_specs)
    setup = setup_results(results[len(specs):])
    results = results[:len(specs)]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    psi = results[0]["num_params"]
    torch_rows = []
    for r in results[len(cells):]:
        spec = r["spec"]
        fsdp2 = spec["mode"] == "fsdp2"
        r["mode"] = ("FSDP2" if spec.get("reshard_after_forward") else "FSDP2 no reshard") if fsdp2 else "PyTorch AMP"
        # FSDP2 as stage 3; plain AMP keeps fp32 parameters (its master) and fp32 gradients: 16 bytes each.
        r["formula"] = placed(psi, spec["world"], 3, args.dtype, "adamw")["device"] if fsdp2 else 16 * psi
        torch_rows.append(r)
    return {"zerodp": [{"peak": r["peak"], "parts": _parts(r["at_peak"])} for r in results[:len(cells)]],
            "torch": torch_rows, "setup": setup}


def _has_inputs(model: PlanModel) -> bool:
    import torch
    with torch.device("meta"):
        return model.build()[1] is not None


# ---- --fit --------------------------------------------------------------------------------------
_LADDER = [1.25 ** k for k in range(-12, 18)]  # width and depth factors, 0.07x to 45x


def family(model: PlanModel) -> list[tuple[int, PlanModel]]:
    """(Ψ, model) of the model's family on _LADDER, smallest first, one model per size."""
    scaled = [model.scaled(f) for f in _LADDER]
    return sorted({m.num_params(): m for m in scaled}.items(), key=lambda pm: pm[0])


def largest_fitting(args: argparse.Namespace, members: list[tuple[int, PlanModel]], world: int,
                    stage: int) -> tuple[int, PlanModel] | None:
    """The largest family member whose estimate at --micro-batch fits args.fit, or None."""
    fitting = [(p, m) for p, m in members if _need(args, m, p, world, stage, args.micro_batch) <= args.fit]
    return fitting[-1] if fitting else None


def fit_table(args: argparse.Namespace, model: PlanModel) -> Table:
    """The largest micro-batch for `model`, and the largest of its family at --micro-batch, per (N, stage)."""
    members = family(model)
    psi = model.num_params()
    title = (f"Within {size(args.fit)} per rank: {model.title()}, Ψ = {psi:,}, {args.dtype}, "
             f"seq {args.seq}{', checkpointing' if args.checkpointing else ''}")
    caption = ("estimated, not measured: formula + reduce buckets + activation estimate, or the set-up peak of "
               f"the {args.setup} path (--setup) where it is larger; family: width and depth of the model scaled "
               "together (heads keep their size).")
    table = _table(title, caption, ["N", "stage", "largest micro-batch",
                                    f"largest of the family at micro-batch {args.micro_batch}"])
    for world in args.world:
        for stage in args.stage:
            best = _largest_batch(lambda b: _need(args, model, psi, world, stage, b) <= args.fit)
            big = largest_fitting(args, members, world, stage)
            table.add_row(str(world), str(stage), str(best) if best else "none",
                          f"{params_text(big[0])} ({big[1].shape().n_layer} x {big[1].shape().n_embd})"
                          if big else "none")
    return table


def _need(args, model: PlanModel, psi: int, world: int, stage: int, micro_batch: int) -> int:
    """The larger of the step's estimate and the --setup path's set-up peak (plan/setup.py)."""
    f = _formula(args, psi, world, stage)
    act = activation_estimate(model.shape(), micro_batch, args.seq, args.dtype, args.checkpointing)
    bucket = largest_bucket(model, psi, stage, args.reduce_bucket_size)
    return max(f["device"] + f["buckets"] + act, setup_formula(args.setup, psi, world, stage, args.dtype, bucket))


def _largest_batch(fits) -> int:
    """Double, then bisect between the last fit and the first miss; 0 when not even 1 fits."""
    lo, hi = 0, 1
    while fits(hi) and hi <= 1 << 24:
        lo, hi = hi, hi * 2
    while lo and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def params_text(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
