"""`"auto"` in a DeepSpeed config: filled from what the caller knows, or an error naming the key.

Hugging Face's Trainer writes "auto" for the values it owns (optimizer hyperparameters, batch sizes,
clipping, precision, schedule lengths, bucket sizes) and fills them before DeepSpeed reads the config.
`resolve_auto` is that pre-pass on the raw dict, for `zerodp.deepspeed.initialize` (which knows the
optimizer, the model and the world size) and `zerodp train --ds-config` (which knows its options).

`known` uses these names (any may be missing):
  lr, betas, eps, weight_decay        optimizer.params.* and the schedulers' peak lr
  warmup_min_lr, warmup_num_steps, total_num_steps, ...   scheduler.params.* by their own name
  train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size, world_size
  gradient_clipping, fp16, bf16       (the last two: whether that precision is enabled)
  hidden_size                         the model's width, for the ZeRO bucket sizes (as Hugging Face:
                                      reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
                                      stage3_param_persistence_threshold = 10*h); without it those
                                      keys take zerodp's defaults (zerodp.config.ZeroConfig)
A batch size left "auto" that is not known is derived by DeepSpeed's rule train = micro x accumulation
x world from the others, as if absent. Any other "auto" that nothing knows raises ConfigError.
"""

from __future__ import annotations

import copy
from typing import Any

from zerodp.config.base import ConfigError

AUTO = "auto"
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Hugging Face's Trainer always starts a warmup from 0.
_DEFAULTS = {"warmup_min_lr": 0.0}


def bucket_sizes(hidden: int) -> dict[str, int]:
    """Hugging Face's rule (transformers.integrations.deepspeed) for ZeRO's "auto" sizes from the width."""
    return {"reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


def resolve_auto(config: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` with every "auto" replaced by a known value (or removed where zerodp's
    default or the batch arithmetic decides); ConfigError naming the keys that nothing knows."""
    out = copy.deepcopy(config)
    known = {**_DEFAULTS, **{k: v for k, v in known.items() if v is not None}}
    missing: list[str] = []
    _batch(out, known, missing)
    if out.get("gradient_clipping") == AUTO:
        _fill(out, "gradient_clipping", known, "gradient_clipping", "gradient_clipping", missing)
    for precision in ("fp16", "bf16"):
        section = out.get(precision)
        if isinstance(section, dict) and section.get("enabled") == AUTO:
            _fill(section, "enabled", known, precision, f"{precision}.enabled", missing)
    for name in ("optimizer", "scheduler"):
        params = out[name].get("params") if isinstance(out.get(name), dict) else None
        if not isinstance(params, dict):
            continue  # a section or params of another JSON type: load_config refuses it, naming the key
        for key, value in params.items():
            if value == AUTO:
                source = "lr" if key == "warmup_max_lr" else key
                _fill(params, key, known, source, f"{name}.params.{key}", missing)
    zero = out.get("zero_optimization")
    if isinstance(zero, dict):
        sizes = bucket_sizes(int(known["hidden_size"])) if "hidden_size" in known else {}
        for key in [k for k, v in zero.items() if v == AUTO]:
            if key in bucket_sizes(1):
                if key in sizes:
                    zero[key] = sizes[key]
                else:
                    del zero[key]  # zerodp's default (documented in the module docstring)
            else:
                missing.append(f"zero_optimization.{key}")
    missing += _remaining(out, "")
    if missing:
        raise ConfigError("\n".join(
            f"config key {key!r} = \"auto\": nothing here knows its value (\"auto\" is filled by Hugging "
            "Face's Trainer); give the value itself" for key in dict.fromkeys(missing)))
    return out


def _fill(section: dict, key: str, known: dict, source: str, path: str, missing: list[str]) -> None:
    if source in known:
        value = known[source]
        section[key] = list(value) if isinstance(value, tuple) else value
    else:
        missing.append(path)


def _batch(out: dict, known: dict, missing: list[str]) -> None:
    """Known batch sizes replace "auto"; the rest are dropped for the batch arithmetic to derive."""
    autos = [k for k in _BATCH if out.get(k) == AUTO]
    for key in autos:
        if key in known:
            out[key] = known[key]
        elif key == "train_batch_size" and {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                            "world_size"} <= known.keys():
            out[key] = (known["train_micro_batch_size_per_gpu"] * known["gradient_accumulation_steps"]
                        * known["world_size"])
        else:
            del out[key]
    if autos and not any(k in out for k in _BATCH[:2]):
        missing.extend(k for k in autos if k != "gradient_accumulation_steps")


def _remaining(node: Any, path: str) -> list[str]:
    """Dotted paths of the "auto" values no rule above handles."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _remaining(v, f"{path}.{k}" if path else k)]
    return [path] if node == AUTO else []
