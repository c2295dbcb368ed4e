"""Hugging Face model folders (what `save_pretrained` writes): read one to fine-tune, write one from
trained weights. The one place that knows the folder format; transformers is imported on use only.

In: `model_from_config` (the folder's AutoModelForCausalLM in fp32, its weights left to
`zerodp.initialize(..., weights=folder)`, which reads each rank's share of them), `load_tokenizer` (the
folder's, when it has one) and `tokenize` (text per line, concatenated, as HF's run_clm example does). Out: `write_folder` builds the
model of a recorded config on the meta device, assigns the trained fp32 tensors to it (a wrapper's
`model.` prefix stripped) and lets `save_pretrained` write config.json, generation_config.json and
model.safetensors with HF's own key names and tied weights (GPT-2's lm_head is not stored: HF re-ties
it on load); the tokenizer is copied through `AutoTokenizer`. What a checkpoint records to make this
possible later (`zerodp consolidate --hf`) is `description(model, tokenizer_from)`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

CONFIG = "config.json"
# Any of these makes a folder's tokenizer loadable by AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Prefixes a trained state dict may carry before HF's own names: zerodp's HFCausalLM (`model.`),
# a DDP/DeepSpeed-style wrapper (`module.`).
PREFIXES = ("", "model.", "module.", "module.model.")
# The names families give a model's width in config.json; a config object answers to `hidden_size`
# under any of them (transformers' attribute_map), a config.json dict does not.
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")


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
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path!r}: cannot build a causal LM from this folder: {e}") from None


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


def write_folder(out: str | os.PathLike, state: dict, description: dict[str, Any]) -> list[str]:
    """Write `state` (full fp32 tensors, HF names with or without a wrapper prefix) as an HF folder
    at `out`, replacing what is there; returns notes for the user (a tokenizer not copied)."""
    import torch
    import transformers
    from transformers.utils import logging

    info = dict(description["config"])
    config = transformers.AutoConfig.for_model(info.pop("model_type"), **info)
    config.dtype = torch.float32  # what is stored: the fp32 master weights
    with torch.device("meta"):  # no memory, no init: every tensor comes from `state`
        model = transformers.AutoModelForCausalLM.from_config(config)
    _assign(model, state)
    if description.get("generation_config"):
        model.generation_config = transformers.GenerationConfig.from_dict(description["generation_config"])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    notes = []
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))  # renamed into place when whole
    bar = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # "Writing model shards" of a one-file model is noise
    try:
        model.save_pretrained(tmp)
        source = description.get("tokenizer")
        if source and has_tokenizer(source):
            transformers.AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
        elif source:
            notes.append(f"tokenizer not copied: {source} has none any more (pass --hf-config FOLDER "
                         "of the model it came from)")
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


def _assign(model, state: dict) -> None:
    """Give the meta-device `model` the tensors of `state`; every weight it stores must come from
    there (tied ones excepted), and nothing else may be there."""
    expected = set(model.state_dict())
    prefix = _prefix(state, expected)
    named = {k[len(prefix):]: v for k, v in state.items()}
    try:
        model.load_state_dict(named, strict=False, assign=True)
    except RuntimeError as e:  # a shape that differs: another size of the same architecture
        raise ValueError(f"the weights do not fit this HF config's model: {e}") from None
    model.tie_weights()  # a tied head (GPT-2's lm_head) shares the embedding, stored once
    missing = sorted(k for k, v in model.state_dict().items() if v.is_meta)
    if missing:
        raise ValueError(f"the weights miss {len(missing)} tensor(s) of this HF config's model, e.g. "
                         f"{', '.join(missing[:3])}: is the config the one this model was trained with?")


def _prefix(state: dict, expected: set[str]) -> str:
    for prefix in PREFIXES:
        if all(k.startswith(prefix) and k[len(prefix):] in expected for k in state):
            return prefix
    unknown = sorted(k for k in state if not any(k.startswith(p) and k[len(p):] in expected for p in PREFIXES))
    raise ValueError(f"the weights do not fit this HF config's model: {len(unknown or state)} name(s) such as "
                     f"{', '.join((unknown or sorted(state))[:3])} are not among its "
                     f"{len(expected)} (e.g. {', '.join(sorted(expected)[:2])}): is the config the one "
                     "this model was trained with?")
