"""A checkpoint directory on disk: its names, and writing it so that a crash loses nothing.

Everything is written into `save_dir/.tmp.{tag}` and renamed into place by rank 0 after every rank
has finished; `latest` is replaced atomically after that. Re-saving a tag moves the old directory
aside as `.old.{tag}` first, which `read.resolve` falls back on if a crash comes between the renames.
Every file's size and crc32 (`record`) go into `zerodp.json`, so that a truncated or changed file is
found on load.

Housekeeping, on rank 0 only and never while a save is writing: `prepare` removes the `.tmp.*`
directories of killed saves (and `.old.*` copies whose re-save completed) before a save writes;
`prune` keeps the saving run's newest `keep_last` checkpoints (by global step, from zerodp.json) after a
save has committed, never the one `latest` names, never another run's (below), never a directory that is
not a zerodp checkpoint.

Runs. Which run a checkpoint belongs to, and the choices made among one run's checkpoints.

A run is one training from its first step, continued by every resume. Its identity is a name made when it
starts (`new_run_id`: the UTC time and 6 random hex digits, e.g. 20261129-011606-3fa2c1), written into
each of its checkpoints' zerodp.json as `run`. A fresh engine's first save starts a run; an engine that
loaded a checkpoint (not module_only) continues that checkpoint's run; `zerodp train` names its run itself
(`set_engine_run`). A checkpoint saved before runs had names has no `run`: it belongs to the run UNNAMED,
and so do the checkpoints of a run resumed from one (they are written without `run` too, so that such a
checkpoint saved again is what it was): the unnamed checkpoints of one folder are one run, as every
checkpoint of a folder was before.

What a folder's checkpoints are chosen by, here as functions of their list (`Saved`, one per checkpoint
directory; files.scan makes it): `keep_last` removes only the current run's, beyond its newest N
(`doomed`); the corrupt-checkpoint fallback takes only the current run's (`newest_first`); a folder whose
`latest` cannot tell the current run falls back to its only run, and refuses a choice among several
(`only_run`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
import weakref
import zlib
from dataclasses import dataclass

from zerodp.checkpoint.errors import CheckpointError
from zerodp.checkpoint.manifest import FORMAT, validate  # noqa: F401 - FORMAT is named here with the other file names

MANIFEST = "zerodp.json"
LATEST = "latest"
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")

UNNAMED = "unnamed"  # the run of a checkpoint saved before runs had names

# The run each live engine's saves belong to (absent: none yet; its first save starts one). Kept here, beside
# the engine rather than in it: a run is a fact of its checkpoints, and zerodp.checkpoint owns those.
_ENGINE_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Saved:
    """One checkpoint directory of a folder, as its zerodp.json describes it."""
    name: str  # the tag: the directory's name
    step: int  # counters.global_steps
    mtime: float  # of its zerodp.json: orders two checkpoints of one step
    run: str  # run_of(its zerodp.json)


def new_run_id() -> str:
    """A fresh run's name: when it started (UTC) and 6 random hex digits, e.g. 20261129-011606-3fa2c1."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def run_of(manifest: dict) -> str:
    """The run a checkpoint's zerodp.json names; UNNAMED for one saved before runs had names."""
    return manifest.get("run") or UNNAMED


def engine_run(engine) -> str | None:
    """The run this engine's saves belong to; None before its first save or load."""
    return _ENGINE_RUNS.get(engine)


def set_engine_run(engine, run: str) -> None:
    """From now on this engine's saves belong to `run` (the same name on every rank)."""
    _ENGINE_RUNS[engine] = run


def newest_first(saved: list[Saved], run: str) -> list[Saved]:
    """`run`'s checkpoints, newest (by global step, then time) first; no other run's."""
    return sorted((s for s in saved if s.run == run), key=lambda s: (s.step, s.mtime), reverse=True)


def doomed(saved: list[Saved], keep_last: int, latest: str, run: str) -> list[str]:
    """What keep_last removes: `run`'s checkpoints beyond its `keep_last` newest, never `latest`, never
    another run's (whatever their steps: a finished run's step 110 is not newer than this run's step 4)."""
    return [s.name for s in newest_first(saved, run)[keep_last:] if s.name != latest]


def only_run(saved: list[Saved], where: str) -> str:
    """The run of a folder's checkpoints when `latest` cannot say: the only one there; with several, a
    CheckpointError naming them (which to resume is then the user's choice: a tag)."""
    runs = sorted({s.run for s in saved})
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise CheckpointError(f"no checkpoint in '{where}'")
    listed = "; ".join(f"run {r}: {', '.join(s.name for s in newest_first(saved, r))}" for r in runs)
    raise CheckpointError(f"'{where}' holds the checkpoints of {len(runs)} runs and its 'latest' does not say "
                          f"which is the current one ({listed}); pick one by its tag")



def prepare(save_dir: str, tmp: str) -> None:
    """Clear what killed saves left in save_dir, then make the fresh temp dir `tmp`."""
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else ():
        path = os.path.join(save_dir, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        if name.startswith(".tmp."):  # a save killed before its rename: never a checkpoint
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(".old.") and os.path.isfile(os.path.join(save_dir, name[len(".old."):], MANIFEST)):
            shutil.rmtree(path, ignore_errors=True)  # its re-save completed; else resolve still needs it
    os.makedirs(tmp)


def finish(save_dir: str, tmp: str, tag: str, manifest: dict, keep_last: int | None = None) -> None:
    """Write zerodp.json last, so a temp dir without it is an unfinished save; commit; prune."""
    path = os.path.join(tmp, MANIFEST)
    text = json.dumps(manifest, indent=1)
    validate(text, path)  # the reader's own check: never write what a load would refuse
    write_atomic(path, text)
    commit(save_dir, tmp, tag)
    if keep_last is not None:
        prune(save_dir, keep_last, tag, run_of(manifest))


def prune(save_dir: str, keep_last: int, latest: str, run: str) -> list[str]:
    """Remove run `run`'s checkpoints of save_dir beyond its newest `keep_last` (by global step, then time),
    never `latest`; returns the removed tags. Other runs' checkpoints and directories that are not zerodp
    checkpoints stay."""
    gone = doomed(scan(save_dir), keep_last, latest, run)
    for name in gone:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    return gone


def scan(save_dir: str) -> list[Saved]:
    """Every checkpoint directory of save_dir whose zerodp.json is valid (its files unchecked), with its
    step and run; what keep_last and the fallback choose among."""
    found = []
    for name in sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else ():
        path = os.path.join(save_dir, name)
        if name.startswith(".") or os.path.islink(path) or not os.path.isdir(path):
            continue
        manifest = saved_manifest(path)
        if manifest is not None:
            found.append(Saved(name, manifest["counters"]["global_steps"],
                               os.path.getmtime(os.path.join(path, MANIFEST)), run_of(manifest)))
    return found


def check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r}: expected a positive integer (how many checkpoints "
                              "to keep) or None to keep them all")


def saved_manifest(path: str) -> dict | None:
    """The zerodp.json of checkpoint directory `path`, or None if it is not a valid zerodp checkpoint."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            return validate(f.read(), path)
    except (OSError, ValueError):  # CheckpointError is a ValueError
        return None


def inside(root: str, name: str) -> str | None:
    """The real path of `root/name` if it lies inside root, else None: an absolute name, a `..`
    or a symlink that leads out of the checkpoint directory is never followed."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, name))
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        return None
    return real


def commit(save_dir: str, tmp: str, tag: str) -> None:
    """Rename the finished temp dir into place, then point `latest` at it."""
    final = os.path.join(save_dir, tag)
    old = os.path.join(save_dir, f".old.{tag}")
    if os.path.exists(final):  # re-saving a tag: the old one is moved aside, then dropped
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    write_atomic(os.path.join(save_dir, LATEST), tag)
    shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def record(path: str) -> dict:
    """{"size", "crc32"} of a written file, as zerodp.json keeps it."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": crc}
