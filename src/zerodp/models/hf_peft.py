"""PEFT models (Hugging Face's adapter library) whose base is built on meta and read from its own files:

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model = get_peft_model(base, LoraConfig(...), low_cpu_mem_usage=True)
    engine = zerodp.initialize(model, optimizer, config, weights=folder)

The one place that knows PEFT's names. zerodp.initialize asks it `weight_names(model)` (for `weights=`)
and `init_fn(model, ...)` (its default param_init_fn); the engine never learns them. peft is never
imported here: a model of its classes has imported it.

  names   PEFT renames the base's parameters: `base_model.model.` before them (PeftModel -> LoraModel ->
          the model), `.base_layer` inside a wrapped layer (the base's `q_proj.weight` is
          `q_proj.base_layer.weight`), and modules_to_save's `.original_module` / `.modules_to_save.<adapter>`
          (both copies of the base's module). `alias` maps each back to the base's name. The adapter's own
          parameters (`lora_A.default.weight`, ...) no base file holds: they are `optional`, and the engine
          takes those the files lack from their initialisers.
  values  LoRA's initialiser as `LoraLayer.update_layer` draws it: it builds lora_A = nn.Linear(in, r) and
          lora_B = nn.Linear(r, out) (each draws torch's default init), then `reset_lora_parameters` draws A
          again (kaiming_uniform(a=sqrt(5)), or normal(std 1/r) for init_lora_weights="gaussian") and zeroes B,
          so that the untrained adapter adds nothing. Replayed module by module (lora_A's run draws both
          constructions and the reset; lora_B's draws nothing), from the random state get_peft_model would
          have started from, the values are a whole build's bit for bit: with low_cpu_mem_usage=True (or
          get_peft_model inside the meta block) PEFT builds the adapter on meta and draws nothing, so that
          state is the one zerodp.initialize finds. With PEFT's default, get_peft_model on a meta base draws
          the adapter on CPU and moves it to meta, dropping the values; zerodp then draws it the same way
          from the state after: B zero, A as PEFT draws it, but not the whole build's numbers.
  export  `split_adapter`: a PEFT model's weights as the base model's (its model folder, bitsandbytes' packed
          words and quantisation state included) and the adapter's (PEFT's adapter files), which
          export_engine.save_hf writes into one folder: transformers' from_pretrained loads a folder holding
          a model and an adapter as the model with the adapter on it.
  refused The initialisers that read the base's weights (PiSSA, OLoRA, LoftQ, DoRA's magnitude, ...) and
          LoRA on embeddings or convolutions, on meta: an error naming the parameter, before any collective.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from zerodp.engine.sharding.weights import Weights

REPLAYED = (True, False, "gaussian")  # init_lora_weights values whose draws init_fn replays


def _peft():
    """The peft package, when something imported it (a PEFT model has)."""
    return sys.modules.get("peft")


def _tuner_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    peft = _peft()
    if peft is None:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper))]


def weight_names(model: nn.Module) -> tuple[Callable[[str], str] | None, frozenset[str]]:
    """(alias: a parameter's name in the base model's files, the adapter parameters no such file holds)
    for a PEFT model; (None, empty) for any other model."""
    layers = _tuner_layers(model)
    if not layers:
        return None, frozenset()
    renames: dict[str, str] = {}  # a wrapper's inner path -> the base module's path, innermost first
    optional: set[str] = set()
    for path, m in sorted(layers, key=lambda item: -len(item[0])):
        own = m.adapter_layer_names
        if hasattr(m, "original_module"):  # modules_to_save: its copies are the base module's too
            renames[f"{path}.original_module."] = f"{path}."
            renames.update({f"{path}.modules_to_save.{a}.": f"{path}." for a in m.modules_to_save})
            own = ()
        else:
            renames[f"{path}.base_layer."] = f"{path}."
        optional |= {n for n, _ in m.named_parameters(prefix=path) if any(n.startswith(f"{path}.{a}.") for a in own)}
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    prefix = next(f"{n}." if n else "" for n, m in model.named_modules() if m is inner)

    def alias(name: str) -> str:
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
        return name[len(prefix):] if name.startswith(prefix) else name
    return alias, frozenset(optional)


def init_fn(model: nn.Module, fallback: Callable[[nn.Module], None] | None,
            initialised: set[str] | None = None) -> Callable[[nn.Module], None] | None:
    """zerodp.initialize's default param_init_fn for a PEFT model with LoRA adapters on meta: each lora_A /
    lora_B module initialised as PEFT does (module doc), any other module by `fallback` (Hugging Face's
    initialiser, init_fn of hf_folder) or its reset_parameters(). `fallback` unchanged for any other model.
    Raises ValueError, naming the parameter, for an adapter parameter on meta whose initialiser is not
    replayed and that is to be initialised: one of `initialised` (the names the weights leave to the
    initialisers; None: no weights, every parameter on meta)."""
    lora: dict[int, tuple[nn.Module, str, str, object]] = {}  # id(lora_A/B module) -> (layer, adapter, which, init)
    for path, layer in _tuner_layers(model):
        for which in ("lora_A", "lora_B"):
            for adapter, m in getattr(layer, which, {}).items():
                if any(p.is_meta for p in m.parameters()):
                    lora[id(m)] = (layer, adapter, which, _init_lora_weights(model, adapter))
        _refuse_unreplayed(path, layer, lora, initialised)
    if not lora:
        return fallback

    def init(module: nn.Module) -> None:
        found = lora.get(id(module))
        if found is not None:
            _lora_init(*found)
        elif fallback is not None:
            fallback(module)
        else:
            module.reset_parameters()
    return init


def _init_lora_weights(model: nn.Module, adapter: str) -> object:
    configs = next((m.peft_config for m in model.modules() if isinstance(getattr(m, "peft_config", None), dict)), {})
    return getattr(configs.get(adapter), "init_lora_weights", True)


def _refuse_unreplayed(path: str, layer: nn.Module, lora: dict, initialised: set[str] | None) -> None:
    """A meta adapter parameter of `layer` to initialise that init_fn does not give as PEFT does: a
    ValueError naming it. (Names are the model's only under a PeftModel's own prefix: `path` is.)"""
    replayed = {id(m) for m in layer.modules() if id(m) in lora}
    for name, p in layer.named_parameters(prefix=path):
        if not p.is_meta or (initialised is not None and name not in initialised) or any(
                f".{w}." in name for w in ("base_layer", "original_module", "modules_to_save")):
            continue
        owner = next((m for m in layer.modules() if any(q is p for q in m.parameters(recurse=False))), None)
        found = lora.get(id(owner))
        why = None
        if id(owner) not in replayed or not isinstance(owner, nn.Linear):
            why = f"it is a {type(layer).__name__} adapter parameter zerodp has no initialiser for"
        elif found[3] not in REPLAYED:
            why = f"init_lora_weights={found[3]!r} reads the base's weights"
        elif getattr(layer, "use_dora", {}).get(found[1]) or found[1] in getattr(layer, "lora_variant", {}):
            why = "a LoRA variant (DoRA, ...) initialises it from the base's weights"
        if why is not None:
            raise ValueError(f"PEFT parameter '{name}' is on the 'meta' device and {why}; zerodp initialises "
                             f"LoRA on nn.Linear with init_lora_weights in {REPLAYED}. Build the adapter off "
                             "meta (get_peft_model on a model built whole), or pass zerodp.initialize(..., "
                             "param_init_fn=fn) with fn(module) initialising it")


def _lora_init(layer: nn.Module, adapter: str, which: str, how: object) -> None:
    """One of lora_A / lora_B (CPU stand-ins in place) given PEFT's values, drawn in PEFT's order."""
    a, b = layer.lora_A[adapter], layer.lora_B[adapter]
    if which == "lora_A":
        built = nn.Linear(a.in_features, a.out_features, bias=False, device="cpu")  # update_layer's lora_A
        if how is not False:
            nn.Linear(b.in_features, b.out_features, bias=b.bias is not None, device="cpu")  # its lora_B: zeroed
            if how is True:  # reset_lora_parameters
                nn.init.kaiming_uniform_(built.weight, a=math.sqrt(5))
            else:
                nn.init.normal_(built.weight, std=1 / layer.r[adapter])
        a.weight.copy_(built.weight)
    elif how is False:  # lora_B as built: drawn here, right after lora_A's construction
        built = nn.Linear(b.in_features, b.out_features, bias=b.bias is not None, device="cpu")
        for n, p in b.named_parameters(recurse=False):
            p.copy_(getattr(built, n))
    else:  # reset_lora_parameters: zero, so that the untrained adapter adds nothing
        for p in b.parameters(recurse=False):
            p.zero_()


def peft_names(names: Iterable[str]) -> list[str]:
    """The names among `names` that only a PEFT model has (its wrapper's `base_model.model.` before them)."""
    return [n for n in names if n.startswith("base_model.model.")]


def split_adapter(model: nn.Module, weights: Weights, keep: bool = True
                  ) -> tuple[Weights, dict[str, torch.Tensor]] | None:
    """For a PEFT model, its weights as two: the base model's (under the base's own names, what its model
    folder holds: `alias`; modules_to_save's trained copies left out) and a dict that fills, as that stream is
    read, with the adapter's entries under the model's names (what `model.save_pretrained(dir,
    state_dict=...)` writes as PEFT's adapter files: the adapter is small, held whole, copied out of the
    stream's buckets; only when `keep`: the rank that writes). None for any other model."""
    from zerodp.engine.sharding.weights import Weights

    alias, optional = weight_names(model)
    if alias is None:
        return None
    adapter = {n for n in weights.shapes if n in optional or ".modules_to_save." in n}
    renamed = {n: alias(n) for n in weights.shapes if n not in adapter}
    ties = {renamed[a]: renamed[n] for a, n in weights.ties.items() if a in renamed and n in renamed}
    kept: dict[str, torch.Tensor] = {}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights.stream:
            if name in adapter:
                if keep:
                    kept[name] = t.clone()  # a view of a gathered bucket: held, it would keep the bucket alive
            else:
                yield renamed[name], t
            del t
    return Weights({renamed[n]: v for n, v in weights.shapes.items() if n in renamed}, ties, stream()), kept
