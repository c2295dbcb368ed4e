"""The engine's own host work per step, with many small parameters.

    python -m zerodp.bench.overhead                       # 50 and 200 layers, worlds 1 and 2, profile
    python -m zerodp.bench.overhead --layers 200 --worlds 2 --profile-stage 3

The model is `--layers` x (Linear(64, 64) + LayerNorm(64)): four parameters of 4,096 / 64 / 64 / 64
elements per layer, so the step's arithmetic is small and what a step costs is mostly per-parameter
host work: hooks, bucket bookkeeping, optimizer calls, collective launches. Each world runs every
mode in the same processes (spawned gloo ranks, one thread each) one after another: plain PyTorch
(fused AdamW; world 1 only), DDP, FSDP2 (fully_shard per layer and the root) and zerodp stages 1-3,
each the median over --steps after --warmup of the step's wall time and of rank 0's process CPU
time (the robust one on a shared machine). Ratios are to DDP of the same world. Running two sizes
shows how each mode's per-step time grows with the number of parameters.

With --profile-stage S (default 2), zerodp stage S at world 1 and the largest size then runs under
cProfile, and the functions with the most own time are printed, grouped by zerodp file: what a fast
GPU would wait for on the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MODES = ("plain", "ddp", "fsdp2", "zerodp1", "zerodp2", "zerodp3")
WIDTH, BATCH = 64, 8


def make_model(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(layers)])


def build(mode: str, layers: int):
    """(forward-backward-step function) for one mode on the current process group."""
    model = make_model(layers)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    if mode.startswith("zerodp"):
        import zerodp
        engine = zerodp.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True), {
            "train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": int(mode[-1])}})

        def zstep():
            engine.backward(engine(x).square().mean())
            engine.step()
        return zstep
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=mode != "fsdp2")  # fused takes no DTensor

    def tstep():
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tstep


def measure(step, steps: int, warmup: int) -> tuple[float, float]:
    """Median (wall ms, CPU ms) of one step, after warmup steps; every rank steps together."""
    for _ in range(warmup):
        step()
    wall, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        w, c = time.perf_counter(), time.process_time()
        step()
        wall.append((time.perf_counter() - w) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def _rank(rank: int, world: int, store: str, out: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        rows = run_modes(world, args)
        if rank == 0:
            torch.save(rows, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_modes(world: int, args) -> list[dict]:
    rows = []
    for layers in args.layers:
        for mode in args.modes:
            if mode == "plain" and world > 1:
                continue
            wall, cpu = measure(build(mode, layers), args.steps, args.warmup)
            rows.append(dict(world=world, layers=layers, params=4 * layers, mode=mode, wall_ms=wall, cpu_ms=cpu))
            if dist.get_rank() == 0 and not args.quiet:  # progress: a full run takes minutes on a CPU
                print(f"  world {world} {layers} layers {mode}: {wall:.1f} ms wall, {cpu:.1f} ms CPU", flush=True)
    return rows


def run_world(world: int, args) -> list[dict]:
    if world == 1:  # in this process: a world of one needs no rendezvous (nor a second start-up)
        import zerodp
        zerodp.init_distributed()
        return run_modes(1, args)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), out, args), nprocs=world, join=True)
        return torch.load(out)


def table(rows: list[dict]) -> str:
    """Markdown: one row per (world, layers, mode), ratios to DDP of the same world and size, and
    the growth of each mode's CPU time from the smallest size to this one."""
    lines = ["| world | layers (params) | mode | wall ms/step | CPU ms/step | CPU vs DDP | CPU growth |",
             "|---|---|---|---|---|---|---|"]
    ddp = {(r["world"], r["layers"]): r["cpu_ms"] for r in rows if r["mode"] == "ddp"}
    smallest = min(r["layers"] for r in rows)
    first = {(r["world"], r["mode"]): r["cpu_ms"] for r in rows if r["layers"] == smallest}
    for r in rows:
        base = ddp.get((r["world"], r["layers"]))
        ratio = f"{r['cpu_ms'] / base:.2f}x" if base else "n/a"
        growth = (f"{r['cpu_ms'] / first[(r['world'], r['mode'])]:.2f}x for {r['layers'] / smallest:g}x params"
                  if r["layers"] != smallest else "")
        lines.append(f"| {r['world']} | {r['layers']} ({r['params']}) | {r['mode']} | {r['wall_ms']:.1f} | "
                     f"{r['cpu_ms']:.1f} | {ratio} | {growth} |")
    return "\n".join(lines)


def profile(stage: int, layers: int, steps: int, top: int) -> str:
    """cProfile of zerodp stage `stage` at world 1: own time by zerodp file, then the top functions."""
    import zerodp
    zerodp.init_distributed()
    step = build(f"zerodp{stage}", layers)
    for _ in range(2):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof)
    by_file: dict[str, float] = {}
    total = 0.0
    for (path, _, _), (_, _, own, _, _) in stats.stats.items():
        total += own
        key = ("zerodp/" + path.split("/zerodp/", 1)[1]) if "/zerodp/" in path else (
            "torch (python)" if "/torch/" in path else "builtins / C calls")
        by_file[key] = by_file.get(key, 0.0) + own
    lines = [f"zerodp stage {stage}, world 1, {layers} layers, {steps} steps: {total / steps * 1e3:.1f} ms "
             "of profiled time per step (cProfile inflates Python calls); own time by file per step:"]
    lines += [f"  {v / steps * 1e3:7.2f} ms  {k}" for k, v in sorted(by_file.items(), key=lambda kv: -kv[1])]
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    body = buf.getvalue()
    lines.append("top functions by own time (all steps):")
    lines += [line for line in body.splitlines()[body.splitlines().index(next(
        x for x in body.splitlines() if "ncalls" in x)):] if line.strip()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[50, 200])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-stage", type=int, default=2, choices=(0, 1, 2, 3),
                   help="zerodp stage to profile at world 1 (0: no profile)")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--quiet", action="store_true", help="no progress lines, only the table and profile")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each spawned rank: one core per rank
    try:
        rows = [r for w in args.worlds for r in run_world(w, args)]
        text = table(rows)
        print(text, flush=True)
        prof = ""
        if args.profile_stage:
            prof = profile(args.profile_stage, max(args.layers), args.profile_steps, args.top)
            print(prof, flush=True)
    finally:
        torch.set_num_threads(threads)
    return {"rows": rows, "table": text, "profile": prof}


if __name__ == "__main__":
    main()
