"""What the job reports: metrics.jsonl, the progress bar, each rank's memory, and report.png."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zerodp.plan.formulas import activation_estimate
from zerodp.models.gpt import GPTConfig

# Sums of other categories in engine.memory_report(): left out of the stacked bars.
_AGGREGATES = ("model_states", "host_model_states", "device_model_states")


def gather_memory(engine, shape: GPTConfig, opts: argparse.Namespace) -> list[dict[str, int]]:
    """Every rank's memory by disjoint category, in bytes, activations included."""
    report = engine.memory_report()
    parts = {k: int(v) for k, v in report.items()
             if k not in _AGGREGATES and not k.startswith("cuda_") and v}
    if "cuda_peak_allocated" in report:  # measured: the peak beyond what the engine holds
        parts["activations_and_temporaries"] = max(0, report["cuda_peak_allocated"] - sum(parts.values()))
    else:  # no allocator statistics on the CPU: the formula of zerodp.plan.formulas
        # --tp splits each block's activations; the GPT's head is whole on every tp rank (models/gpt.py).
        parts["activations_estimate"] = activation_estimate(shape, opts.micro_batch, shape.block_size,
                                                            opts.dtype, tp=opts.tp, vocab_parallel=False,
                                                            sequence_parallel=opts.sequence_parallel)
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

    # tqdm's default lock holds a multiprocessing semaphore, which a rank that ends with os._exit (a
    # signal, an error) never releases: "resource_tracker: ... leaked semaphore" after a Ctrl-C. One
    # process writes this bar, so a thread lock is all it needs.
    tqdm.set_lock(threading.RLock())
    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                mininterval=0.5 if tty else 15.0)


def bar_text(loss: float, val_loss: float | None, tokens_per_s: float, lr: float, scale: float,
             memory: list[dict[str, int]]) -> str:
    """The progress bar's postfix; the validation loss only once there is one (none before the first
    evaluation, or ever with --eval-every 0)."""
    val = f" val {val_loss:.3f}" if val_loss is not None else ""
    return (f"loss {loss:.3f}{val} {tokens_per_s:,.0f} tok/s lr {lr:.2e} scale {scale:g} "
            f"mem/rank {memory_text(memory)}")


class Metrics:
    """JSON lines in OUT/metrics.jsonl, written by rank 0. A resumed run first drops the lines
    after its checkpoint's step, which the run that crashed had logged but not kept."""

    def __init__(self, path: Path, rank: int, keep_until: int):
        self.path, self.rank = path, rank
        self.last_val_loss: float | None = None  # rank 0: the newest "eval" record's, a resumed run's included
        if rank != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [line for line in _read_lines(path) if line["step"] <= keep_until] if keep_until else []
        path.write_text("".join(json.dumps(line) + "\n" for line in kept))
        for line in kept:
            self._remember(line)

    def write(self, **record: Any) -> None:
        if self.rank == 0:
            record["time"] = time.time()
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self._remember(record)

    def _remember(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "eval":
            self.last_val_loss = record["val_loss"]


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_report(out: Path) -> Path:
    """OUT/report.png: titled with the model, stage, dtype and ranks; loss, memory per rank by category,
    throughput, lr and gradient norm; dashed lines mark the steps a resumed run started from."""
    fig = report_figure(_read_lines(out / "metrics.jsonl"))
    path = out / "report.png"
    fig.savefig(path, dpi=110)  # a PNG is drawn by Agg whatever the process's backend
    return path


def report_figure(lines: list[dict[str, Any]]):
    """The report's matplotlib figure, from metrics.jsonl's records: titled with the run (the "run"
    records: model, stage, dtype, ranks), one panel per series that has points, none left empty."""
    # A bare Figure, not pyplot's: no GUI backend or pyplot state is needed to draw a file, and pyplot's
    # import alone costs the job's last step most of a second of CPU.
    from matplotlib.figure import Figure

    train = [r for r in lines if r["kind"] == "train"]
    memory = [r for r in lines if r["kind"] == "memory"]
    panels = [lambda ax: _loss_panel(ax, train, [r for r in lines if r["kind"] == "eval"])]
    panels += [lambda ax: _memory_panel(ax, memory)] if memory else []
    for key, ylabel, title in (("tokens_per_s", "tokens / s", "throughput (whole job)"),
                               ("lr", "learning rate", "learning rate"),
                               ("grad_norm", "global gradient norm (before clipping)", "gradient norm")):
        if any(r.get(key) is not None for r in train):
            panels.append(lambda ax, k=key, y=ylabel, t=title: _series(ax, train, k, y, t))
    fig = Figure(figsize=(18, 4.5 * -(-len(panels) // 3)))
    resumes = [r["step"] for r in lines if r["kind"] == "resume"]
    for ax, draw in zip(_grid(fig, len(panels)), panels):
        draw(ax)
        if ax.get_xlabel() == "step":  # the series over steps: where a resumed run picked up
            for i, step in enumerate(resumes):
                ax.axvline(step, color="grey", ls="--", lw=1, label="resumed" if i == 0 else None)
            if resumes:
                ax.legend(fontsize="small")
    fig.suptitle(run_title(lines), fontsize="x-large")
    fig.tight_layout()
    return fig


def _grid(fig, n: int) -> list:
    """n axes, three to a row; a shorter last row's panels share its width (no empty slot)."""
    rows = -(-n // 3)
    spec = fig.add_gridspec(rows, 6)
    axes = []
    for row in range(rows):
        k = min(3, n - 3 * row)
        axes += [fig.add_subplot(spec[row, i * 6 // k:(i + 1) * 6 // k]) for i in range(k)]
    return axes


def run_title(lines: list[dict[str, Any]]) -> str:
    """'MODEL, ZeRO stage S, DTYPE, N rank(s)' of the job's first run; a resumed run that differs adds
    'from step K: ...' with what changed."""
    runs = [r for r in lines if r["kind"] == "run"]
    if not runs:
        return "zerodp train (no run record in metrics.jsonl)"
    title = _run_facts(runs[0])
    for before, run in zip(runs, runs[1:]):
        changed = [f for f, old in zip(_run_facts(run).split(", "), _run_facts(before).split(", ")) if f != old]
        if changed:
            title += f"; from step {run['step']}: {', '.join(changed)}"
    return title


def _run_facts(run: dict[str, Any]) -> str:
    tp = f" (tp {run['tp']})" if run.get("tp", 1) > 1 else ""
    return f"{run['model']}, ZeRO stage {run['stage']}, {run['dtype']}, {run['ranks']} rank(s){tp}"


def _loss_panel(ax, train: list[dict], val: list[dict]) -> None:
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy loss", title="loss")
    ax.grid(alpha=0.3)
    ax.legend()


def _series(ax, train: list[dict], key: str, ylabel: str, title: str) -> None:
    points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
    ax.plot([s for s, _ in points], [v for _, v in points], lw=1)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)


def _memory_panel(ax, memory: list[dict]) -> None:
    ranks = memory[-1]["ranks"]
    categories = list(dict.fromkeys(k for r in ranks for k in r))
    bottom = [0.0] * len(ranks)
    for cat in categories:
        mib = [r.get(cat, 0) / 2**20 for r in ranks]
        ax.bar(range(len(ranks)), mib, bottom=bottom, label=cat)
        bottom = [b + m for b, m in zip(bottom, mib)]
    ax.set_xticks(range(len(ranks)), [f"rank {i}" for i in range(len(ranks))])
    ax.set(ylabel="MiB", title=f"memory per rank (step {memory[-1]['step']})")
    ax.legend(fontsize="small", loc="upper left")
