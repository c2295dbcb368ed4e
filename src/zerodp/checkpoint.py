"""Sharded checkpoints (torch.distributed.checkpoint) that resume on any world size and stage,
and their consolidation into one full fp32 state dict.

A checkpoint is a directory `save_dir/{tag}` holding:
  - DCP files with tensors only, in a layout-free form: every trained parameter's fp32 master and
    optimizer state are stored as 1-D pieces of the flattened parameter, `master/{name}@{start}`
    and `optim/{key}/{name}@{start}`, each rank writing the pieces its shards own (rank 0 alone in
    stage 0, where every rank owns everything). Frozen parameters and buffers (`model/{name}`),
    0-dim optimizer state per param group (`optim_scalar/{group}/{key}`) and each rank's torch RNG
    (`rng/{rank}/torch`) complete them.
  - `zerodp.json`, written by rank 0: counters, loss scaler, lr scheduler, param group
    hyperparameters, client_state, config, the model signature (names, shapes, tied aliases), the
    saved layout, the python/numpy RNG of every rank and the size + crc32 of every file.
`save_dir/latest` names the newest tag. Working-precision parameters are not stored: on load they
are the masters cast to the working dtype, exactly what a step would have left. save_dir must be a
filesystem every rank sees (DCP's rule): rank 0 renames what all ranks wrote.

Why pieces rather than buckets: the bucket layout (and its padding) depends on the world size and
the bucket size. On load each rank works out which elements of which parameter its shards now own
and reads exactly the saved pieces that overlap them.

Crash safety: everything is written into `save_dir/.tmp.{tag}` and renamed into place by rank 0
after every rank has finished; `latest` is replaced atomically after that.
No unrestricted unpickling on load: the DCP `.metadata` file (a pickle) is read with an unpickler
that admits only DCP's own metadata classes; tensors are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

FORMAT = 1
META = "zerodp.json"
LATEST = "latest"
# Pieces read per dcp.load call while resuming: bounds the host memory a load needs at once.
LOAD_CHUNK_NUMEL = 1 << 28
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; raised on every rank, before any change."""


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + numel) of parameter `name`, held at `offset` in master `master`."""

    name: str
    start: int
    master: int
    offset: int
    numel: int


# ---- the layout-free view of an engine ---------------------------------------------------------
def _owned_pieces(engine) -> list[Piece]:
    """The parameter pieces this rank's master shards hold (every piece of the model in stage 0)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    part, pieces = engine.partitioned, []
    for i, b in enumerate(part.buckets):
        lo_r = part.rank * b.shard_numel
        hi_r = lo_r + b.shard_numel
        for s in b.slots:
            lo, hi = max(s.offset, lo_r), min(s.offset + s.numel, hi_r)
            if lo < hi:
                pieces.append(Piece(names[id(s.param)], lo - s.offset, i, lo - lo_r, hi - lo))
    return pieces


def _signature(engine) -> list[dict]:
    """Every state_dict entry: trained parameter, frozen parameter or buffer, with tied aliases."""
    trained = {id(s.param): b.group for b in engine.partitioned.buckets for s in b.slots}
    params = {id(p) for p in engine.module.parameters()}
    first: dict[int, str] = {}
    out = []
    for name, t in engine.module.state_dict(keep_vars=True).items():
        kind = "trained" if id(t) in trained else "frozen" if id(t) in params else "buffer"
        out.append({"name": name, "kind": kind, "shape": list(t.shape), "dtype": str(t.dtype),
                    "alias_of": first.get(id(t)), "group": trained.get(id(t))})
        first.setdefault(id(t), name)
    return out


def _untrained(engine) -> dict[str, torch.Tensor]:
    """Frozen parameters and persistent buffers, by their first name."""
    return {e["name"]: t for e, t in zip(_signature(engine), engine.module.state_dict(keep_vars=True).values())
            if e["kind"] != "trained" and e["alias_of"] is None}


def local_state(engine) -> dict[str, torch.Tensor]:
    """The DCP tensors this rank writes (CPU copies): its master/optimizer pieces and, on rank 0,
    the replicated tensors. Also what tests compare: the union over ranks is layout-free."""
    comm, part = engine.comm, engine.partitioned
    writes_replicated = comm.rank == 0
    out: dict[str, torch.Tensor] = {}
    if engine.stage > 0 or writes_replicated:
        for pc in _owned_pieces(engine):
            m = part.masters[pc.master]
            out[f"master/{pc.name}@{pc.start}"] = _cpu(m.detach()[pc.offset:pc.offset + pc.numel])
            for key, v in engine.optimizer.state.get(m, {}).items():
                if torch.is_tensor(v) and v.shape == m.shape:
                    out[f"optim/{key}/{pc.name}@{pc.start}"] = _cpu(v.detach()[pc.offset:pc.offset + pc.numel])
    if writes_replicated:
        for g, state in _group_states(engine).items():
            for key, v in state.items():
                if torch.is_tensor(v) and v.dim() == 0:
                    out[f"optim_scalar/{g}/{key}"] = _cpu(v.detach())
        for name, t in _untrained(engine).items():
            out[f"model/{name}"] = _cpu(t.detach())
    out[f"rng/{comm.rank}/torch"] = torch.get_rng_state()
    if engine.device.type == "cuda":
        out[f"rng/{comm.rank}/cuda"] = torch.cuda.get_rng_state(engine.device)
    return out


def _group_states(engine) -> dict[int, dict]:
    """The optimizer state of the first master of each param group (its per-group scalars)."""
    out: dict[int, dict] = {}
    for b, m in zip(engine.partitioned.buckets, engine.partitioned.masters):
        if b.group not in out and m in engine.optimizer.state:
            out[b.group] = engine.optimizer.state[m]
    return out


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True).contiguous()


# ---- save ---------------------------------------------------------------------------------------
def save_checkpoint(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
    """Write `save_dir/{tag}` (default `global_step{N}`) and point `save_dir/latest` at it.

    Collective: call on every rank. client_state (rank 0's is kept) must be JSON-serialisable.
    Returns the tag.
    """
    comm = engine.comm
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    save_dir = os.fspath(save_dir)
    err = None
    try:
        meta = _metadata(engine, tag, client_state)
    except CheckpointError as e:
        err, meta = str(e), None
    except Exception as e:  # noqa: BLE001 - must reach the agreement below, or other ranks hang
        err, meta = f"save_checkpoint failed: {type(e).__name__}: {e}", None
    rng = _host_rng()
    _agree(comm, err)
    tmp = os.path.join(save_dir, f".tmp.{tag}")
    _agree(comm, _on_rank0(comm, _fresh_dir, tmp))
    dcp.save(local_state(engine), storage_writer=FileSystemWriter(tmp), process_group=comm.group)
    if comm.world_size > 1:
        dist.barrier(group=comm.group)
    files = sorted(f for f in os.listdir(tmp) if f != META)
    mine = {f: _file_record(os.path.join(tmp, f)) for i, f in enumerate(files) if i % comm.world_size == comm.rank}
    gathered = _agree(comm, None, (mine, rng))
    if comm.rank == 0:
        meta["rng"] = {str(r): g[1] for r, g in enumerate(gathered)}
        meta["files"] = {f: rec for g in gathered for f, rec in g[0].items()}
    _agree(comm, _on_rank0(comm, _finish, save_dir, tmp, tag, meta))
    return tag


def _metadata(engine, tag: str, client_state: dict | None) -> dict:
    """Everything but tensors, checked before any file is touched."""
    if not _TAG.fullmatch(tag) or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain name: use letters, digits and "
                              "'_.+-', not starting with '.', and not 'latest'")
    if engine.micro_steps % engine.gas != 0 or engine.micro_steps != engine._stepped_at:
        if engine.micro_steps != 0:
            raise CheckpointError(
                f"save_checkpoint in the middle of a gradient accumulation (micro step "
                f"{engine.micro_steps}, {engine.gas} per step): the pending gradients would be lost; "
                "save right after engine.step() at an accumulation boundary")
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"client_state must be JSON-serialisable (dicts, lists, strings, numbers, "
                              f"bools, None): {e}") from None
    for b, m in zip(engine.partitioned.buckets, engine.partitioned.masters):
        for key, v in engine.optimizer.state.get(m, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != m.shape:
                raise CheckpointError(f"optimizer state '{key}' has shape {tuple(v.shape)}, neither one value "
                                      f"per parameter element {tuple(m.shape)} nor a scalar: it cannot be "
                                      "saved in a world-size-independent form")
    sched = None
    if engine.lr_scheduler is not None:
        sched = engine.lr_scheduler.state_dict()
        dropped = [k for k, v in sched.items() if not _jsonable(v)]
        if dropped:
            warnings.warn(f"lr scheduler state {dropped} is not JSON-serialisable and is not saved; "
                          "it will be rebuilt from the constructor on resume", stacklevel=3)
        sched = {k: v for k, v in sched.items() if k not in dropped}
    scalars = {str(g): {k: v for k, v in s.items() if not torch.is_tensor(v) and _jsonable(v)}
               for g, s in _group_states(engine).items()}
    groups = [{k: (v.item() if torch.is_tensor(v) and v.dim() == 0 else v) for k, v in g.items() if k != "params"}
              for g in engine.optimizer.param_groups]
    return {
        "format": FORMAT, "tag": tag, "world_size": engine.comm.world_size, "stage": engine.stage,
        "dtype": str(engine.dtype),
        "counters": {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                     "micro_steps": engine.micro_steps},
        "loss_scaler": engine.scaler.state_dict(),
        "optimizer": type(engine.optimizer).__name__,
        "lr_scheduler": sched,
        "param_groups": [{k: v for k, v in g.items() if _jsonable(v)} for g in groups],
        "optim_scalars": scalars,
        "client_state": client_state,
        "config": engine.config.model_dump(mode="json"),
        "model": _signature(engine),
        "layout": [{"group": b.group, "numel": b.numel, "partitions": b.partitions,
                    "params": [[p.name, p.start, p.numel] for p in _bucket_params(engine, b)]}
                   for b in engine.partitioned.buckets],
    }


def _bucket_params(engine, b) -> list[Piece]:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [Piece(names[id(s.param)], s.offset, b.index, 0, s.numel) for s in b.slots]


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)  # a temp dir left by a crashed save
    os.makedirs(path)


def _finish(save_dir: str, tmp: str, tag: str, meta: dict) -> None:
    _write_atomic(os.path.join(tmp, META), json.dumps(meta, indent=1))
    _commit(save_dir, tmp, tag)


def _commit(save_dir: str, tmp: str, tag: str) -> None:
    """Rename the finished temp dir into place, then point `latest` at it."""
    final = os.path.join(save_dir, tag)
    old = os.path.join(save_dir, f".old.{tag}")
    if os.path.exists(final):  # re-saving a tag: the old one is moved aside, then dropped
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(save_dir)
    _write_atomic(os.path.join(save_dir, LATEST), tag)
    shutil.rmtree(old, ignore_errors=True)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
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


def _file_record(path: str) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": crc}


def _host_rng() -> dict:
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


# ---- agreement: every rank raises the same error, nobody hangs ---------------------------------
def _agree(comm, err: str | None, payload=None) -> list:
    """Collective: gather (error, payload) from every rank; raise the first error everywhere."""
    if comm.world_size == 1:
        if err:
            raise CheckpointError(err)
        return [payload]
    results = comm.all_gather_object((err, payload))
    for r, (e, _) in enumerate(results):
        if e:
            same = all(x[0] == e for x in results)
            raise CheckpointError(e if same else f"on rank {r}: {e}")
    return [p for _, p in results]


def _on_rank0(comm, fn, *args) -> str | None:
    if comm.rank != 0:
        return None
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
        return f"could not write the checkpoint: {type(e).__name__}: {e}"
    return None


# ---- reading: checkpoint discovery, validation, safe metadata ----------------------------------
def resolve(load_dir: str, tag: str | None = None) -> tuple[str, dict]:
    """(path of the tag directory, its zerodp.json), checked; `load_dir` may be the tag dir itself."""
    load_dir = os.fspath(load_dir)
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"no checkpoint at '{load_dir}': the directory does not exist")
    if tag is None and os.path.isfile(os.path.join(load_dir, META)):
        path = load_dir
    else:
        named_by = "given"
        if tag is None:
            latest = os.path.join(load_dir, LATEST)
            if not os.path.isfile(latest):
                tags = sorted(d for d in os.listdir(load_dir) if os.path.isfile(os.path.join(load_dir, d, META)))
                hint = f"; tags found: {', '.join(tags)} (pass tag=...)" if tags else ""
                raise CheckpointError(f"no checkpoint in '{load_dir}': there is no '{LATEST}' file{hint}")
            with open(latest) as f:
                tag, named_by = f.read().strip(), f"named by '{latest}'"
            if not _TAG.fullmatch(tag):
                raise CheckpointError(f"'{latest}' is corrupt: it holds {tag[:80]!r}, not a checkpoint tag")
        path = os.path.join(load_dir, tag)
        if tag and not os.path.isdir(path) and os.path.isdir(os.path.join(load_dir, f".old.{tag}")):
            path = os.path.join(load_dir, f".old.{tag}")  # a crash while a re-save of `tag` swapped dirs
        if not tag or not os.path.isdir(path):
            raise CheckpointError(f"checkpoint tag '{tag}' ({named_by}) does not exist in '{load_dir}'")
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"'{path}' is not a complete zerodp checkpoint: {META} is missing "
                              "(an interrupted save?)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            raise ValueError(f"unknown format {meta.get('format')!r}")
        for key in ("model", "files", "counters", "param_groups"):
            meta[key]  # noqa: B018 - presence check
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"checkpoint '{path}' is corrupt: {meta_path} cannot be read ({e})") from None
    for name, rec in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint '{path}' is corrupt: file {file} is missing")
        size = os.path.getsize(file)
        if size != rec["size"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: file {file} has {size} bytes, "
                                  f"{rec['size']} were written (truncated?)")
    return path, meta


def _verify_files(path: str, meta: dict, names: set[str]) -> None:
    for name in sorted(names):
        file = os.path.join(path, name)
        if name not in meta["files"] or _file_record(file)["crc32"] != meta["files"][name]["crc32"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: file {file} does not match its "
                                  "checksum")


_ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
    "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: admit DCP's metadata classes, torch dtypes and nothing else."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is read by the restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _read_metadata(path: str):
    try:
        return SafeReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure here means an unreadable file
        raise CheckpointError(f"checkpoint '{path}' is corrupt: {os.path.join(path, '.metadata')} "
                              f"cannot be read ({type(e).__name__}: {e})") from None


def _read(path: str, metadata, keys: list[str], meta: dict, consume: Callable[[dict], None]) -> None:
    """Read the saved tensors `keys` whole, in chunks of bounded size; `consume` gets each chunk."""
    md = metadata.state_dict_metadata
    for key in keys:
        if not isinstance(md.get(key), TensorStorageMetadata):
            raise CheckpointError(f"checkpoint '{path}' is corrupt: tensor {key} is missing from its .metadata")
    wanted = set(keys)
    _verify_files(path, meta, {info.relative_path for idx, info in metadata.storage_data.items()
                               if idx.fqn in wanted} | {".metadata"})
    chunk, size = {}, 0
    for i, key in enumerate(keys):
        chunk[key] = torch.empty(tuple(md[key].size), dtype=md[key].properties.dtype)
        size += chunk[key].numel()
        if size >= LOAD_CHUNK_NUMEL or i == len(keys) - 1:
            try:
                with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.load(chunk, storage_reader=SafeReader(path), no_dist=True)
            except Exception as e:  # noqa: BLE001 - DCP wraps file errors in its own types
                raise CheckpointError(f"checkpoint '{path}' is corrupt: reading its tensors failed "
                                      f"({type(e).__name__}: {e})") from None
            consume(chunk)
            chunk, size = {}, 0


def _saved_pieces(metadata, prefix: str) -> dict[str, list[tuple[int, int, str]]]:
    """name -> [(start, numel, key)] for every saved key `{prefix}{name}@{start}`."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            name, _, start = key[len(prefix):].rpartition("@")
            out.setdefault(name, []).append((int(start), md.size.numel(), key))
    return out


# ---- load ---------------------------------------------------------------------------------------
def load_checkpoint(engine, load_dir: str, tag: str | None = None) -> dict:
    """Restore a checkpoint saved on any world size and stage; returns its client_state.

    Collective: call on every rank. Everything is read and checked before the engine is touched;
    a problem on any rank raises the same CheckpointError on every rank.
    """
    err = staged = meta = None
    try:
        path, meta = resolve(load_dir, tag)
        _check_model(engine, path, meta)
        staged = _stage(engine, path, meta)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:  # noqa: BLE001 - must reach the agreement below, or other ranks hang
        err = f"loading the checkpoint failed: {type(e).__name__}: {e}"
    _agree(engine.comm, err)
    _apply(engine, meta, staged)
    return meta["client_state"] if meta["client_state"] is not None else {}


def _check_model(engine, path: str, meta: dict) -> None:
    current = _signature(engine)
    saved = {e["name"]: e for e in meta["model"]}
    names = {e["name"] for e in current}
    what = lambda e: "buffer" if e["kind"] == "buffer" else "parameter"  # noqa: E731
    prefix = f"checkpoint '{path}' is of a different model:"
    for e in current:
        s = saved.get(e["name"])
        if s is None:
            raise CheckpointError(f"{prefix} {what(e)} '{e['name']}' {tuple(e['shape'])} is not in the checkpoint")
        if s["shape"] != e["shape"]:
            raise CheckpointError(f"{prefix} {what(e)} '{e['name']}' has shape {tuple(s['shape'])} in the "
                                  f"checkpoint and {tuple(e['shape'])} in the model")
        if s["alias_of"] != e["alias_of"]:
            raise CheckpointError(f"{prefix} '{e['name']}' is tied to {s['alias_of']!r} in the checkpoint "
                                  f"and to {e['alias_of']!r} in the model")
        if (s["kind"] == "trained") != (e["kind"] == "trained"):
            state = {True: "trained", False: "not trained"}
            raise CheckpointError(f"{prefix} parameter '{e['name']}' is {state[s['kind'] == 'trained']} in the "
                                  f"checkpoint and {state[e['kind'] == 'trained']} now (requires_grad differs)")
    for s in meta["model"]:
        if s["name"] not in names:
            raise CheckpointError(f"{prefix} it has {what(s)} '{s['name']}' {tuple(s['shape'])}, which the "
                                  "model does not have")
    if meta.get("optimizer", type(engine.optimizer).__name__) != type(engine.optimizer).__name__:
        raise CheckpointError(f"checkpoint '{path}' holds {meta['optimizer']} state, the optimizer is "
                              f"{type(engine.optimizer).__name__}")
    if len(meta["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"checkpoint '{path}' has {len(meta['param_groups'])} optimizer param groups, "
                              f"the optimizer has {len(engine.optimizer.param_groups)}")


@dataclass
class _Staged:
    masters: list[torch.Tensor]                  # fp32, this rank's shard of each bucket
    states: dict[str, list[torch.Tensor]]        # optimizer key -> per-bucket shard
    scalars: dict[str, torch.Tensor]             # "{group}/{key}" -> 0-dim tensor
    untrained: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]


def _stage(engine, path: str, meta: dict) -> _Staged:
    """Read this rank's share of the checkpoint into fresh CPU tensors; the engine is untouched."""
    metadata = _read_metadata(path)
    part, rank = engine.partitioned, engine.comm.rank
    masters = [torch.zeros(m.numel(), dtype=torch.float32) for m in part.masters]
    keys = {k.split("/")[1] for k in metadata.state_dict_metadata if k.startswith("optim/")}
    states = {}
    for key in sorted(keys):
        dtype = next(md.properties.dtype for k, md in metadata.state_dict_metadata.items()
                     if k.startswith(f"optim/{key}/"))
        states[key] = [torch.zeros(m.numel(), dtype=dtype) for m in part.masters]
    copies: dict[str, list] = {}  # saved piece -> [(source offset, destination, its offset, numel)]
    saved = {"master": _saved_pieces(metadata, "master/")}
    saved.update({key: _saved_pieces(metadata, f"optim/{key}/") for key in keys})
    for pc in _owned_pieces(engine):
        for kind, dests in [("master", masters), *states.items()]:
            covered = 0
            for start, numel, key in saved[kind].get(pc.name, []):
                lo, hi = max(start, pc.start), min(start + numel, pc.start + pc.numel)
                if lo < hi:  # the saved piece overlaps what this rank now owns
                    dest = (dests[pc.master], pc.offset + lo - pc.start)
                    copies.setdefault(key, []).append((lo - start, *dest, hi - lo))
                    covered += hi - lo
            if covered != pc.numel:
                raise CheckpointError(f"checkpoint '{path}' is corrupt: {kind} of '{pc.name}' elements "
                                      f"[{pc.start}, {pc.start + pc.numel}) are not all saved")
    md = metadata.state_dict_metadata
    small = [k for k in md if k.startswith(("optim_scalar/", f"rng/{rank}/"))]
    small += [f"model/{name}" for name in _untrained(engine) if f"model/{name}" in md]
    whole: dict[str, torch.Tensor] = {}

    def consume(chunk: dict[str, torch.Tensor]) -> None:
        for key, t in chunk.items():
            for src_off, dest, dest_off, n in copies.get(key, ()):
                dest[dest_off:dest_off + n].copy_(t[src_off:src_off + n])
            if key not in copies:
                whole[key] = t

    _read(path, metadata, list(copies) + small, meta, consume)
    scalars = {k[len("optim_scalar/"):]: t for k, t in whole.items() if k.startswith("optim_scalar/")}
    untrained = {k[len("model/"):]: t for k, t in whole.items() if k.startswith("model/")}
    rng = {k.rsplit("/", 1)[1]: t for k, t in whole.items() if k.startswith("rng/")}
    return _Staged(masters, states, scalars, untrained, rng)


def _apply(engine, meta: dict, staged: _Staged) -> None:
    part, opt = engine.partitioned, engine.optimizer
    with torch.no_grad():
        for m, new in zip(part.masters, staged.masters):
            m.copy_(new.view(m.shape))
        for name, t in _untrained(engine).items():
            if name in staged.untrained:
                t.data.copy_(staged.untrained[name])
    # The optimizer's own load_state_dict puts each state tensor on its parameter's device and
    # dtype (and `step` where the optimizer wants it), so it continues exactly.
    sd = opt.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {}
    for i, (b, m) in enumerate(zip(part.buckets, part.masters)):
        entry = {k: v[i].view(m.shape) for k, v in staged.states.items()}
        entry.update({k.split("/", 1)[1]: t.clone() for k, t in staged.scalars.items()
                      if k.split("/", 1)[0] == str(b.group)})
        entry.update(meta.get("optim_scalars", {}).get(str(b.group), {}))
        if entry:
            state[index[id(m)]] = entry
    sd["state"] = state
    for group, saved in zip(sd["param_groups"], meta["param_groups"]):
        for k, v in saved.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
    opt.load_state_dict(sd)
    part.all_gather()  # working params from the masters, on every rank
    if getattr(engine, "gatherer", None) is not None:
        engine.gatherer.refresh_persistent()  # stage 3 keeps small parameters whole
    c = meta["counters"]
    engine.global_steps, engine.skipped_steps = c["global_steps"], c["skipped_steps"]
    # The accumulation count restarts at a boundary: gas may differ when the world size did.
    engine.micro_steps = engine._stepped_at = engine.global_steps * engine.gas
    engine.reducer.zero()
    if engine.dtype == torch.float16 and meta["dtype"] == str(torch.float16):
        engine.scaler.load_state_dict(meta["loss_scaler"])  # a bf16/fp32 run has no scale to resume
    engine._scale_used = engine.scaler.scale
    engine._grad_norm = None
    if engine.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    _restore_rng(engine, meta, staged.rng)


def _restore_rng(engine, meta: dict, rng: dict[str, torch.Tensor]) -> None:
    rank = engine.comm.rank
    host = meta.get("rng", {}).get(str(rank))
    if host is None or "torch" not in rng:
        # More ranks than were saved: a deterministic, distinct stream per rank.
        seed = (meta["config"].get("seed") or 0) + rank
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np
            np.random.seed(seed)
        except ImportError:
            pass
        return
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and engine.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], engine.device)
    version, internal, gauss = host["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in host:
        try:
            import numpy as np
            kind, keys, pos, has_gauss, cached = host["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass


# ---- consolidation ------------------------------------------------------------------------------
def consolidate(load_dir: str, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(full fp32 state dict keyed like module.state_dict(), {alias: tied-to name}); one process."""
    path, meta = resolve(load_dir, tag)
    metadata = _read_metadata(path)
    md = metadata.state_dict_metadata
    requests: dict[str, torch.Tensor] = {}
    _read(path, metadata, [k for k in md if k.startswith(("master/", "model/"))], meta, requests.update)
    pieces = _saved_pieces(metadata, "master/")
    out: dict[str, torch.Tensor] = {}
    ties: dict[str, str] = {}
    for e in meta["model"]:
        name, shape = e["name"], torch.Size(e["shape"])
        if e["alias_of"] is not None:
            ties[name] = e["alias_of"]
            out[name] = out[e["alias_of"]]
        elif e["kind"] == "trained":
            full, covered = torch.zeros(shape.numel(), dtype=torch.float32), 0
            for start, numel, key in pieces.get(name, []):
                full[start:start + numel] = requests[key]
                covered += numel
            if covered != shape.numel():
                raise CheckpointError(f"checkpoint '{path}' is corrupt: parameter '{name}' has "
                                      f"{covered} of {shape.numel()} elements saved")
            out[name] = full.view(shape)
        else:
            t = requests.get(f"model/{name}")
            if t is None:
                raise CheckpointError(f"checkpoint '{path}' is corrupt: '{name}' is not saved")
            out[name] = t.float() if t.is_floating_point() else t
    return out, ties


def write_consolidated(load_dir: str, out: str, tag: str | None = None) -> None:
    """Write the full fp32 state dict as `.safetensors` (ties in its metadata) or `.pt`."""
    state, ties = consolidate(load_dir, tag)
    if out.endswith(".safetensors"):
        from safetensors.torch import save_file
        # safetensors stores no shared tensors: a tied name gets an equal copy, the tie goes in metadata.
        plain = {k: (v.clone() if k in ties else v).contiguous() for k, v in state.items()}
        save_file(plain, out, metadata={"format": "pt", "zerodp_tied": json.dumps(ties)})
    elif out.endswith(".pt"):
        torch.save(state, out)  # tied names share one tensor, as in the module
    else:
        raise CheckpointError(f"output '{out}' must end in .safetensors or .pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zerodp consolidate",
                                     description="write a sharded checkpoint as one full fp32 state dict")
    parser.add_argument("dir", help="a save_dir (its 'latest' tag is used) or a checkpoint tag directory")
    parser.add_argument("out", help="output file, .safetensors or .pt")
    parser.add_argument("--tag", default=None, help="the tag to consolidate (default: latest)")
    args = parser.parse_args(argv)
    try:
        write_consolidated(args.dir, args.out, args.tag)
    except CheckpointError as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
