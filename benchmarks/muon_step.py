"""Muon + AdamW on the `small` GPT (6 blocks, 4.9M parameters, 24 hidden matrices of 4.7M elements), with
the matrices stepped whole by the rank that owns each (issue 33), beside element-wise AdamW on flat shards
and beside every rank orthogonalising every matrix (stage 0: each rank steps the whole model, as plain
data parallelism, or Moonlight's "gather, orthogonalise on every rank", would).

    python benchmarks/muon_step.py [--worlds 2 4] [--steps 8]

Spawned gloo ranks, one thread each, micro-batch 2 x 32 tokens, fp32. Per mode and world: the median
over the timed steps of the whole step (forward, backward, step) and of engine.step() alone (reduce wait,
norm, optimizer, gather), on rank 0; and each rank's fp32 master + optimizer state bytes, the largest
beside 1/N of all ranks' (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = {"adamw_stage2": ("AdamW", 2), "muon_stage2": ("Muon", 2), "muon_every_rank": ("Muon", 0)}


def _engine(optimizer: str, stage: int):
    import zerodp
    from zerodp.models.gpt import GPT, gpt_config
    torch.manual_seed(0)
    model = GPT(gpt_config("small"))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000},
              "optimizer": {"type": optimizer, "params": {"lr": 1e-3}}}
    return zerodp.initialize(model, None, config)


def _run(rank: int, world: int, store: str, out: str, steps: int, warmup: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    g = torch.Generator().manual_seed(rank)
    rows = {}
    for mode, (optimizer, stage) in MODES.items():
        engine = _engine(optimizer, stage)
        whole, stepped = [], []
        for i in range(warmup + steps):
            tokens = torch.randint(0, 256, (2, 33), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            t1 = time.perf_counter()
            engine.step()
            t2 = time.perf_counter()
            if i >= warmup:
                whole.append(t2 - t0)
                stepped.append(t2 - t1)
        rep = engine.memory_report()
        state = torch.tensor([rep["fp32_master"] + rep["optimizer_states"]], dtype=torch.float64)
        all_states = [torch.zeros_like(state) for _ in range(world)]
        dist.all_gather(all_states, state)
        rows[mode] = {"step_ms": 1e3 * statistics.median(whole), "engine_step_ms": 1e3 * statistics.median(stepped),
                      "state_bytes": [int(s) for s in all_states]}
        del engine
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    print("| world | mode | step ms | engine.step() ms | state bytes, largest rank | 1/N of all ranks' | excess |")
    print("|---|---|---|---|---|---|---|")
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.pt")
            mp.start_processes(_run, args=(world, os.path.join(tmp, "store"), out, args.steps, args.warmup),
                               nprocs=world, join=True, start_method="spawn")
            rows = torch.load(out)
        for mode, r in rows.items():
            worst, fair = max(r["state_bytes"]), sum(r["state_bytes"]) / world
            print(f"| {world} | {mode} | {r['step_ms']:.0f} | {r['engine_step_ms']:.0f} | {worst / 2**20:.2f} MiB | "
                  f"{fair / 2**20:.2f} MiB | {100 * (worst / fair - 1):+.0f}% |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
