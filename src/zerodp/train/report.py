"""What the job reports: metrics.jsonl, the progress bar, each rank's memory, and report.png."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zerodp.memory import activation_estimate

from .model import GPTConfig

# Sums of other categories in engine.memory_report(): left out of the stacked bars.
_AGGREGATES = ("model_states", "host_model_states", "device_model_states")


def gather_memory(engine, shape: GPTConfig, opts: argparse.Namespace) -> list[dict[str, int]]:
    """Every rank's memory by disjoint category, in bytes, activations included."""
    report = engine.memory_report()
    parts = {k: int(v) for k, v in report.items()
             if k not in _AGGREGATES and not k.startswith("cuda_") and v}
    if "cuda_peak_allocated" in report:  # measured: the peak beyond what the engine holds
        parts["activations_and_temporaries"] = max(0, report["cuda_peak_allocated"] - sum(parts.values()))
    else:  # no allocator statistics on the CPU: the formula of zerodp.memory
        parts["activations_estimate"] = activation_estimate(shape, opts.micro_batch, shape.block_size,
                                                            opts.dtype)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, parts)
    return gathered


def memory_text(memory: list[dict[str, int]]) -> str:
    """Each rank's total, e.g. '61/61 MiB'."""
    return "/".join(f"{sum(r.values()) / 2**20:.0f}" for r in memory) + " MiB"


def progress_bar(rank: int, start: int, total: int):
    if rank != 0:
        return None
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                mininterval=0.5 if tty else 15.0)


class Metrics:
    """JSON lines in OUT/metrics.jsonl, written by rank 0. A resumed run first drops the lines
    after its checkpoint's step, which the run that crashed had logged but not kept."""

    def __init__(self, path: Path, rank: int, keep_until: int):
        self.path, self.rank = path, rank
        if rank != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [line for line in _read_lines(path) if line["step"] <= keep_until] if keep_until else []
        path.write_text("".join(json.dumps(line) + "\n" for line in kept))

    def write(self, **record: Any) -> None:
        if self.rank == 0:
            record["time"] = time.time()
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_report(out: Path) -> Path:
    """OUT/report.png: the loss curves and each rank's memory by category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = _read_lines(out / "metrics.jsonl")
    train = [r for r in lines if r["kind"] == "train"]
    val = [r for r in lines if r["kind"] == "eval"]
    memory = [r for r in lines if r["kind"] == "memory"]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.8))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="cross-entropy loss", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if memory:
        ranks = memory[-1]["ranks"]
        categories = list(dict.fromkeys(k for r in ranks for k in r))
        bottom = [0.0] * len(ranks)
        for cat in categories:
            mib = [r.get(cat, 0) / 2**20 for r in ranks]
            ax_mem.bar(range(len(ranks)), mib, bottom=bottom, label=cat)
            bottom = [b + m for b, m in zip(bottom, mib)]
        ax_mem.set_xticks(range(len(ranks)), [f"rank {i}" for i in range(len(ranks))])
        ax_mem.set(ylabel="MiB", title=f"memory per rank (step {memory[-1]['step']})")
        ax_mem.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax_mem.text(0.5, 0.5, "no memory report", ha="center", va="center")
        ax_mem.set_axis_off()
    fig.tight_layout()
    path = out / "report.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
