"""Which run a checkpoint belongs to, and the choices made among one run's checkpoints.

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

import secrets
import time
import weakref
from dataclasses import dataclass

from zerodp.checkpoint.errors import CheckpointError

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
