"""Reading a checkpoint directory safely: find it, check it, read its tensors in bounded chunks.

Nothing is trusted before it is checked: `resolve` checks zerodp.json (manifest.py: every field by type
and range) and every file's size, and `read_tensors` the crc32 of each file it reads. No path is
followed out of the checkpoint directory: every file named in zerodp.json or in the DCP `.metadata`
must resolve inside it (no absolute path, `..` or symlink out), checked before any of them is opened.
No unrestricted unpickling: `.metadata` (a pickle) is read with an unpickler that admits only DCP's
own metadata classes; tensors are read with torch.load(weights_only=True). `newest_intact` is what a
resume falls back on when `latest` is broken: the newest intact checkpoint of the same run (files.py).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from zerodp.checkpoint import files
from zerodp.checkpoint.deepspeed import directory_contents
from zerodp.checkpoint.errors import CheckpointError, failure_text
from zerodp.checkpoint.files import LATEST, MANIFEST, TAG
from zerodp.checkpoint.manifest import validate
from zerodp.checkpoint.files import Saved, newest_first, only_run, run_of

# Pieces read per dcp.load call while resuming: bounds the host memory a load needs at once.
LOAD_CHUNK_NUMEL = 1 << 28


def resolve(load_dir: str, tag: str | None = None, checksums: bool = False) -> tuple[str, dict]:
    """(path of the tag directory, its zerodp.json), checked; `load_dir` may be the tag dir itself.
    Every file's size is checked; with `checksums` its crc32 too (a read of every byte, in chunks:
    what an unattended resume does once, so that a flipped bit sends it to an older checkpoint)."""
    load_dir = os.fspath(load_dir)
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"no checkpoint at '{load_dir}': the directory does not exist")
    if tag is None and os.path.isfile(os.path.join(load_dir, MANIFEST)):
        path = load_dir
    else:
        named_by = "given"
        if tag is None:
            latest = os.path.join(load_dir, LATEST)
            if not os.path.isfile(latest):
                tags = sorted(d for d in os.listdir(load_dir) if os.path.isfile(os.path.join(load_dir, d, MANIFEST)))
                hint = f"; tags found: {', '.join(tags)} (pass tag=...)" if tags else ""
                raise CheckpointError(f"no checkpoint in '{load_dir}': there is no '{LATEST}' file{hint}; neither a "
                                      f"zerodp nor a DeepSpeed checkpoint: {directory_contents(load_dir)}")
            with open(latest) as f:
                tag, named_by = f.read().strip(), f"named by '{latest}'"
            if not TAG.fullmatch(tag):
                raise CheckpointError(f"'{latest}' is corrupt: it holds {tag[:80]!r}, not a checkpoint tag")
        path = os.path.join(load_dir, tag)
        if tag and not os.path.isdir(path) and os.path.isdir(os.path.join(load_dir, f".old.{tag}")):
            path = os.path.join(load_dir, f".old.{tag}")  # a crash while a re-save of `tag` swapped dirs
        if not tag or not os.path.isdir(path):
            raise CheckpointError(f"checkpoint tag '{tag}' ({named_by}) does not exist in '{load_dir}'")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"'{path}' is neither a zerodp nor a DeepSpeed checkpoint ({MANIFEST} or "
                              f"mp_rank_00_model_states.pt; an interrupted save?): {directory_contents(path)}")
    _inside(path, MANIFEST, "the checkpoint itself")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{path}' is corrupt: {manifest_path} cannot be read ({e})") from None
    manifest = validate(text, f"checkpoint '{path}' is corrupt: {manifest_path}")
    for name in manifest["files"]:
        _inside(path, name, manifest_path)
    for name, rec in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint '{path}' is corrupt: file {file} is missing")
        size = os.path.getsize(file)
        if size != rec["size"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: file {file} has {size} bytes, "
                                  f"{rec['size']} were written (truncated?)")
    if checksums:
        _verify_files(path, manifest, set(manifest["files"]))
    return path, manifest


def newest_intact(save_dir: str, run: str | None = None) -> tuple[str, dict]:
    """(path, zerodp.json) of run `run`'s newest checkpoint in save_dir (by global step, then time) that
    `resolve` accepts with every checksum: what a resume falls back on when `latest` is corrupt or names a
    broken one. `run` None: the folder's current run (current_run). Another run's checkpoint is never
    taken, whatever its step. Checkpoints are checked newest first, and the first intact one is taken."""
    save_dir = os.fspath(save_dir)
    saved = files.scan(save_dir)
    run = current_run(save_dir, saved) if run is None else run
    broken = []
    for s in newest_first(saved, run):
        try:  # the checksums, newest first: reading every byte of the older ones is not needed
            return resolve(save_dir, s.name, checksums=True)
        except CheckpointError as e:
            broken.append(str(e))
    why = f": {'; '.join(broken)}" if broken else ""
    others = sorted(s.name for s in saved if s.run != run)
    besides = f" (other runs' checkpoints there, not taken: {', '.join(others)})" if others else ""
    raise CheckpointError(f"no intact checkpoint of run {run} in '{save_dir}'{why}{besides}")


def current_run(save_dir: str, saved: list[Saved] | None = None) -> str:
    """The run of the checkpoint `latest` names (from its zerodp.json; its files unchecked); when `latest` or
    that zerodp.json cannot be read, the only run of the folder's checkpoints `saved` (runs.only_run)."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            tag = f.read().strip()
    except (OSError, ValueError):
        tag = ""
    manifest = files.saved_manifest(os.path.join(save_dir, tag)) if TAG.fullmatch(tag) else None
    if manifest is not None:
        return run_of(manifest)
    return only_run(files.scan(save_dir) if saved is None else saved, save_dir)


def _inside(path: str, name: str, named_in: str) -> None:
    """Refuse a file name that leads out of checkpoint directory `path` before anything opens it."""
    if files.inside(path, name) is None:
        raise CheckpointError(f"checkpoint '{path}' is unsafe: file {name!r} (named in {named_in}) resolves "
                              f"to '{os.path.realpath(os.path.join(path, name))}', outside the checkpoint "
                              "directory; refusing to read it")


def _verify_files(path: str, manifest: dict, names: set[str], verified: set[str] | None = None) -> None:
    """The crc32 of each file in `names`; those in `verified` were checked already, and are added to it."""
    for name in sorted(names - (verified or set())):
        file = os.path.join(path, name)
        if name not in manifest["files"] or files.record(file)["crc32"] != manifest["files"][name]["crc32"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: file {file} does not match its "
                                  "checksum")
        if verified is not None:
            verified.add(name)


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
        path = os.fspath(self.path)
        _inside(path, ".metadata", "the checkpoint itself")
        with open(Path(path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        for info in (metadata.storage_data or {}).values():  # DCP opens these: none may lead out
            _inside(path, os.fspath(info.relative_path), os.path.join(path, ".metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str):
    """The DCP metadata of checkpoint `path`: which tensors it holds, in which files."""
    try:
        return SafeReader(path).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here means an unreadable file
        raise CheckpointError(f"checkpoint '{path}' is corrupt: {os.path.join(path, '.metadata')} "
                              f"cannot be read ({type(e).__name__}: {e})") from None


def read_tensors(path: str, metadata, keys: list[str], manifest: dict, consume: Callable[[dict], None],
                 verified: set[str] | None = None) -> None:
    """Read the saved tensors `keys` whole, in chunks of bounded size; `consume` gets each chunk."""
    for chunk in iter_tensors(path, metadata, keys, manifest, verified=verified):
        consume(chunk)


def iter_tensors(path: str, metadata, keys: list[str], manifest: dict, chunk_numel: int = LOAD_CHUNK_NUMEL,
                 verified: set[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The saved tensors `keys`, whole, in chunks of about `chunk_numel` elements, in key order
    (the files checked once, before the first). verified: the files whose crc32 a reader of many
    small requests has checked already (kept up to date)."""
    md = metadata.state_dict_metadata
    for key in keys:
        if not isinstance(md.get(key), TensorStorageMetadata):
            raise CheckpointError(f"checkpoint '{path}' is corrupt: tensor {key} is missing from its .metadata")
    wanted = set(keys)
    _verify_files(path, manifest, {info.relative_path for idx, info in metadata.storage_data.items()
                               if idx.fqn in wanted} | {".metadata"}, verified)
    chunk, size = {}, 0
    for i, key in enumerate(keys):
        chunk[key] = torch.empty(tuple(md[key].size), dtype=md[key].properties.dtype)
        size += chunk[key].numel()
        if size >= chunk_numel or i == len(keys) - 1:
            error = _load(path, chunk)
            if error is not None:
                file = _failing_file(path, metadata, chunk)
                where = f"file {os.path.join(path, file)} cannot be read" if file else "reading its tensors failed"
                raise CheckpointError(f"checkpoint '{path}' is corrupt: {where} ({error})")
            yield chunk
            chunk, size = {}, 0


def _load(path: str, chunk: dict[str, torch.Tensor]) -> str | None:
    """dcp.load of `chunk` from checkpoint `path`, in this process alone; what failed, or None."""
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(chunk, storage_reader=SafeReader(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps file errors in its own types
        # One process reads here: "on rank 0" (DCP's wrapping) would name no real rank.
        return failure_text(e).replace(" on rank 0:", ":").rstrip(": ")
    return None


def _failing_file(path: str, metadata, chunk: dict[str, torch.Tensor]) -> str | None:
    """The one file whose tensors of `chunk` fail to load on their own (the error path only: each
    file's tensors are read again, one file at a time); None when no single file is to blame."""
    by_file: dict[str, set[str]] = {}
    for idx, info in metadata.storage_data.items():
        if idx.fqn in chunk:
            by_file.setdefault(os.fspath(info.relative_path), set()).add(idx.fqn)
    for file, fqns in sorted(by_file.items()):
        alone = [k for k in fqns if all(os.fspath(i.relative_path) == file for x, i in metadata.storage_data.items()
                                        if x.fqn == k)]
        if alone and _load(path, {k: torch.empty_like(chunk[k]) for k in alone}) is not None:
            return file
    return None
