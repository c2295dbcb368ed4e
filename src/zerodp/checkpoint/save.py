"""save_checkpoint: every rank writes the pieces its shards own; rank 0 writes zerodp.json and renames.

Rank 0 is the world's (comm.everyone): with tensor parallelism there is one data-parallel group per tp
rank, and every rank of the world writes into the one directory, so one rank alone prepares, records,
renames and writes the manifest; the agreements are the world's too (errors.agree).

Everything that can be wrong (the tag, a save mid-accumulation, client_state, optimizer state that has
no layout-free form) is found before the first collective, and every rank raises it (errors.agree).
The tensors go through torch.distributed.checkpoint into a temporary directory; rank 0 then records
each file's size and crc32 with the metadata and renames the directory into place (files.py).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from zerodp.checkpoint import files
from zerodp.checkpoint.errors import (
    CheckpointError,
    agree,
    failure_text,
    on_rank0,
    root_oserror,
)
from zerodp.checkpoint.files import FORMAT, LATEST, MANIFEST, TAG
from zerodp.checkpoint.pieces import (
    bucket_params,
    first_non_finite,
    group_states,
    join_tp_shapes,
    local_state,
    signature,
    tp_rank,
    tp_shapes,
    tp_size,
    whole_parameters,
)
from zerodp.checkpoint.files import UNNAMED, engine_run, new_run_id, run_of, set_engine_run
from zerodp.engine.engine import inside


def save_checkpoint(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                    keep_last: int | None = None) -> str:
    """Write `save_dir/{tag}` (default `global_step{N}`) and point `save_dir/latest` at it.

    Collective: call on every rank. client_state (rank 0's is kept) must be JSON-serialisable.
    keep_last=N then removes all but the N newest checkpoints of this engine's run in save_dir (by global
    step; never the new one, never another run's: files.py); None keeps them all. A tag that holds another
    run's checkpoint is refused, not replaced. Returns the tag. A peer that stalls or dies during the save
    raises PeerFailure naming the save, as one in a step names the step.
    """
    with inside(engine).comm.names_peer_failure(f"in engine.save_checkpoint() after step {engine.global_steps}"):
        with _states_in_memory(engine):
            return _save(engine, save_dir, tag, client_state, keep_last)


def _states_in_memory(engine):
    """The masters, optimizer states and parameter shards as tensors for the save (the disk tiers read them in)."""
    training = inside(engine).training
    return training.model_states_in_memory() if training is not None else inside(engine).sharded.shards_in_memory()


def _save(engine, save_dir: str, tag: str | None, client_state: dict | None, keep_last: int | None) -> str:
    comm = inside(engine).comm.everyone  # with tp, the whole world writes one checkpoint
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    save_dir = os.fspath(save_dir)
    err = state = None
    try:
        files.check_keep_last(keep_last)
        manifest = _metadata(engine, tag, client_state)
        state = local_state(engine)
    except CheckpointError as e:
        err, manifest = str(e), None
    except Exception as e:  # noqa: BLE001 - must reach the agreement below, or other ranks hang
        err, manifest = f"save_checkpoint failed: {type(e).__name__}: {e}", None
    rng = _host_rng()
    mine = 0 if state is None else sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    shards = (tp_rank(engine), {} if manifest is None else tp_shapes(manifest["model"]))
    # A fresh engine's first save starts a run: rank 0's new name is every rank's.
    first = agree(comm, err, (mine, tag, os.path.abspath(save_dir), shards, engine_run(engine) or new_run_id()))
    set_engine_run(engine, first[0][4])
    needed = sum(f[0] for f in first)  # the bytes this save writes, for a "no space" message
    _check_same_everywhere([f[1] for f in first], [f[2] for f in first])
    tmp = os.path.join(save_dir, f".tmp.{tag}")
    # The manifest's tp shapes are every tp rank's; then the temp dir, also clearing killed saves' leftovers.
    agree(comm, on_rank0(comm, _prepare, manifest, [f[3] for f in first], save_dir, tmp, first[0][4]))
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp), process_group=comm.group)
        names = sorted(f for f in os.listdir(tmp) if f != MANIFEST)
        mine = {f: files.record(os.path.join(tmp, f)) for i, f in enumerate(names) if i % comm.world_size == comm.rank}
        err = None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own error is a BaseException
        err, mine = _write_error(e, save_dir, tmp, needed), None
    try:
        gathered = agree(comm, err, (mine, rng))  # every rank's files are on disk before rank 0 renames
    except CheckpointError:
        on_rank0(comm, shutil.rmtree, tmp)  # nothing renamed: `latest` and older checkpoints stand
        raise
    if comm.rank == 0:
        if first[0][4] != UNNAMED:  # an unnamed run's checkpoints stay as they were written before runs had names
            manifest["run"] = first[0][4]
        manifest["rng"] = {str(r): g[1] for r, g in enumerate(gathered)}
        manifest["files"] = {f: rec for g in gathered for f, rec in g[0].items()}
    agree(comm, on_rank0(comm, files.finish, save_dir, tmp, tag, manifest, keep_last))
    return tag


def _prepare(manifest: dict, shards: list[tuple[int, dict]], save_dir: str, tmp: str, run: str) -> None:
    join_tp_shapes(manifest["model"], shards)
    existing = files.saved_manifest(os.path.join(save_dir, manifest["tag"]))
    if existing is not None and run_of(existing) != run:  # a re-save replaces its tag: only within one run
        raise CheckpointError(f"'{os.path.join(save_dir, manifest['tag'])}' is a checkpoint of another run "
                              f"({run_of(existing)}; this engine's run is {run}), which this save would replace; "
                              "save under another tag or into another directory")
    files.prepare(save_dir, tmp)


def _check_same_everywhere(tags: list[str], dirs: list[str]) -> None:
    """Every rank sees the same lists, so every rank raises, before anything is written: ranks saving
    under different tags (checkpoint.tag_validation) or into different directories (a folder named
    after each rank's clock) would each write a part of a checkpoint that nobody can read back."""
    if len(set(tags)) > 1:
        raise CheckpointError(f"ranks passed different checkpoint tags to save_checkpoint ({tags}, by rank); "
                              "every rank must save under the same tag")
    if len(set(dirs)) > 1:
        raise CheckpointError(f"ranks passed different save_dir to save_checkpoint ({dirs}, by rank): each would "
                              "write a part of one checkpoint; pass every rank the same directory (a name made "
                              "from the time or the host differs between ranks: make it on rank 0 and broadcast "
                              "it, e.g. with torch.distributed.broadcast_object_list)")


def _write_error(e: BaseException, save_dir: str, tmp: str, needed: int) -> str:
    """The CheckpointError message for a failed write: the path and the cause; ENOSPC in bytes."""
    os_error = root_oserror(e)
    if os_error is not None and os_error.errno == errno.ENOSPC:
        return (f"could not save checkpoint {tmp!r}: no space left on device, {needed} bytes needed at "
                f"{save_dir!r}; the previous checkpoint and 'latest' are unchanged")
    return (f"could not save checkpoint {tmp!r}: {failure_text(e)}; the previous checkpoint and 'latest' "
            "are unchanged")


def _metadata(engine, tag: str, client_state: dict | None) -> dict:
    """Everything but tensors, checked before any file is touched."""
    if not TAG.fullmatch(tag) or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain name: use letters, digits and "
                              "'_.+-', not starting with '.', and not 'latest'")
    if inside(engine).training.pending_micro_steps:  # backward() calls not yet applied by a step()
        raise CheckpointError(
            f"save_checkpoint in the middle of a gradient accumulation (micro step "
            f"{inside(engine).training.micro_steps}, {inside(engine).spec.gas} per step): the pending gradients would be lost; "
            "save right after engine.step() at an accumulation boundary")
    bad = first_non_finite(engine)
    if bad is not None:
        raise CheckpointError(f"refusing to save a checkpoint with non-finite weights: rank {inside(engine).comm.everyone.rank}'s "
                              f"fp32 master of {bad} is not finite; resume from an earlier checkpoint "
                              "(see the non_finite config section for steps that are skipped instead)")
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"client_state must be JSON-serialisable (dicts, lists, strings, numbers, "
                              f"bools, None): {e}") from None
    _check_state_saveable(engine)
    sched = None
    if engine.lr_scheduler is not None:
        sched = engine.lr_scheduler.state_dict()
        dropped = [k for k, v in sched.items() if not _jsonable(v)]
        if dropped:
            warnings.warn(f"lr scheduler state {dropped} is not JSON-serialisable and is not saved; "
                          "it will be rebuilt from the constructor on resume", stacklevel=3)
        sched = {k: v for k, v in sched.items() if k not in dropped}
    scalars = {str(g): {k: v for k, v in s.items() if not torch.is_tensor(v) and _jsonable(v)}
               for g, s in group_states(engine).items()}
    groups = [{k: (v.item() if torch.is_tensor(v) and v.dim() == 0 else v) for k, v in g.items() if k != "params"}
              for g in engine.optimizer.param_groups]
    return {
        "format": FORMAT, "tag": tag, "world_size": inside(engine).comm.world_size, "stage": inside(engine).spec.stage,
        "dtype": str(inside(engine).spec.dtype),
        "counters": {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                     "micro_steps": inside(engine).training.micro_steps},
        "loss_scaler": inside(engine).training.scaler.state_dict(),
        "optimizer": type(engine.optimizer).__name__,
        "lr_scheduler": sched,
        "param_groups": [{k: v for k, v in g.items() if _jsonable(v)} for g in groups],
        "optim_scalars": scalars,
        "client_state": client_state,
        "config": engine.config.model_dump(mode="json"),
        "model": signature(engine),
        "step_counts": inside(engine).training.step_counts(),
        # Only where some group steps whole parameters: a checkpoint of flat shards stays what it was before.
        **({"optimizer_views": [v.value for v in inside(engine).spec.views]}
           if any(inside(engine).spec.whole_parameters(g) for g in range(len(inside(engine).spec.views))) else {}),
        "layout": [{"group": b.group, "numel": b.numel, "partitions": b.partitions,
                    "params": [[p.name, p.start, p.numel] for p in bucket_params(engine, b)]}
                   for b in inside(engine).layout.buckets],
        # Only with tp: a checkpoint without it stays what it was before tp existed (the reader's default 1).
        **({"tp": tp_size(engine)} if tp_size(engine) > 1 else {}),
    }


def _check_state_saveable(engine) -> None:
    """Optimizer state that a checkpoint can hold world-size-independently: per element of a flat shard (or a
    scalar), or, for a parameter stepped whole, any tensor or number."""
    for m in inside(engine).master_shards():
        for key, v in engine.optimizer.state.get(m, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != m.shape:
                raise CheckpointError(f"optimizer state '{key}' has shape {tuple(v.shape)}, neither one value "
                                      f"per parameter element {tuple(m.shape)} nor a scalar: it cannot be "
                                      "saved in a world-size-independent form")
    for name, t in whole_parameters(engine):
        for key, v in engine.optimizer.state.get(t, {}).items():
            if not (torch.is_tensor(v) or isinstance(v, (int, float))):
                raise CheckpointError(f"optimizer state '{key}' of '{name}' is a {type(v).__name__}, neither a tensor "
                                      "nor a number: it cannot be saved in a world-size-independent form")


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _host_rng() -> dict:
    """This rank's python and numpy RNG, as JSON for zerodp.json (torch's goes in the DCP files)."""
    state = {"python": _py_rng_to_json(random.getstate())}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def _py_rng_to_json(s):
    version, internal, gauss = s
    return [version, list(internal), gauss]
