"""What `--resume` continues, settled once before any rank starts: the checkpoint, and the batch.

`--resume` alone takes OUT/checkpoints' `latest`; when that is corrupt or names a broken checkpoint
(a file missing, of the wrong size, or failing its crc32), the newest intact one of the same run
(zerodp.checkpoint.newest_intact: never another run's, whatever its step), with a warning that names the
bad one and why. `--resume TAG` takes that tag. With no checkpoint at all the job starts from scratch (a restartable
job passes --resume from its first run), with a warning naming the directory searched.

The global batch (ranks x gradient accumulation x micro-batch) is part of what a run is: the data of
each step depends on it (loop.StepBatches). Resumed on another number of ranks, the job keeps it by
adjusting --grad-accum, or stops with the numbers and the --micro-batch values that would fit. A
--grad-accum given explicitly wins, with a warning that the global batch changes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from zerodp.checkpoint import CheckpointError, deepspeed, newest_intact, resolve
from zerodp.checkpoint.files import LATEST
from zerodp.checkpoint.read import current_run
from zerodp.checkpoint.files import new_run_id, run_of
from zerodp.train.folder import claim, run_record
from zerodp.train.options import command_line


def choose_resume(opts: argparse.Namespace, world: int) -> None:
    """Set opts.resume_path (a checkpoint directory, or None) and opts.run (the run's name: the checkpoint's
    run, or a new one), and adjust opts.grad_accum to the checkpoint.

    --resume (this run's checkpoints) comes first; --resume-from DIR is taken when it finds none. A fresh
    run (no --resume) claims its folder first (folder.claim: another run's work there stops it)."""
    opts.resume_path, opts.run = None, new_run_id()
    if not opts.resume:
        claim(opts)
        _choose_resume_from(opts, world)
        return
    ckpt_dir = Path(opts.out) / "checkpoints"
    try:
        if opts.resume is not True:
            path, manifest = resolve(ckpt_dir, opts.resume)
        elif not (ckpt_dir / LATEST).exists() and not _any_checkpoint(ckpt_dir):
            if not opts.resume_from:  # a restartable job's first run, or a mistyped --out: one line says which
                warn(f"--resume: no checkpoint in '{ckpt_dir}': training from scratch")
            _choose_resume_from(opts, world)  # nothing of this run's to continue
            return
        else:
            path, manifest = _latest_or_newest_intact(opts, ckpt_dir)
    except CheckpointError as e:
        raise SystemExit(f"zerodp train: --resume: {e}")
    opts.resume_path, opts.run = path, run_of(manifest)
    keep_global_batch(opts, manifest, world)
    continue_schedule(opts, manifest, path)


def continue_schedule(opts: argparse.Namespace, manifest: dict, path: str) -> None:
    """Stop when the checkpoint has reached --steps already; with another --steps than the saved run's,
    record where the lr schedule must bend (build.job_schedule) so that it goes on without a jump."""
    done = manifest["counters"]["global_steps"]
    if done >= opts.steps:
        note(f"--resume: checkpoint '{path}' is at step {done}, and --steps is {opts.steps}: nothing left to "
             f"train; to train {opts.steps} steps more, resume with: "
             f"{command_line(opts, done + opts.steps, opts.resume)}")
        raise SystemExit(0)
    saved = (manifest.get("client_state") or {}).get("options") or {}
    opts.schedule_from = list(saved.get("schedule_from") or [])
    if "steps" in saved and saved["steps"] != opts.steps and done >= opts.warmup:
        opts.schedule_from.append([done, saved["steps"]])
        note(f"--steps {saved['steps']} -> {opts.steps}: the lr schedule goes on from step {done}'s lr down to "
             f"--min-lr at step {opts.steps}, without a jump")


def _choose_resume_from(opts: argparse.Namespace, world: int) -> None:
    """--resume-from DIR: another run's checkpoint. A zerodp one keeps its global batch as --resume
    does; a DeepSpeed one (checkpoint/deepspeed.py) is checked when the engine loads it."""
    if not opts.resume_from:
        return
    opts.resume_path = opts.resume_from
    try:
        _, manifest = resolve(opts.resume_from)
    except CheckpointError as e:
        if deepspeed.find(opts.resume_from) is None:  # neither kind: one line, before any rank starts
            raise SystemExit(f"zerodp train: --resume-from: {e}")
        return  # a DeepSpeed checkpoint: the engine's load checks it, on every rank
    opts.run = run_of(manifest)  # the run goes on in this folder
    keep_global_batch(opts, manifest, world)
    continue_schedule(opts, manifest, opts.resume_from)


def _latest_or_newest_intact(opts: argparse.Namespace, ckpt_dir: Path) -> tuple[str, dict]:
    try:  # every checksum, once, here: a flipped bit would otherwise fail every restart at the load
        return resolve(ckpt_dir, checksums=True)
    except CheckpointError as bad:
        path, manifest = newest_intact(ckpt_dir, _this_run(opts, ckpt_dir))
        warn(f"{bad}; resuming from the newest intact checkpoint of run {run_of(manifest)}, '{path}' (step "
             f"{manifest['counters']['global_steps']}), instead")
        return path, manifest


def _this_run(opts: argparse.Namespace, ckpt_dir: Path) -> str:
    """The run --resume continues when `latest` is broken: the one `latest` names if its zerodp.json can still
    be read, else the folder's only run, else the run metrics.jsonl names last (the one that ran here)."""
    try:
        return current_run(str(ckpt_dir))
    except CheckpointError:
        record = run_record(Path(opts.out))
        if record is None or "id" not in record:
            raise
        return record["id"]


def _any_checkpoint(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any(not p.name.startswith(".") and p.is_dir() for p in ckpt_dir.iterdir())


def keep_global_batch(opts: argparse.Namespace, manifest: dict, world: int) -> None:
    """Keep the checkpoint's global batch on `world` ranks by setting opts.grad_accum (see module)."""
    saved_opts = (manifest.get("client_state") or {}).get("options") or {}
    if not {"micro_batch", "grad_accum"} <= saved_opts.keys():
        return  # not written by this job: nothing to keep
    saved = (manifest["world_size"], saved_opts["grad_accum"], saved_opts["micro_batch"])
    now = (world, opts.grad_accum, opts.micro_batch)
    if _product(saved) == _product(now):
        return
    if "grad_accum" in opts.explicit:
        warn(f"the global batch changes from {_batch_text(saved)} in the checkpoint to {_batch_text(now)}: "
             "--grad-accum was given; steps from here on see other data than the saved run would have")
        return
    accum, rest = divmod(_product(saved), world * opts.micro_batch)
    if rest == 0:
        note(f"resuming on {world} rank(s): --grad-accum {opts.grad_accum} -> {accum} keeps the "
             f"checkpoint's global batch of {_batch_text(saved)}")
        opts.grad_accum = accum
        return
    fits = [m for m in range(1, _product(saved) + 1) if _product(saved) % (world * m) == 0]
    best = max([m for m in fits if m <= opts.micro_batch] or fits[:1] or [0])
    hint = (f"--micro-batch {', '.join(map(str, fits))} would keep it (resume with: "
            f"{command_line(opts, opts.steps, opts.resume, micro_batch=best)})" if fits else
            f"no --micro-batch keeps it on {world} rank(s); use a number of ranks that divides {_product(saved)}")
    raise SystemExit(f"zerodp train: --resume: the checkpoint's global batch is {_batch_text(saved)}, "
                     f"which {world} rank(s) x --micro-batch {opts.micro_batch} cannot split into whole "
                     f"accumulation steps; {hint}, or pass --grad-accum to change the global batch")


def _product(t: tuple[int, int, int]) -> int:
    return t[0] * t[1] * t[2]


def _batch_text(t: tuple[int, int, int]) -> str:
    return f"{_product(t)} ({t[0]} rank(s) x {t[1]} accumulation x {t[2]} micro-batch)"


def warn(msg: str) -> None:
    note(f"warning: {msg}")


def note(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank plans; one says so
        print(f"zerodp train: {msg}", file=sys.stderr, flush=True)
