"""What `--resume` continues, settled once before any rank starts: the checkpoint, and the batch.

`--resume` alone takes OUT/checkpoints' `latest`; when that is corrupt or names a broken checkpoint
(a file missing, of the wrong size, or failing its crc32),
the newest intact one (zerodp.checkpoint.newest_intact), with a warning that names the bad one and
why. `--resume TAG` takes that tag. With no checkpoint at all the job starts from scratch (a restartable
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


def choose_resume(opts: argparse.Namespace, world: int) -> None:
    """Set opts.resume_path (a checkpoint directory, or None) and adjust opts.grad_accum to it.

    --resume (this run's checkpoints) comes first; --resume-from DIR is taken when it finds none."""
    opts.resume_path = None
    if not opts.resume:
        refuse_another_jobs_folder(opts)
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
            path, manifest = _latest_or_newest_intact(ckpt_dir)
    except CheckpointError as e:
        raise SystemExit(f"zerodp train: --resume: {e}")
    opts.resume_path = path
    keep_global_batch(opts, manifest, world)
    continue_schedule(opts, manifest, path)


# What makes a run another job: the default --out names the model, stage and tp; these are the rest a
# fresh run into the same default folder must share with the run whose checkpoints it would replace.
JOB_KEYS = ("model", "data", "stage", "tp", "dtype", "offload", "block_size")


def refuse_another_jobs_folder(opts: argparse.Namespace) -> None:
    """A fresh run (no --resume) into a default --out whose latest checkpoint another job wrote (other
    JOB_KEYS) stops, naming the difference: it would replace that job's checkpoints, metrics and final.pt.
    The same job again replaces them (with the warning of loop.announce); an explicit --out is the user's."""
    if "out" in opts.explicit:
        return
    ckpt_dir = Path(opts.out) / "checkpoints"
    if not (ckpt_dir / LATEST).exists():
        return
    try:
        _, manifest = resolve(ckpt_dir)
    except CheckpointError:
        return  # unreadable: whose it is cannot be told; the warning at start-up still names the folder
    saved = (manifest.get("client_state") or {}).get("options") or {}
    differ = [k for k in JOB_KEYS if k in saved and saved[k] != getattr(opts, k)]
    if differ:
        theirs = ", ".join(f"{k} {saved[k]!r}" for k in differ)
        ours = ", ".join(f"{k} {getattr(opts, k)!r}" for k in differ)
        raise SystemExit(f"zerodp train: '{opts.out}' holds the checkpoints of another job ({theirs}; this one: "
                         f"{ours}), which this run would replace; pass --out DIR for this job, or --resume to "
                         "continue that one with these settings")


def continue_schedule(opts: argparse.Namespace, manifest: dict, path: str) -> None:
    """Stop when the checkpoint has reached --steps already; with another --steps than the saved run's,
    record where the lr schedule must bend (build.job_schedule) so that it goes on without a jump."""
    done = manifest["counters"]["global_steps"]
    if done >= opts.steps:
        note(f"--resume: checkpoint '{path}' is at step {done}, and --steps is {opts.steps}: nothing left to "
             "train; pass a larger --steps to continue it")
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
    keep_global_batch(opts, manifest, world)
    continue_schedule(opts, manifest, opts.resume_from)


def _latest_or_newest_intact(ckpt_dir: Path) -> tuple[str, dict]:
    try:  # every checksum, once, here: a flipped bit would otherwise fail every restart at the load
        return resolve(ckpt_dir, checksums=True)
    except CheckpointError as bad:
        path, manifest = newest_intact(ckpt_dir)
        warn(f"{bad}; resuming from the newest intact checkpoint '{path}' (step "
             f"{manifest['counters']['global_steps']}) instead")
        return path, manifest


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
    hint = (f"--micro-batch {', '.join(map(str, fits))} would keep it" if fits else
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
