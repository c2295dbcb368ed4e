"""Per-rank peak host memory (RSS) of setting a job up: build the GPT + zerodp.initialize, three ways,
measured in the same run, each configuration in fresh processes, one at a time:

  meta   built under torch.device("meta"); initialize materialises on each rank only what its stage keeps
  whole  built whole on every rank, then initialize, with this tree's zerodp
  main   the same with the zerodp of --main-src (today's path, for the side-by-side)
  fsdp2  FSDP2's meta flow: fully_shard (each block, then the root) on meta, to_empty, reset_parameters

    python benchmarks/setup_memory.py --model 350M --worlds 2 4 --stages 2 3 --dtypes fp32 bf16 \\
        --modes meta whole main fsdp2 --out benchmarks/results/setup_memory.json

--model stack is issue 24's 201M-parameter stack of 48 Linear(2048, 2048), built on meta in both its modes
(meta: this tree's zerodp; main: --main-src's), stage 3: its table gives every rank's peak beside the
set-up bound, the rank's fp32 shard plus one fp32 bucket.

    python benchmarks/setup_memory.py --model stack --worlds 2 4 --stages 3 --dtypes fp32 --modes meta main

Peak = VmHWM - VmRSS once torch, zerodp and the process group are up (the baseline; the high-water mark
is reset there through /proc/self/clear_refs). The bound beside it is the steady state of the model
states (docs/DESIGN.md's table; fp32 keeps no separate master) plus one bucket in fp32 (stage 2:
reduce_bucket_size; stage 3: the largest module), the figure the issue holds set-up to.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GB = 1024 ** 3
BUCKET = 50_000_000  # zerodp's default reduce_bucket_size


def status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _model(size: str) -> torch.nn.Module:
    """The GPT of that size, or (size "stack") 48 Linear(2048, 2048), 201M parameters."""
    if size == "stack":
        return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(48)])
    from zerodp.models.gpt import GPT, gpt_config
    return GPT(gpt_config(size))


def _build(mode: str, size: str, stage: int, dtype: str, world: int) -> None:
    import zerodp
    torch.manual_seed(0)
    if mode == "whole" or (mode == "main" and size != "stack"):
        model = _model(size)
    else:
        with torch.device("meta"):
            model = _model(size)
    if mode == "fsdp2":
        _fsdp2(model, dtype, world)
        return
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg)


def _fsdp2(model: torch.nn.Module, dtype: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for m in model.modules():
            if m is not model and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
    torch.optim.AdamW(model.parameters(), lr=1e-4)


def _rank(rank: int, world: int, store_path: str, out_dir: str, job: dict) -> None:
    torch.set_num_threads(1)
    if job["mode"] == "main":
        sys.path.insert(0, job["main_src"])
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    import zerodp.engine.engine  # imported before the baseline
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    measure(lambda: _build(job["mode"], job["model"], job["stage"], job["dtype"], world), out_dir, rank)
    dist.barrier()
    dist.destroy_process_group()
    assert job["mode"] != "main" or zerodp.engine.engine.__file__.startswith(job["main_src"])


def measure(set_up: Callable[[], None], out_dir: str, rank: int) -> None:
    """This rank's peak RSS above what it holds now, while set_up() runs, written to out_dir/{rank}.json."""
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from here
    t0 = time.perf_counter()
    set_up()
    seconds = time.perf_counter() - t0
    peak = status("VmHWM") - base
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"base": base, "peak": peak, "seconds": seconds}, f)


def run(job: dict, rank_fn: Callable = _rank) -> dict:
    """job on job["world"] spawned ranks, each running rank_fn(rank, world, store, out_dir, job) and
    measure(); the row: the job with the largest rank's peak."""
    world = job["world"]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_fn, args=(world, os.path.join(tmp, "store"), tmp, job), nprocs=world,
                           join=True, start_method="spawn")
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]
    return {**job, "peak": max(r["peak"] for r in ranks), "peaks": [r["peak"] for r in ranks],
            "base": ranks[0]["base"], "seconds": max(r["seconds"] for r in ranks)}


def bound(psi: int, largest: int, stage: int, dtype: str, world: int) -> float:
    """Steady-state model-state bytes per rank (docs/DESIGN.md) plus one fp32 bucket."""
    if stage == 3:
        return 16 * psi / world + 4 * largest
    working = 2 if dtype == "bf16" else 4
    return working * psi + (16 - working) * psi / world + 4 * BUCKET


def table(rows: list[dict], psi: int, largest: int) -> str:
    out = [f"GPT {rows[0]['model']} (Ψ = {psi / 1e6:.1f}M); per-rank peak RSS above the baseline, GiB "
           "(B/param); bound = steady-state model states + one fp32 bucket",
           "", "| world | stage | dtype | meta | whole, now | whole, main (today) | FSDP2 meta flow | bound "
           "| meta / bound |", "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["world"], r["stage"], r["dtype"]) for r in rows if r["mode"] != "fsdp2"})
    for world, stage, dtype in keys:
        cell = {}
        for r in rows:
            if r["world"] == world and r["dtype"] == dtype and (r["stage"] == stage or r["mode"] == "fsdp2"):
                cell[r["mode"]] = f"{r['peak'] / GB:.2f} ({r['peak'] / psi:.1f})"
        b = bound(psi, largest, stage, dtype, world)
        meta = next((r["peak"] for r in rows if (r["world"], r["stage"], r["dtype"], r["mode"])
                     == (world, stage, dtype, "meta")), None)
        ratio = f"{meta / b:.2f}" if meta is not None else "-"
        fsdp = cell.get("fsdp2", "-") if stage == 3 else "-"
        out.append(f"| {world} | {stage} | {dtype} | {cell.get('meta', '-')} | {cell.get('whole', '-')} | "
                   f"{cell.get('main', '-')} | {fsdp} | {b / GB:.2f} ({b / psi:.1f}) | {ratio} |")
    return "\n".join(out)


def stack_table(rows: list[dict], psi: int) -> str:
    """Every rank's peak at stage 3 in fp32 beside the rank's fp32 shard plus one fp32 bucket."""
    out = [f"48 x Linear(2048, 2048) on meta (Ψ = {psi / 1e6:.1f}M), stage 3, fp32; per-rank peak RSS above "
           "the baseline, MiB; bound = fp32 shard (4Ψ/N) + one fp32 bucket (4 x 5e7 B)", "",
           "| world | zerodp | rank 0 | rank 1 | rank 2 | rank 3 | bound | worst / bound |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["world"], r["mode"] != "main")):
        b = 4 * psi / r["world"] + 4 * BUCKET
        cells = [f"{p / 2**20:.0f}" for p in r["peaks"]] + ["-"] * (4 - len(r["peaks"]))
        label = "main (before)" if r["mode"] == "main" else "this tree"
        out.append(f"| {r['world']} | {label} | {' | '.join(cells)} | {b / 2**20:.0f} | {r['peak'] / b:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="350M")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--modes", nargs="+", default=["meta", "whole", "main", "fsdp2"])
    p.add_argument("--main-src", default="/work/main/src", help="the zerodp source of the 'main' mode")
    p.add_argument("--out", default=None, help="JSON file the rows are added to (kept across runs)")
    args = p.parse_args(argv)
    with torch.device("meta"):
        model = _model(args.model)
    psi = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    rows = json.load(open(args.out)) if args.out and os.path.exists(args.out) else []
    for world in args.worlds:
        for dtype in args.dtypes:
            for mode in args.modes:
                for stage in ([3] if mode == "fsdp2" else args.stages):
                    job = dict(model=args.model, world=world, stage=stage, dtype=dtype, mode=mode)
                    row = run({**job, "main_src": args.main_src})
                    print(json.dumps(row), flush=True)
                    rows = [r for r in rows if {k: r[k] for k in job} != job] + [row]
                    if args.out:
                        json.dump(rows, open(args.out, "w"), indent=1)
    mine = [r for r in rows if r["model"] == args.model]
    print(stack_table(mine, psi) if args.model == "stack" else table(mine, psi, largest))


if __name__ == "__main__":
    sys.exit(main())
