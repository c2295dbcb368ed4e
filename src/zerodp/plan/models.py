"""The model `zerodp estimate` plans for, from what a user has at hand:

  a GPT size (tiny, small, 125M ... 13B) or a JSON file of GPTConfig fields (optionally "size": base);
  a Hugging Face model folder or its config.json (AutoConfig -> AutoModelForCausalLM.from_config);
  `module:factory` (or `path/file.py:factory`), a function returning an nn.Module, or (module, inputs)
      whose `module(*inputs)` returns the loss (or an output with .loss): then a step can be measured.

A PlanModel is plain data (kind, ref, fields), so it travels to the measuring subprocess as JSON, and
it is built there on meta or fake tensors: nothing of the model's size is ever allocated. `scaled`
gives the same family at another width and depth, for `estimate --fit`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from zerodp.models.hf_folder import WIDTH_KEYS, hidden_size

# Hugging Face config keys of depth, of the widths that follow the width, and of heads, by the names
# families use (the width's own: hf_folder.WIDTH_KEYS).
_HF_DEPTH = ("num_hidden_layers", "n_layer", "num_layers")
_HF_FOLLOW = ("intermediate_size", "n_inner", "ffn_dim", "moe_intermediate_size")
_HF_HEADS = ("num_attention_heads", "n_head")


_COUNTS: dict[tuple[str, str, str], int] = {}  # parameter counts of the configs built so far


class PlanModelError(ValueError):
    """--model names nothing estimate can build; the message says what it accepts."""


@dataclass
class PlanModel:
    kind: str  # "gpt" | "hf" | "factory"
    ref: str  # what the user gave
    fields: dict[str, Any] = field(default_factory=dict)  # GPTConfig fields / the HF config dict

    # ---- what the user gave -> a PlanModel ----------------------------------------------------
    @classmethod
    def parse(cls, ref: str) -> PlanModel:
        from zerodp.models.sizes import SIZES

        if ref in SIZES:
            return cls("gpt", ref, {**_gpt_defaults(), **SIZES[ref]})
        path = Path(ref)
        if path.is_dir() or path.name == "config.json":
            config = path / "config.json" if path.is_dir() else path
            if not config.is_file():
                raise PlanModelError(f"--model {ref!r}: a Hugging Face folder must hold config.json")
            return cls("hf", ref, json.loads(config.read_text()))
        if path.suffix == ".json" and path.is_file():
            fields = json.loads(path.read_text())
            base = fields.pop("size", None)
            if base is not None and base not in SIZES:
                raise PlanModelError(f"{ref}: \"size\": {base!r} is not one of {', '.join(SIZES)}")
            return cls("gpt", ref, {**_gpt_defaults(), **(SIZES[base] if base else {}), **fields})
        if ":" in ref and not path.exists():
            return cls("factory", ref)
        raise PlanModelError(f"--model {ref!r}: expected a GPT size ({', '.join(SIZES)}), a JSON file of GPTConfig "
                             "fields, a Hugging Face folder or config.json, or module:factory")

    # ---- building (call under torch.device("meta") or FakeTensorMode) ------------------------
    def build(self):
        """(module, loss_of(micro_batch, seq, device) -> inputs or None); inputs: module(*inputs) -> loss."""
        if self.kind == "gpt":
            from zerodp.models.gpt import GPT, GPTConfig
            model = GPT(GPTConfig(**self.fields))
            return model, _token_batch(self.fields["vocab_size"])
        if self.kind == "hf":
            import transformers

            from zerodp.models.build import HFCausalLM
            fields = dict(self.fields)
            config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
            model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config))
            return model, _token_batch(config.vocab_size)
        made = _import_factory(self.ref)()
        if isinstance(made, tuple):
            module, inputs = made
            return module, (lambda micro_batch, seq, device: tuple(inputs))
        return made, None

    def num_params(self) -> int:
        """Ψ, tied parameters once. GPT and HF configs: from 1- and 2-layer builds (parameters grow by
        the same block per layer), so a 100-layer candidate of --fit costs two small meta builds."""
        depth = self._depth_key()
        if depth is None or self.fields[depth] <= 2:
            return self._count()
        one, two = (dataclasses.replace(self, fields={**self.fields, depth: n})._count() for n in (1, 2))
        return one + (self.fields[depth] - 1) * (two - one)

    def largest_module(self) -> int:
        """Elements of the largest stage-3 unit (engine/layout/units.py's default: a block, or the model's own
        parameters), which a stage-3 bucket never splits (tied weights once)."""
        import torch

        from zerodp.engine.layout.units import find_units
        with torch.device("meta"):
            model, _ = self.build()
        units = find_units(model, "blocks")
        return max(units.numel(list(model.parameters())).values(), default=0)

    def _count(self) -> int:
        key = (self.kind, self.ref if self.kind == "factory" else "", json.dumps(self.fields, sort_keys=True))
        if key not in _COUNTS:  # a meta build still runs every init op (~0.1 s): --fit asks again and again
            import torch
            with torch.device("meta"):
                model, _ = self.build()
            _COUNTS[key] = sum({id(p): p.numel() for p in model.parameters()}.values())
        return _COUNTS[key]

    def _depth_key(self) -> str | None:
        keys = ("n_layer",) if self.kind == "gpt" else _HF_DEPTH if self.kind == "hf" else ()
        return next((k for k in keys if k in self.fields), None)

    # ---- shape, for the activation estimate and --fit ----------------------------------------
    def shape(self) -> SimpleNamespace | None:
        """n_layer, n_embd, n_head, vocab_size, block_size; None for a factory (its shape is unknown)."""
        f = self.fields
        if self.kind == "gpt":
            return SimpleNamespace(**{k: f[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size")})
        if self.kind == "hf":
            get = lambda keys, default=None: next((f[k] for k in keys if k in f), default)  # noqa: E731
            return SimpleNamespace(n_layer=get(_HF_DEPTH), n_embd=hidden_size(f), n_head=get(_HF_HEADS),
                                   vocab_size=f.get("vocab_size"),
                                   block_size=get(("max_position_embeddings", "n_positions"), 1024))
        return None

    def scaled(self, factor: float) -> PlanModel:
        """The same family with width and depth both times `factor` (heads keep their size)."""
        if self.kind == "factory":
            raise PlanModelError("--fit scales a GPT or Hugging Face config; a factory's shape is unknown")
        f = dict(self.fields)
        width_keys = ("n_embd",) if self.kind == "gpt" else WIDTH_KEYS
        depth_keys = ("n_layer",) if self.kind == "gpt" else _HF_DEPTH
        heads_keys = ("n_head",) if self.kind == "gpt" else _HF_HEADS
        width_key = next(k for k in width_keys if k in f)
        heads_key = next(k for k in heads_keys if k in f)
        head_dim = f.get("head_dim") or f[width_key] // f[heads_key]
        heads = max(1, round(f[heads_key] * factor))
        kv = f.get("num_key_value_heads")
        if kv:  # grouped-query attention keeps its group size where it can
            group = max(1, f[heads_key] // kv)
            heads = max(group, heads // group * group)
            f["num_key_value_heads"] = heads // group
        width = heads * head_dim
        for key in _HF_FOLLOW:
            if f.get(key):
                f[key] = max(1, round(f[key] * width / f[width_key]))
        f[width_key], f[heads_key] = width, heads
        for key in depth_keys:
            if key in f:
                f[key] = max(1, round(f[key] * factor))
        return dataclasses.replace(self, fields=f, ref=f"{self.ref} x{factor:.2f}")

    def title(self) -> str:
        s = self.shape()
        return self.ref if s is None else f"{self.ref} ({s.n_layer} layers x {s.n_embd} wide)"


def _gpt_defaults() -> dict[str, Any]:
    # GPTConfig's own defaults, read without importing torch (train.model imports it)
    return dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=True,
                loss_chunk=0)


def _token_batch(vocab: int):
    def inputs(micro_batch: int, seq: int, device):
        import torch
        x = torch.randint(0, vocab, (micro_batch, seq), device=device)
        return x, torch.randint(0, vocab, (micro_batch, seq), device=device)
    return inputs


def _import_factory(ref: str):
    module_name, _, name = ref.rpartition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or not Path(module_name).is_file():
                raise FileNotFoundError(module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, ".")  # as `python -m` would find a module of the current directory
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as e:
        raise PlanModelError(f"--model {ref!r}: cannot import {module_name!r}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise PlanModelError(f"--model {ref!r}: {module_name!r} has no function {name!r}")
    return factory
