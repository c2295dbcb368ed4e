"""Hugging Face model folders (what `save_pretrained` writes): read one to fine-tune, write one from
trained weights. The one place that knows the folder format; transformers is imported on use only.

In: `model_from_config` (the folder's AutoModelForCausalLM in fp32, its weights left to
`zerodp.initialize(..., weights=folder)`, which reads each rank's share of them), `init_fn` (HF's own
initialiser of a model on meta: zerodp.initialize's default for one), `load_tokenizer` (the
folder's, when it has one) and `tokenize` (text per line, concatenated, as HF's run_clm example does). Out: `write_folder` builds the
model of a recorded config on the meta device, lets `save_pretrained` write config.json and
generation_config.json, and asks HF which weights it would store under which keys in which shards
(`layout`: HF's key names, tied copies dropped as HF drops them: GPT-2's lm_head is re-tied on load;
a bitsandbytes 4-bit or 8-bit weight written as bitsandbytes writes it, its quantisation entries beside it:
`quant_entries`).
The weights themselves are written tensor by tensor as they arrive (models.weight_files), so neither
the writer nor a rank sending them ever holds the whole model; the tokenizer is copied through
`AutoTokenizer`. What a checkpoint records to make this
possible later (`zerodp consolidate --hf`) is `description(model, tokenizer_from)`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from zerodp.engine.sharding.weights import Weights

CONFIG = "config.json"
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
# save_pretrained's default (transformers 5): a model under 50 GB is one model.safetensors, as before.
MAX_SHARD_SIZE = "50GB"
# Any of these makes a folder's tokenizer loadable by AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Prefixes a trained state dict may carry before HF's own names: zerodp's HFCausalLM (`model.`),
# a DDP/DeepSpeed-style wrapper (`module.`).
PREFIXES = ("", "model.", "module.", "module.model.")
# The names families give a model's width in config.json; a config object answers to `hidden_size`
# under any of them (transformers' attribute_map), a config.json dict does not.
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")
# What bitsandbytes' 4-bit layers write beside a packed weight `w` (Params4bit's QuantState.as_dict, packed):
# `w.absmax`, `w.quant_map`, with double quantisation `w.nested_absmax` and `w.nested_quant_map`, and
# `w.quant_state.bitsandbytes__nf4` (or __fp4: the rest of the state as JSON bytes).
QUANT_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
# What an 8-bit layer `m` (Linear8bitLt) writes beside its int8 weight `m.weight`: its row scales and format.
INT8_ENTRIES = ("SCB", "weight_format")


def hidden_size(config: Any) -> int | None:
    """A model's width by transformers' own rule for DeepSpeed's "auto" bucket sizes: its hidden
    size, else the largest of `hidden_sizes` (multi-stage vision models), else the same read from
    `text_config` (multimodal models). `config`: a transformers config or a config.json dict."""
    def field(c: Any, key: str) -> Any:
        return c.get(key) if isinstance(c, dict) else getattr(c, key, None)

    for c in (config, field(config, "text_config") if config is not None else None):
        if c is None:
            continue
        width = next((field(c, k) for k in WIDTH_KEYS if field(c, k) is not None), None)
        if width is not None:
            return int(width)
        if field(c, "hidden_sizes"):
            return int(max(field(c, "hidden_sizes")))
    return None


def is_model_folder(path: str) -> bool:
    """Whether `path` is a directory holding a config.json (a `save_pretrained` folder)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def quiet_other_ranks() -> None:
    """Only rank 0 prints transformers' warnings and progress bars: the same line from every rank
    says nothing more."""
    if int(os.environ.get("RANK", "0")) > 0:
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()


def model_from_config(path: str):
    """The folder's causal LM built from its config.json in fp32 (the engine keeps fp32 master weights),
    without reading its weights: `zerodp.initialize(..., weights=path)` reads each rank's share."""
    import torch
    import transformers

    quiet_other_ranks()
    try:
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):  # no values, no memory: zerodp.initialize fills each rank's share
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path!r}: cannot build a causal LM from this folder: {e}") from None



def init_fn(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """Hugging Face's own initialiser of a model built on meta, as zerodp.initialize's param_init_fn (its
    default, so zerodp train, ZeroTrainer and a user's script share it): each module inside a
    `PreTrainedModel` is initialised by the `_init_weights` of the nearest one enclosing it, as HF's
    `initialize_weights` dispatches them (HF layers such as Conv1D and RMSNorm have no reset_parameters(),
    and rotary tables, non-persistent buffers no weight file holds, are computed there); a module outside
    any keeps its reset_parameters(). None when nothing is on meta, when the model holds no
    PreTrainedModel (transformers is never imported here: a model of its classes has imported it), or
    when a module outside one has nothing to initialise it (zerodp.initialize then names its tensors)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return None
    owner: dict[int, Callable[[nn.Module], None]] = {}  # id(module) -> the _init_weights that initialises it
    stack = [(model, None)]
    while stack:
        m, init = stack.pop()
        init = m._init_weights if isinstance(m, modeling.PreTrainedModel) else init
        if init is not None:
            owner[id(m)] = init
        stack += [(c, init) for c in m.children()]
    if not owner or any(id(m) not in owner and _holds_meta(m) and not callable(getattr(m, "reset_parameters", None))
                        for m in model.modules()):
        return None

    def init(module: nn.Module) -> None:
        if id(module) in owner:
            owner[id(module)](module)
        else:
            module.reset_parameters()
    return init


def _holds_meta(m: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)))


def load_tokenizer(path: str):
    """The folder's tokenizer, or None when it has none (the job then reads bytes)."""
    if not has_tokenizer(path):
        return None
    import transformers

    quiet_other_ranks()
    return transformers.AutoTokenizer.from_pretrained(path)


def tokenize(text: str, tokenizer) -> np.ndarray:
    """Token ids of `text`, line by line (HF's run_clm recipe: no sequence-length warning, the
    tokenizer's batch encoding), without special tokens; uint16 when the vocabulary fits."""
    import numpy as np

    lines = text.splitlines(keepends=True)
    ids = tokenizer(lines, add_special_tokens=False)["input_ids"] if lines else []
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int64
    return np.fromiter((t for line in ids for t in line), dtype=dtype)


def description(model, tokenizer_from: str | None) -> dict[str, Any]:
    """What a checkpoint records of an HF model to write its folder later: config, generation
    config and where its tokenizer is (JSON)."""
    generation = getattr(model, "generation_config", None)
    return {"config": json.loads(model.config.to_json_string(use_diff=False)),
            "generation_config": json.loads(generation.to_json_string()) if generation is not None else None,
            "tokenizer": os.path.abspath(tokenizer_from) if tokenizer_from else None}


def read_description(path: str) -> dict[str, Any]:
    """description()'s record from a folder or a config.json file (`zerodp consolidate --hf-config`)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    file = os.path.join(path, CONFIG) if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--hf-config {path!r}: cannot read {file} ({e}); expected an HF model folder "
                         "or its config.json") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"--hf-config {path!r}: {file} has no 'model_type'; expected the config.json "
                         "that save_pretrained writes")
    generation = os.path.join(folder, "generation_config.json")
    gen = json.loads(Path(generation).read_text()) if os.path.isfile(generation) else None
    return {"config": config, "generation_config": gen,
            "tokenizer": os.path.abspath(folder) if has_tokenizer(folder) else None}


def write_folder(out: str | os.PathLike, weights: Weights | Mapping[str, Any], description: dict[str, Any],
                 writer: bool = True, max_shard_size: int | str = MAX_SHARD_SIZE) -> list[str]:
    """Write `weights` (full tensors, HF names with or without a wrapper prefix: a state dict, or a
    Weights stream) as an HF folder at `out`, replacing what is there; returns notes for the user (a
    tokenizer not copied). The layout is checked against the config's model first, on every caller;
    then the writer writes each tensor as it arrives and the others (writer=False) only iterate the
    stream, which for an engine's weights is a collective: call it on every rank then."""
    from transformers.utils import logging

    from zerodp.engine.sharding.weights import Weights

    if not isinstance(weights, Weights):
        weights = Weights.of(dict(weights))
    model = meta_model(description)
    files, routes, index = layout(model, weights, max_shard_size)  # checked on every caller
    model.to(stored_dtype(weights))  # save_pretrained names the parameters' dtype in config.json
    if not writer:
        weights.drain()
        return []
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))  # renamed into place when whole
    bar = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # save_pretrained's "Writing model shards" of no shard is noise
    try:
        model.save_pretrained(tmp, state_dict={})  # config.json and generation_config.json, as HF writes them
        _write_files(tmp, files, routes, index, weights)
        notes = _copy_tokenizer(description.get("tokenizer"), tmp)
        usual_mode(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar:
            logging.enable_progress_bar()
    return notes


def write_weights(folder: str | os.PathLike, weights: Weights, model, writer: bool = True,
                  max_shard_size: int | str = MAX_SHARD_SIZE) -> None:
    """Only the weight files of `model` (an HF model, e.g. `meta_like`'s), and their index when
    sharded, into `folder`, replacing the weight files there (save_pretrained writes the rest).
    As write_folder: checked on every caller, written by the writer, the stream iterated by all."""
    files, routes, index = layout(model, weights, max_shard_size)
    if not writer:
        weights.drain()
        return
    folder = Path(folder)
    for old in folder.glob("model*.safetensors*"):  # a previous save's shards that this one may not replace
        if old.name == WEIGHTS_INDEX or _SHARD.fullmatch(old.name):
            old.unlink()
    _write_files(folder, files, routes, index, weights)


def _write_files(folder: Path, files: dict[str, dict], routes: dict[str, list[tuple[str, str]]],
                 index: dict | None, weights: Weights) -> None:
    """The safetensors files of `layout` (and their index when sharded) in `folder`, each tensor
    written as the stream gives it: one tensor in memory at a time, besides the stream's own."""
    from zerodp.models.weight_files import SafetensorsFile, write_all

    opened = {f: SafetensorsFile(folder / f, entries, {"format": "pt"}) for f, entries in files.items()}
    write_all(weights.stream, {src: [(opened[f], key) for f, key in targets] for src, targets in routes.items()})
    if index is not None:
        (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def meta_model(description: dict[str, Any]):
    """The model of a recorded config (description()'s), on meta, in fp32 (what is stored: the fp32
    master weights; write_folder names the dtype of a frozen base, stored_dtype)."""
    import torch
    import transformers

    info = dict(description["config"])
    config = transformers.AutoConfig.for_model(info.pop("model_type"), **info)
    config.dtype = torch.float32
    with torch.device("meta"):  # no memory, no init: every value comes from the weights
        model = transformers.AutoModelForCausalLM.from_config(config)
    if description.get("generation_config"):
        model.generation_config = transformers.GenerationConfig.from_dict(description["generation_config"])
    return model


def meta_like(model):
    """A copy of HF model `model`'s architecture on meta (its config, no memory, no values)."""
    import copy

    import torch

    with torch.device("meta"):
        return type(model)(copy.deepcopy(model.config))


def layout(model, weights: Weights, max_shard_size: int | str = MAX_SHARD_SIZE
           ) -> tuple[dict[str, dict], dict[str, list[tuple[str, str]]], dict | None]:
    """What save_pretrained would write for `model` (an HF model, on meta) from `weights`: {file:
    {HF key: (shape, dtype)}}, {name in weights: [(file, HF key)]} and the index (None: one file).
    HF's own choices are taken from HF: the keys it skips, the tied copies it drops, its renames
    back to the original names, its shards. Every mismatch is a ValueError, before any value is read."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    beside = quant_entries(weights.shapes)
    prefix = _prefix({n: v for n, v in weights.shapes.items() if n not in beside.get(_owner(n), ())}, set(state))
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    saved = revert_weight_conversion(model, dict(kept))
    name_of = {id(t): n for n, t in kept.items()}
    converted = [k for k, t in saved.items() if id(t) not in name_of]
    if converted:
        raise ValueError(f"{type(model).__name__}'s save_pretrained converts weights ({', '.join(converted[:3])}) "
                         "rather than renaming them, which zerodp's export does not do")
    missing = sorted(name_of[id(t)] for t in saved.values() if prefix + name_of[id(t)] not in weights.shapes)
    if missing:
        raise ValueError(f"the weights miss {len(missing)} tensor(s) of this HF config's model, e.g. "
                         f"{', '.join(missing[:3])}: is the config the one this model was trained with?")
    stored, targets = {}, {}  # HF key -> its meta tensor; name in weights -> its HF keys
    for key, t in saved.items():
        ours = prefix + name_of[id(t)]
        shape, dtype = weights.shapes[ours]
        if tuple(shape) != tuple(t.shape) and ours not in beside:  # packed 4-bit words have their own shape
            raise ValueError(f"the weights do not fit this HF config's model: '{name_of[id(t)]}' is "
                             f"{tuple(shape)}, the model's is {tuple(t.shape)}")
        for name in (ours, *beside.get(ours, ())):  # bitsandbytes' entries go where their weight's module goes
            targets.setdefault(name, []).append(_module_of(key) + name[len(_module_of(ours)):])
            shape, dtype = weights.shapes[name]
            stored[targets[name][-1]] = torch.empty(shape, dtype=dtype, device="meta")
    split = split_torch_state_dict_into_shards(stored, filename_pattern=WEIGHTS.replace(".safetensors",
                                               "{suffix}.safetensors"), max_shard_size=max_shard_size)
    files = {f: {k: (stored[k].shape, stored[k].dtype) for k in keys} for f, keys in split.filename_to_tensors.items()}
    routes: dict[str, list[tuple[str, str]]] = {}
    for ours, keys in targets.items():
        routes.setdefault(weights.ties.get(ours, ours), []).extend((split.tensor_to_filename[k], k) for k in keys)
    index = ({"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
              "weight_map": split.tensor_to_filename} if split.is_sharded else None)
    return files, routes, index


def quant_entries(shapes: Mapping[str, Any]) -> dict[str, list[str]]:
    """{quantised weight: the names bitsandbytes writes beside it} among `shapes`' names: a 4-bit weight's
    state_dict entry is its packed words (in the quant storage dtype, its own shape), followed by its
    quantisation state (`.absmax`, `.quant_map`, `.nested_*`, `.quant_state.bitsandbytes__nf4`); an 8-bit
    layer's, its int8 weight and, beside it in the module, `SCB` and `weight_format`. from_pretrained reads
    them back under the same names in the weight's module."""
    packed = {n[:-len(".quant_map")] for n in shapes if n.endswith(".quant_map")}
    packed |= {n[:-len("SCB")] + "weight" for n in shapes if n.endswith(".SCB")}
    beside: dict[str, list[str]] = {}
    for n in shapes:
        if _owner(n) in packed:
            beside.setdefault(_owner(n), []).append(n)
    return beside


def stored_dtype(weights: Weights) -> Any:
    """The dtype config.json names (from_pretrained's dtype="auto"): the one the floating weights are stored
    in when they share one (a frozen bf16 or 4-bit base: its bf16 embeddings and norms, which an fp32 load
    would change), else float32 (the masters). bitsandbytes' packed words and their state are left out."""
    import torch

    beside = quant_entries(weights.shapes)
    quant = set(beside).union(*beside.values())
    dtypes = {d for n, (_, d) in weights.shapes.items() if d.is_floating_point and n not in quant}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _module_of(name: str) -> str:
    """The module part of a state_dict name, with its dot (`a.b.weight` -> `a.b.`; `weight` -> ``)."""
    head, dot, _ = name.rpartition(".")
    return head + dot


def _owner(name: str) -> str:
    """The weight a bitsandbytes quantisation entry belongs to (`w.absmax`, `w.quant_state.x` -> `w`; an 8-bit
    layer's `m.SCB` -> `m.weight`); "" for any other name."""
    if ".quant_state." in name:
        return name.split(".quant_state.")[0]
    head, _, tail = name.rpartition(".")
    return head if tail in QUANT_SUFFIXES else f"{head}.weight" if tail in INT8_ENTRIES else ""


def _copy_tokenizer(source: str | None, folder: Path) -> list[str]:
    import transformers

    if source and has_tokenizer(source):
        transformers.AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    elif source:
        return [(f"tokenizer not copied: {source} has none any more (pass --hf-config FOLDER of the model it "
                 "came from)")]
    else:  # a model built from a family (hf-gpt2, hf-llama) or a folder without a tokenizer
        return [f"{folder.name} has no tokenizer: none is known for this model (the hf-gpt2 / hf-llama families "
                "train on bytes, token id = byte value, and a job that fine-tunes this folder reads --data as "
                "bytes too)"]
    return []


def _prefix(state: dict, expected: set[str]) -> str:
    for prefix in PREFIXES:
        if all(k.startswith(prefix) and k[len(prefix):] in expected for k in state):
            return prefix
    unknown = sorted(k for k in state if not any(k.startswith(p) and k[len(p):] in expected for p in PREFIXES))
    raise ValueError(f"the weights do not fit this HF config's model: {len(unknown or state)} name(s) such as "
                     f"{', '.join((unknown or sorted(state))[:3])} are not among its "
                     f"{len(expected)} (e.g. {', '.join(sorted(expected)[:2])}): is the config the one "
                     "this model was trained with?")


def usual_mode(path: str | os.PathLike) -> None:
    """Give an exported file, or a folder and its files, the modes the umask gives new ones: mkdtemp
    makes folders 0700 and safetensors writes files 0600, which other users could not read."""
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    path = Path(path)
    for p in [path, *(path.iterdir() if path.is_dir() else [])]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
