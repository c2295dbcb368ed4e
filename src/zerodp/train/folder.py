"""Whose work an --out folder holds: a fresh run never lands in another run's folder by default.

A run's work is its folder's RUN_OUTPUTS: checkpoints/ (each checkpoint names its run, zerodp.checkpoint.files),
metrics.jsonl (its "run" records name it too), report.png, final.pt and hf/. A fresh run (no --resume) into
a folder holding any of them stops before any rank starts, naming the folder, the run there and the three
ways on, each as the whole command: continue that run (--resume), this run in another folder (a new --out),
or this run here with the old one moved aside (--move-aside: the folder renamed, in one step, to the
sibling OUT.moved-YYYYMMDD-HHMMSS, UTC; nothing of either run is replaced, or mixed with the other's).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from zerodp.checkpoint import CheckpointError, resolve
from zerodp.checkpoint.read import current_run
from zerodp.checkpoint.files import run_of
from zerodp.train.options import command_line

RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "report.png", "final.pt", "hf")


def outputs(out: Path) -> list[str]:
    """The RUN_OUTPUTS present in `out` (an empty checkpoints/ or hf/ is none)."""
    found = []
    for name in RUN_OUTPUTS:
        path = out / name
        if path.is_dir() and any(path.iterdir()) or path.is_file():
            found.append(name)
    return found


def claim(opts: argparse.Namespace) -> None:
    """A fresh run's folder: its own (nothing of another run in it), after --move-aside moved the old run's
    away, or a SystemExit naming the run there and the three ways on."""
    out = Path(opts.out)
    found = outputs(out)
    if not found:
        return
    if not opts.move_aside:
        raise SystemExit(refusal(opts, out, found))
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank plans; one moves
        who = describe(out, found)[0]
        moved = move_aside(opts, out)
        print(f"zerodp train: --move-aside: '{out}' (the work of {who}) moved to '{moved}'", flush=True)


def move_aside(opts: argparse.Namespace, out: Path) -> Path:
    """Rename `out` to its sibling OUT.moved-YYYYMMDD-HHMMSS (UTC; -2, -3, ... when taken): one rename, so the
    old run's work is whole in one place or the other. What this run reads must not be inside it."""
    here = Path(os.path.realpath(out))
    reads = {"--data": opts.data, "--config": opts.config, "--ds-config": opts.ds_config,
             "--resume-from": opts.resume_from, "--model": opts.model, "the current directory": "."}
    for flag, path in reads.items():
        real = Path(os.path.realpath(path)) if path and os.path.exists(path) else None
        if real is not None and here in (real, *real.parents):
            raise SystemExit(f"zerodp train: --move-aside would move '{out}', which holds {path!r} "
                             f"({flag}) that this run reads; move that out of it first, or pass another --out")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    moved, n = Path(f"{out}.moved-{stamp}"), 1
    while moved.exists() or moved.is_symlink():
        n += 1
        moved = Path(f"{out}.moved-{stamp}-{n}")
    os.rename(out, moved)
    return moved


def refusal(opts: argparse.Namespace, out: Path, found: list[str]) -> str:
    """Why a fresh run stops: the folder, the run there, and each way on as the whole command."""
    who, done, saved = describe(out, found)
    theirs = argparse.Namespace(flags=saved.get("flags", opts.flags), config=saved.get("config", opts.config),
                                out=opts.out)
    their_steps = saved.get("steps") or opts.steps
    more = their_steps if their_steps > done else done + their_steps
    base, n = os.path.normpath(opts.out), 2
    while Path(f"{base}-{n}").exists():
        n += 1
    settings = "its own settings" if "flags" in saved else "this command's settings"
    return (f"zerodp train: '{out}' holds the work of {who}: {', '.join(found)}; a new run there would replace "
            f"it. Choose one:\n"
            f"  continue that run (with {settings}):\n    {command_line(theirs, more)}\n"
            f"  this new run in another folder:\n    {command_line(opts, opts.steps, False, out=f'{base}-{n}')}\n"
            f"  this new run here, that run's work first moved to '{base}.moved-<UTC time>':\n"
            f"    {command_line(opts, opts.steps, False, move_aside=True)}")


def describe(out: Path, found: list[str]) -> tuple[str, int, dict]:
    """('run ID (MODEL, at step N)', N, its saved options) of the run whose work `out` holds, from its
    latest checkpoint, else its metrics.jsonl; N is 0 when it left no checkpoint."""
    ckpt_dir = out / "checkpoints"
    try:
        run = current_run(str(ckpt_dir))
        _, manifest = resolve(ckpt_dir)
    except CheckpointError:
        run, manifest = None, None
    if manifest is not None and run_of(manifest) == run:
        saved = (manifest.get("client_state") or {}).get("options") or {}
        done = manifest["counters"]["global_steps"]
        of = f" of {saved['steps']}" if "steps" in saved else ""
        return f"run {run} ({saved.get('model', 'a model')}, at step {done}{of})", done, saved
    record = run_record(out)
    if record is not None:
        return f"run {record.get('id', 'unnamed')} ({record.get('model')}, no checkpoint read)", 0, {}
    return "a run whose checkpoints cannot be read", 0, {}


def run_record(out: Path) -> dict | None:
    """The last "run" record of out/metrics.jsonl (a run writes one at each start), or None."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash
    runs = [r for r in records if isinstance(r, dict) and r.get("kind") == "run"]
    return runs[-1] if runs else None
