"""Weights read from files a range at a time, never whole on a rank: `open_weights(path, model)` gives the
engine a ParameterSource (zerodp.engine.setup.source) over a Hugging Face folder (one `model.safetensors`, or
shards with `model.safetensors.index.json`), a `.safetensors` file, a zerodp checkpoint or a DeepSpeed
ZeRO checkpoint; the engine asks it for the element ranges this rank keeps.

How each reads only what is asked:
  safetensors  `safe_open(...).get_slice(key)[r0:r1]` of the rows that cover [start, stop) (less than
               one row read on either side of the range): a view of the memory-mapped file, of which only
               the pages touched are read; the range is copied out and the file closed per read. A
               tensor-parallel shard's block (`read_box`: a Shard(1) shard's rows' column slice) is one
               `get_slice(key)[rows, columns]`.
  zerodp       the fp32 master pieces `master/{name}@{start}` that overlap [start, stop), loaded by
               torch.distributed.checkpoint (read.py's checked reader); a piece is read whole, so at most
               one saved shard is read beyond the range on either side.
  DeepSpeed    the memory-mapped rank partitions (deepspeed.py): only the pages of the range are read.
torch.distributed.checkpoint's HuggingFaceStorageReader is not used: it reads boxes of a tensor's own
shape (DTensor chunks), and the engine asks for ranges of the flattened parameter, which a box covers
only by reading whole rows of every dimension; safetensors' slices give those rows directly.

Names: the model's parameter names (`named_parameters()`, a tied parameter under its first name) are
matched to the file's keys through any of their names (a tie stored once, under either name) and one
wrapper prefix on either side (zerodp's HFCausalLM `model.`, a DDP/DeepSpeed `module.`). `check` names
every parameter the file lacks or holds in another shape, every tensor of the file the model does not
have, and an HF folder whose config.json is of another model type.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Callable

import torch
from torch import nn

from zerodp.checkpoint import deepspeed
from zerodp.checkpoint.files import MANIFEST
from zerodp.checkpoint.pieces import saved_pieces
from zerodp.checkpoint.read import read_metadata, read_tensors, resolve
from zerodp.models.hf_folder import CONFIG, PREFIXES

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# (prefix of the model's names, prefix of the file's keys): the first pair that finds every parameter wins.
_PAIRS = [(p, "") for p in PREFIXES] + [("", p) for p in PREFIXES[1:]]
Alias = Callable[[str], str]


def open_weights(path: str | os.PathLike, model: nn.Module, alias: Alias | None = None,
                 optional: frozenset[str] = frozenset()) -> FileSource:
    """The ParameterSource for `path`: an HF folder, a .safetensors file, a zerodp or DeepSpeed checkpoint
    (a save_dir with `latest`, or a tag directory). Reads headers and metadata only. For a model that an
    adapter library wraps around a pretrained one: `alias(name)`, one more name under which the files may
    hold a parameter (the wrapped model's own), tried after the parameter's own names; `optional`, the
    parameters the files may lack (the adapter's), left to the modules' initialisers (`initialised`)."""
    source = _open(os.fspath(path), model)
    if alias is not None:
        source.match(model, alias)
    source.optional = frozenset(optional)
    return source


def _open(path: str, model: nn.Module) -> FileSource:
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return SafetensorsSource(f"the weights in file '{path}'", _keys_in([path]), model)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG)):
        return _hf_folder(path, model)
    ds = deepspeed.find(path) if os.path.isdir(path) else None
    if ds is not None:
        return DeepSpeedSource(ds, model)
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in (MANIFEST, "latest")):
        return ZeroCheckpointSource(path, model)
    found = deepspeed.directory_contents(path) if os.path.isdir(path) else "it does not exist" if not os.path.exists(path) \
        else "it is a file not ending in .safetensors"
    raise ValueError(f"weights '{path}' are none of what zerodp reads (a Hugging Face folder with config.json and "
                     f"{SINGLE} or {INDEX}, a .safetensors file, a zerodp or DeepSpeed checkpoint): {found}")


class FileSource:
    """What every reader shares: the model's names matched to the file's keys, `check` and `read`.
    A reader gives `shapes` (every key it can read, with its shape; `other`: keys it holds and does not
    read, such as buffers) and implements `read_key`."""

    def __init__(self, origin: str, shapes: dict[str, torch.Size], model: nn.Module, other: set[str] = frozenset(),
                 problems: list[str] | None = None):
        self.origin, self.shapes, self.keys = origin, shapes, set(shapes) | set(other)
        self.match(model)
        self.problems = list(problems or [])
        self.optional: frozenset[str] = frozenset()  # parameters the files may lack (open_weights)

    def initialised(self, names: list[str]) -> list[str]:
        """Of `names`, the optional ones the files lack: the engine takes them from the initialisers."""
        return [n for n in names if n in self.optional and n not in self.names]

    def match(self, model: nn.Module, alias: Alias | None = None) -> None:
        """The model's names matched to the file's keys (`names`), and the keys none matches (`unexpected`)."""
        self.names, self.unexpected = match_names(model, self.keys, alias)

    def check(self, shapes: dict[str, torch.Size]) -> None:
        """ValueError naming each parameter missing or of another shape and each tensor the model lacks."""
        problems = list(self.problems)
        missing = [n for n in shapes if n not in self.names]
        if missing:
            problems.append(f"it has no tensor for {len(missing)} parameter(s) of the model: "
                            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                            f"(it holds e.g. {', '.join(sorted(self.shapes)[:3])})")
        for name, shape in shapes.items():
            key = self.names.get(name)
            if key is not None and self.shapes[key] != torch.Size(shape):
                problems.append(f"'{key}' has shape {tuple(self.shapes[key])}, parameter '{name}' of the model "
                                f"has {tuple(shape)}")
        if self.unexpected:
            problems.append(f"it holds {len(self.unexpected)} tensor(s) the model does not have: "
                            f"{', '.join(self.unexpected[:5])}{' ...' if len(self.unexpected) > 5 else ''}")
        if problems:
            raise ValueError(f"{self.origin} do not fit the model: " + "; ".join(problems))

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of parameter `name` flattened, in the file's dtype."""
        return self.read_key(self.names[name], start, stop)

    def read_key(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the file's tensor `key` flattened."""
        raise NotImplementedError


def match_names(model: nn.Module, keys: set[str], alias: Alias | None = None) -> tuple[dict[str, str], list[str]]:
    """({parameter's first name: file key}, the file's keys that are none of the model's tensors)."""
    aliases: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(first.setdefault(id(p), n), []).append(n)
    if alias is not None:  # after the own names: a file of the wrapped model's own names is read first
        aliases = {n: names + [alias(a) for a in names if alias(a) != a] for n, names in aliases.items()}
    best: tuple[dict[str, str], str, str] = ({}, "", "")
    for mp, fp in _PAIRS:
        names = {}
        for name, all_names in aliases.items():
            found = [fp + a[len(mp):] for a in all_names if a.startswith(mp) and fp + a[len(mp):] in keys]
            if found:
                names[name] = found[0]
        if len(names) > len(best[0]):
            best = (names, mp, fp)
        if len(names) == len(aliases):
            break
    names, mp, fp = best
    state = list(model.state_dict()) + ([alias(n) for n in model.state_dict()] if alias is not None else [])
    known = {fp + n[len(mp):] for n in state if n.startswith(mp)}
    # Keys a Hugging Face model declares it ignores on load (old checkpoints' buffers, e.g. attn.masked_bias).
    ignored = [re.compile(p) for m in model.modules()
               for p in getattr(m, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = sorted(k for k in keys if k not in known and not any(p.search(k) for p in ignored))
    return names, unexpected


# ---- safetensors: a file, or a Hugging Face folder of one or several ---------------------------------
class SafetensorsSource(FileSource):
    """Tensors of one or more .safetensors files, each read by rows through a memory map."""

    def __init__(self, origin: str, files: dict[str, str], model: nn.Module, problems: list[str] | None = None):
        self.files = files
        super().__init__(origin, _shapes(files), model, problems=problems)

    def read_key(self, key: str, start: int, stop: int) -> torch.Tensor:
        """The rows that cover [start, stop), cut to it."""
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            sl = f.get_slice(key)
            shape = sl.get_shape()
            if len(shape) == 0:
                return f.get_tensor(key).reshape(-1)[start:stop]
            row = math.prod(shape[1:])
            first = start // row
            rows = sl[first:-(-stop // row)].reshape(-1)
            # A view of the mapped file, of which only the pages touched were read: copy the range out, so
            # that the mapping closes now rather than when the caller drops the tensor.
            return rows[start - first * row:stop - first * row].clone()

    def read_box(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The elements of parameter `name` inside `index` (a slice per dimension), shaped as the box."""
        from safetensors import safe_open

        key = self.names[name]
        with safe_open(self.files[key], framework="pt") as f:
            return f.get_slice(key)[index].clone()  # copied out of the mapping, as read_key's range


def _keys_in(files: list[str]) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                out.update({k: file for k in f.keys()})
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"weights file '{file}' cannot be read as safetensors ({type(e).__name__}: {e})") from None
    return out


def _shapes(files: dict[str, str]) -> dict[str, torch.Size]:
    from safetensors import safe_open

    out = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            out.update({k: torch.Size(f.get_slice(k).get_shape()) for k in f.keys() if files.get(k) == file})
    return out


def _hf_folder(path: str, model: nn.Module) -> SafetensorsSource:
    """A save_pretrained folder: its index's shards, or its one model.safetensors."""
    origin = f"the weights of Hugging Face folder '{path}'"
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} cannot be read as a safetensors index ({type(e).__name__}: {e})") from None
        files = {}
        for key, name in weight_map.items():
            file = os.path.realpath(os.path.join(path, name))
            if os.path.dirname(file) != os.path.realpath(path) or not os.path.isfile(file):
                raise ValueError(f"{index} names file {name!r} for '{key}', which is not a file in the folder")
            files[key] = file
    elif os.path.isfile(os.path.join(path, SINGLE)):
        files = _keys_in([os.path.join(path, SINGLE)])
    else:
        raise ValueError(f"Hugging Face folder '{path}' has neither {SINGLE} nor {INDEX} (other weight formats, "
                         f"such as pytorch_model.bin, are not read): {deepspeed.directory_contents(path)}")
    return SafetensorsSource(origin, files, model, problems=_other_model_type(path, model))


def _other_model_type(path: str, model: nn.Module) -> list[str]:
    """A folder whose config.json names another model type than the model's own HF config."""
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
            theirs = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return [f"its {CONFIG} cannot be read"]
    mine = next((getattr(m.config, "model_type", None) for m in model.modules()
                 if hasattr(getattr(m, "config", None), "model_type")), None)
    if theirs and mine and theirs != mine:
        return [f"its {CONFIG} is of model type '{theirs}' and the model is a '{mine}'"]
    return []


# ---- zerodp checkpoints ----------------------------------------------------------------------------
class ZeroCheckpointSource(FileSource):
    """The fp32 masters of a zerodp checkpoint (frozen parameters from its `model/` tensors)."""

    def __init__(self, path: str, model: nn.Module):
        self.path, manifest = resolve(path)
        if manifest.get("tp", 1) > 1:  # its tp shards are saved per tp rank: no range of a whole parameter
            raise ValueError(f"checkpoint '{self.path}' was saved with tensor parallelism (tp {manifest['tp']}): its "
                             "parameters are saved as tp shards; `zerodp consolidate` it and pass the "
                             "consolidated file as weights=")
        self.manifest, self.metadata = manifest, read_metadata(self.path)
        # stage 3's frozen parameters are saved in pieces too (`frozen/`), the others whole (`model/`)
        self.pieces = {**saved_pieces(self.metadata, "frozen/"), **saved_pieces(self.metadata, "master/")}
        self.alias = {e["name"]: e["alias_of"] for e in manifest["model"] if e["alias_of"] is not None}
        entries = [e for e in manifest["model"] if e["kind"] != "buffer"]
        self.verified: set[str] = set()
        self._last: tuple[tuple[str, ...], dict[str, torch.Tensor]] = ((), {})
        super().__init__(f"the weights of checkpoint '{self.path}'",
                         {e["name"]: torch.Size(e["shape"]) for e in entries}, model,
                         other={e["name"] for e in manifest["model"]})

    def read_key(self, key: str, start: int, stop: int) -> torch.Tensor:
        """The saved master pieces that overlap [start, stop), cut to it."""
        key = self.alias.get(key, key)
        if key not in self.pieces:  # a frozen parameter, saved whole
            return self._load([f"model/{key}"])[f"model/{key}"].reshape(-1)[start:stop]
        wanted = [(s, n, k) for s, n, k in self.pieces[key] if s < stop and s + n > start]
        tensors = self._load([k for _, _, k in wanted])
        out, covered = torch.empty(stop - start, dtype=torch.float32), 0
        for s, n, k in wanted:
            lo, hi = max(s, start), min(s + n, stop)
            out[lo - start:hi - start] = tensors[k][lo - s:hi - s]
            covered += hi - lo
        if covered != stop - start:
            raise ValueError(f"{self.origin}: elements [{start}, {stop}) of '{key}' are not all saved (corrupt?)")
        return out

    def _load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The saved tensors `keys`; the last set read is kept, as consecutive ranges share pieces."""
        if tuple(keys) != self._last[0]:
            got: dict[str, torch.Tensor] = {}
            read_tensors(self.path, self.metadata, keys, self.manifest, got.update, verified=self.verified)
            self._last = (tuple(keys), got)
        return self._last[1]


# ---- DeepSpeed ZeRO checkpoints ----------------------------------------------------------------------
class DeepSpeedSource(FileSource):
    """The fp32 masters of a DeepSpeed ZeRO checkpoint, copied out of its memory-mapped rank partitions."""

    def __init__(self, path: str, model: nn.Module):
        self.ckpt = ckpt = deepspeed.read(path)
        self.ties = dict(ckpt.model.get("shared_params") or {})
        frozen = {n: t.shape for n, t in ckpt.untrained.items()}
        super().__init__(f"the weights of DeepSpeed checkpoint '{path}'", {**frozen, **ckpt.shapes}, model,
                         other=set(self.ties))

    def read_key(self, key: str, start: int, stop: int) -> torch.Tensor:
        """The range copied out of the rank partitions that hold it."""
        key = self.ties.get(key, key)
        if key not in self.ckpt.shapes:  # a frozen parameter, whole in the model states
            return self.ckpt.untrained[key].reshape(-1)[start:stop]
        out = torch.empty(stop - start, dtype=torch.float32)
        self.ckpt.copy("master", key, start, out)
        return out
