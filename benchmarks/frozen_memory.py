"""Per-rank peak host memory (RSS) of setting up a LoRA fine-tune of a frozen stack at stage 3 (issue 32):
24 frozen Linear(2048, 2048) (100.7M elements), each with a rank-8 LoRA branch (0.8M trained), built on
meta, zerodp.initialize at stage 3 in fp32 with AdamW on the adapters. Two modes, each configuration in
fresh processes, one at a time:

  meta   this tree's zerodp: stage 3 partitions the frozen weights too (1/N of them per rank)
  main   the zerodp of --main-src (before: every rank materialises every frozen weight whole)

    PYTHONPATH=src python benchmarks/frozen_memory.py --worlds 2 4 --modes meta main \\
        --out benchmarks/results/frozen_memory.json

Peak = VmHWM - VmRSS once torch, zerodp and the process group are up (setup_memory.measure). Beside it, the
engine's own count of the frozen bytes each rank holds (memory_report: frozen_params, the sharded ones, and
frozen_params_and_buffers, the whole ones) and the bound: the frozen fp32 shard (4 Ψ_frozen / N) plus the
adapters' states (16 B each, / N) plus the fp32 staging of one bucket's shard and one layer's initialisers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from setup_memory import BUCKET, measure, run  # noqa: E402  (a sibling script)

WIDTH, LAYERS, RANK = 2048, 24, 8
MiB = 2 ** 20


class LoRALinear(nn.Module):
    """A frozen Linear plus a trained low-rank branch b(a(x)), as PEFT's LoRA layer computes it."""

    def __init__(self, width: int, rank: int):
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.a = nn.Linear(width, rank, bias=False)
        self.b = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def _model() -> nn.Module:
    return nn.Sequential(*[LoRALinear(WIDTH, RANK) for _ in range(LAYERS)])


def _rank(rank: int, world: int, store_path: str, out_dir: str, job: dict) -> None:
    torch.set_num_threads(1)
    if job["mode"] == "main":
        sys.path.insert(0, job["main_src"])
    import zerodp.engine.engine  # imported before the baseline
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    engines = []

    def set_up() -> None:
        import zerodp
        torch.manual_seed(0)
        with torch.device("meta"):
            model = _model()
        trained = [p for p in model.parameters() if p.requires_grad]
        engines.append(zerodp.initialize(model, torch.optim.AdamW(trained, lr=1e-4),
                                         {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    measure(set_up, out_dir, rank)
    report = engines[0].memory_report()
    with open(os.path.join(job["reports"], f"{rank}.json"), "w") as f:
        json.dump({k: report.get(k, 0) for k in ("frozen_params", "frozen_params_and_buffers", "working_params")}, f)
    dist.barrier()
    dist.destroy_process_group()
    assert job["mode"] != "main" or zerodp.engine.engine.__file__.startswith(job["main_src"])


def table(rows: list[dict]) -> str:
    with torch.device("meta"):
        model = _model()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    unit = WIDTH * WIDTH + WIDTH + 2 * RANK * WIDTH  # one module's initialiser stand-ins, fp32
    out = [f"{LAYERS} x (frozen Linear({WIDTH}, {WIDTH}) + rank-{RANK} LoRA) on meta (frozen {frozen / 1e6:.1f}M, "
           f"trained {trained / 1e6:.2f}M), stage 3, fp32; per-rank peak RSS above the baseline, MiB; frozen held: "
           "the engine's frozen bytes (memory_report); bound = 4 Ψ_frozen / N + 16 Ψ_trained / N + the fp32 "
           "staging of one bucket's shard (4 x 5e7 / N) + one layer's initialiser stand-ins (fp32)", "",
           "| world | zerodp | rank 0 | rank 1 | rank 2 | rank 3 | frozen held per rank | bound | worst / bound |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["world"], r["mode"] != "main")):
        b = 4 * frozen / r["world"] + 16 * trained / r["world"] + 4 * BUCKET / r["world"] + 4 * unit
        cells = [f"{p / MiB:.0f}" for p in r["peaks"]] + ["-"] * (4 - len(r["peaks"]))
        label = "main (before)" if r["mode"] == "main" else "this tree"
        out.append(f"| {r['world']} | {label} | {' | '.join(cells)} | {r['frozen_held'] / MiB:.0f} | {b / MiB:.0f} | "
                   f"{r['peak'] / b:.2f} |")
    return "\n".join(out)


def run_with_reports(job: dict) -> dict:
    """setup_memory.run, plus the largest frozen bytes a rank holds by its memory_report."""
    with tempfile.TemporaryDirectory() as reports:
        row = run({**job, "reports": reports}, _rank)
        held = [json.load(open(os.path.join(reports, f"{r}.json"))) for r in range(job["world"])]
    row.pop("reports")
    row["frozen_held"] = max(r["frozen_params"] + r["frozen_params_and_buffers"] for r in held)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["meta", "main"])
    p.add_argument("--main-src", default="/work/main/src", help="the zerodp source of the 'main' mode")
    p.add_argument("--out", default=None, help="JSON file the rows are written to")
    p.add_argument("--table", action="store_true", help="print the table of --out's rows, run nothing")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.load(open(args.out))))
        return
    rows = []
    for world in args.worlds:
        for mode in args.modes:
            row = run_with_reports(dict(world=world, mode=mode, main_src=args.main_src))
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out:
                json.dump(rows, open(args.out, "w"), indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
