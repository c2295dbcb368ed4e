"""Per-rank peak memory of writing a trained engine's weights: streamed (checkpoint.export_engine,
one bucket at a time) against gathering (engine.full_state_dict() on every rank, then torch.save on
rank 0, the export path before), in the same run, on CPU gloo ranks.

    PYTHONPATH=src python benchmarks/export_memory.py --size 350M --world 2 --stage 3 --consolidate

Per rank it prints resident memory before the export and the peak during it (Linux: VmHWM reset
through /proc/self/clear_refs). glibc is told to map every allocation above 64 KiB on its own, so
freed buffers go back to the system and resident memory follows the live tensors.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from zerodp.engine.engine import inside


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def _peak(fn, together: bool = True) -> tuple[int, int]:
    """(resident bytes before, peak resident bytes while fn runs); `together`: every rank runs it."""
    if together:
        dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    if together:
        dist.barrier()
    return before, _status("VmHWM")


def _consolidations(ckpt: str, out: Path) -> dict[str, tuple[int, int]]:
    """`zerodp consolidate CKPT OUT.safetensors` (streamed) against the whole dict then save_file (before)."""
    from safetensors.torch import save_file

    from zerodp.checkpoint.export import consolidate, write_consolidated

    def whole() -> None:
        state, ties = consolidate(ckpt)
        save_file({k: (v.clone() if k in ties else v).contiguous() for k, v in state.items()}, out / "old.safetensors")

    return {"consolidate streamed": _peak(lambda: write_consolidated(ckpt, str(out / "new.safetensors")), False),
            "consolidate whole": _peak(whole, False)}


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed buffers leave the process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    import zerodp
    from zerodp.checkpoint.export_engine import save_final
    from zerodp.models.gpt import GPT, gpt_config

    torch.manual_seed(0)
    model = GPT(gpt_config(args.size))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": args.stage}}
    engine = zerodp.initialize(model=model, config=config)
    del model
    psi = sum(s.numel for b in inside(engine).training.partitioned_optimizer.buckets for s in b.slots)
    streamed = _peak(lambda: save_final(engine, Path(out), None))
    if rank == 0:
        os.remove(Path(out) / "final.pt")

    def gathered() -> None:
        state = engine.full_state_dict()
        if rank == 0:
            torch.save(state, Path(out) / "final_gathered.pt")

    old = _peak(gathered)
    row = {"rank": rank, "psi": psi, "streamed": streamed, "gathered": old}
    if args.consolidate:
        engine.save_checkpoint(os.path.join(out, "ckpt"))
        if rank == 0:
            row.update(_consolidations(os.path.join(out, "ckpt"), Path(out)))
        dist.barrier()
    with open(Path(out) / f"rank{rank}.json", "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="350M")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--consolidate", action="store_true", help="also zerodp consolidate of a checkpoint (rank 0)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(args.world, os.path.join(out, "store"), args, out), nprocs=args.world,
                           start_method="spawn")
        rows = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(args.world)]
    gib = 2**30
    print(f"GPT {args.size} (Ψ = {rows[0]['psi']:,}), fp32, stage {args.stage}, {args.world} gloo ranks; "
          "per rank: resident before -> peak during the export (extra)")
    for r in rows:
        for path in [k for k in r if k not in ("rank", "psi")]:
            before, peak = r[path]
            print(f"  rank {r['rank']} {path:20s} {before / gib:6.2f} GiB -> {peak / gib:6.2f} GiB "
                  f"(+{(peak - before) / gib:.2f} GiB, {(peak - before) / r['psi']:.2f} B/param)")


if __name__ == "__main__":
    main()
