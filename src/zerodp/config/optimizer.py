"""DeepSpeed's `optimizer` section, mapped onto torch.optim.

DeepSpeed builds any torch.optim class its config names (`getattr(torch.optim, type)`), and its own
Adam/AdamW (FusedAdam, CPUAdam: the same update as torch's). zerodp maps each name onto the torch
class; DeepSpeed-only optimizers (Lamb, 1-bit Adam/Lamb, 0/1 Adam, Lion, Muon, MuP's Mu*) are refused
with the reason and what to use instead, as are torch classes that cannot step on flat shards.
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any, Callable, Iterable

import torch
from pydantic import Field, field_validator, model_validator

from zerodp.config.base import _AUTO, ConfigError, _Section, _unknown_key

# torch.optim's classes a config may name (the engine steps the element-wise ones on flat shards, Adafactor and
# Muon on whole parameters: engine/stepping/optimizer_view.py). "Muon" is DeepSpeed's Muon: torch's Muon on the hidden
# matrices and AdamW on the rest (for_model).
TORCH_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
                    "ASGD", "Rprop", "Adafactor", "Muon")
# Muon's params that go to the AdamW of the other parameters (the rest go to torch.optim.Muon); adam_lr and
# adam_weight_decay default to Muon's lr and weight_decay.
_MUON_ADAMW_KEYS = {"betas": "betas", "adam_lr": "lr", "adam_eps": "eps", "adam_weight_decay": "weight_decay"}
_OPTIMIZERS = {name.lower(): name for name in TORCH_OPTIMIZERS if hasattr(torch.optim, name)}

_USE_ADAMW = "use \"AdamW\" (or \"Adam\"), or build your optimizer and pass it to initialize()"
# Lower-cased type -> why it is refused and what to use instead.
REFUSED_OPTIMIZERS = {
    "lamb": f"Lamb is DeepSpeed's own CUDA kernel (layer-wise trust ratios); {_USE_ADAMW}",
    "onebitadam": "1-bit Adam compresses DeepSpeed's gradient all-reduce, which zerodp does not do; "
                  + _USE_ADAMW,
    "zerooneadam": "0/1 Adam compresses DeepSpeed's gradient all-reduce, which zerodp does not do; "
                   + _USE_ADAMW,
    "onebitlamb": "1-bit Lamb compresses DeepSpeed's gradient all-reduce, which zerodp does not do; "
                  + _USE_ADAMW,
    "lion": f"Lion is DeepSpeed's own kernel and not in torch.optim; {_USE_ADAMW}",
    "muadam": f"MuAdam needs the mup package's parametrisation; {_USE_ADAMW} with your own per-group lrs",
    "muadamw": f"MuAdamW needs the mup package's parametrisation; {_USE_ADAMW} with your own per-group lrs",
    "musgd": "MuSGD needs the mup package's parametrisation; use \"SGD\" with your own per-group lrs",
    "fusedadam": "FusedAdam is DeepSpeed's kernel of Adam, not a config type; write \"Adam\" or \"AdamW\"",
    "cpuadam": "CPUAdam is DeepSpeed's kernel of Adam, not a config type; write \"Adam\" or \"AdamW\" "
               "(with zero_optimization.offload_optimizer it steps on the CPU)",
    "sparseadam": "SparseAdam steps sparse gradients, and ZeRO's gradient buckets are dense; use \"Adam\"",
    "lbfgs": "LBFGS needs a closure that re-evaluates the loss at each step, which engine.step() does not "
             "take; use a first-order optimizer such as \"AdamW\"",
}


class OptimizerConfig(_Section):
    """DeepSpeed's `optimizer` section, mapped onto the torch.optim class of the same name."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    # DeepSpeed's fp16 optimizer picks its legacy fused kernel with this: a kernel choice, no effect here.
    legacy_fusion: bool = False

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        reason = REFUSED_OPTIMIZERS.get(name.lower())
        if reason is not None:
            raise ValueError(f"not supported by zerodp: {reason}")
        if name.lower() not in _OPTIMIZERS:
            raise ValueError(f"supported optimizers are {', '.join(_OPTIMIZERS.values())}")
        return _OPTIMIZERS[name.lower()]

    @model_validator(mode="after")
    def _params_fit(self) -> OptimizerConfig:
        self._torch_class_and_kwargs()
        return self

    def _torch_class_and_kwargs(self, kwargs: dict[str, Any] | None = None
                                ) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        if self.type == "Muon" and kwargs is None:  # both halves checked; the Muon half returned
            muon, adamw = self._muon_kwargs()
            self._checked(torch.optim.AdamW, adamw, "AdamW")
            return self._checked(torch.optim.Muon, muon, "Muon")
        kwargs = dict(self.params) if kwargs is None else kwargs
        cls = getattr(torch.optim, self.type)
        if self.type in ("Adam", "AdamW"):
            kwargs.pop("torch_adam", None)  # DeepSpeed's choice of kernel; torch's is the only one here
            # DeepSpeed's adam_w_mode defaults to True: its "Adam" decays weights the AdamW way
            # unless the config opts out, so "Adam" + weight_decay means torch.optim.AdamW.
            w_mode = kwargs.pop("adam_w_mode", True) or self.type == "AdamW"
            cls = torch.optim.AdamW if w_mode else torch.optim.Adam
            # FusedAdam's bias_correction: torch's Adam always corrects, which is FusedAdam's default.
            if kwargs.pop("bias_correction", True) is not True:
                raise ConfigError("config key 'optimizer.params.bias_correction' = false is not supported: "
                                  "torch's Adam always corrects the moments' bias; remove the key")
        if "max_grad_norm" in kwargs:
            raise ConfigError("config key 'optimizer.params.max_grad_norm' is not supported; "
                              "use the top-level key 'gradient_clipping'")
        return self._checked(cls, kwargs, self.type)

    def _checked(self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], name: str
                 ) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        """cls and kwargs, every key known to cls and every value of the right form and accepted by torch."""
        for key, value in kwargs.items():
            if isinstance(value, str) and value == "auto":
                raise ConfigError(f"config key 'optimizer.params.{key}' = \"auto\": {_AUTO} a number")
        signature = {k: v.default for k, v in inspect.signature(cls).parameters.items() if k != "params"}
        known = list(signature)
        unknown = [_unknown_key(f"optimizer.params.{k}", known) + f" (optimizer {name}, "
                   f"torch.optim.{cls.__name__})" for k in kwargs if k not in known]
        problems = unknown or [p for k, v in kwargs.items() if (p := _value_problem(k, v, signature[k]))]
        if problems:
            raise ConfigError("\n".join(problems))
        error = _torch_rejects(cls, kwargs)  # ranges are torch's own checks, run at load
        if error is not None:
            # Name the key when torch rejects it alone (torch's message says "learning rate", not "lr").
            key = next((k for k in kwargs if _torch_rejects(cls, {k: kwargs[k]}) is not None), None)
            where = ("'optimizer.params'" if key is None else
                     f"'optimizer.params.{key}' = {json.dumps(kwargs[key], default=repr)}")
            raise ConfigError(f"config key {where} rejected by torch.optim.{cls.__name__}: {error}")
        return cls, kwargs

    def _muon_kwargs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """DeepSpeed's Muon params split into torch.optim.Muon's and the AdamW's (_MUON_ADAMW_KEYS)."""
        muon = {k: v for k, v in self.params.items() if k not in _MUON_ADAMW_KEYS}
        adamw = {"lr": muon.get("lr", 1e-3), "weight_decay": muon.get("weight_decay", 0.1)}
        adamw.update({_MUON_ADAMW_KEYS[k]: v for k, v in self.params.items() if k in _MUON_ADAMW_KEYS})
        return muon, adamw

    def for_model(self, module: torch.nn.Module) -> Callable[[list], torch.optim.Optimizer] | list[torch.optim.Optimizer]:
        """What zerodp.initialize uses when given no optimizer: a factory params -> Optimizer (build); for
        "Muon", DeepSpeed's split, built on the model: torch.optim.Muon on the hidden matrices (muon_params),
        AdamW on the rest."""
        if self.type != "Muon":
            return self.build
        muon, adamw = self._muon_kwargs()
        hidden, rest = muon_params(module)
        built = [torch.optim.Muon(hidden, **muon)] if hidden else []
        return built + ([torch.optim.AdamW(rest, **adamw)] if rest else [])

    def build(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> torch.optim.Optimizer:
        cls, kwargs = self._torch_class_and_kwargs()
        groups = list(params)
        tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
        # Adam(W): one fused kernel over each flat master shard (DeepSpeed's FusedAdam on GPUs, its
        # CPUAdam for offload), unless the config picks foreach or fused itself. On the CPU the
        # foreach form allocates full-size temporaries every step, which on one flat shard of millions
        # of elements costs more in fresh pages than the arithmetic (5 ms fused vs 30 ms, 4.9M).
        if (cls in (torch.optim.Adam, torch.optim.AdamW) and "fused" not in kwargs and "foreach" not in kwargs
                and fused_adam_fits(tensors)):
            kwargs["fused"] = True
        return cls(groups, **kwargs)


def muon_params(module: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The trainable parameters Muon steps (the hidden matrices) and the rest, as DeepSpeed tags them: a
    parameter's own `use_muon` attribute where set; else 2-D, and neither an embedding's table (nor a head
    tied to one) nor the output head (a parameter whose name has "lm_head", or a module named "head")."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    hidden, rest = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        head = "lm_head" in name or name.rsplit(".", 2)[0].split(".")[-1] == "head"
        use = getattr(p, "use_muon", None)
        use = (p.dim() == 2 and id(p) not in tables and not head) if use is None else bool(use)
        (hidden if use else rest).append(p)
    return hidden, rest


def fused_adam_fits(tensors: list[torch.Tensor]) -> bool:
    """Whether Adam(W) over these tensors takes torch's fused kernel: on CUDA and the CPU, where the
    engine keeps the fp32 master shards it steps (build's comment says why fused on the CPU too)."""
    return bool(tensors) and all(t.device.type in ("cuda", "cpu") for t in tensors)


def _torch_rejects(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> Exception | None:
    """torch's own error for these arguments, built on a one-element dummy; None when it accepts them."""
    try:
        cls([torch.zeros(1, 1, requires_grad=True)], **kwargs)  # 2-D: Muon takes nothing else
    except (TypeError, ValueError, RuntimeError) as e:
        return e
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _value_problem(key: str, value: Any, default: Any) -> str | None:
    """What is wrong with `value` for a torch.optim argument whose default is `default`, typed as JSON
    would write that default (torch checks ranges itself, but takes inf, True for 1, and fails on a
    tuple of the wrong length with an IndexError of its own); None when it has the right form."""
    if isinstance(default, bool):
        ok, form = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok, form = _is_number(value), "a finite number (not a string or a boolean)"
    elif isinstance(default, tuple):
        ok = (isinstance(value, (list, tuple)) and len(value) == len(default)
              and all(_is_number(v) or (d is None and v is None) for v, d in zip(value, default)))
        form = f"a list of {len(default)} finite numbers, like {json.dumps(list(default))}"
    elif default is None:
        ok, form = value is None or isinstance(value, bool), "true, false or null"
    else:
        return None
    if ok:
        return None
    return f"config key 'optimizer.params.{key}' = {json.dumps(value, default=repr)}: expected {form}"
