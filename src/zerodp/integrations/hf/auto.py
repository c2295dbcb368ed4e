"""A zerodp config completed from Hugging Face `TrainingArguments`, as the Trainer does for DeepSpeed.

Hugging Face's DeepSpeed integration (transformers/integrations/deepspeed.py, `trainer_config_process`
and `trainer_config_finalize`) replaces every `"auto"` value of a ds_config with the matching
`TrainingArguments` value and refuses a concrete value that contradicts it. This module applies the
same table to a zerodp config, with one difference: the batch sizes, gradient clipping and precision,
which the Trainer's own loop and the plain Trainer's results depend on, are also filled when absent
(DeepSpeed would fall back on its defaults there, silently ignoring e.g. `max_grad_norm`).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from torch import nn

from zerodp.config import ConfigError, read_config_file
from zerodp.config.auto import bucket_sizes
from zerodp.models.hf_folder import hidden_size

_ABSENT = object()


def fill_from_training_args(config: dict[str, Any] | str | os.PathLike[str] | None, args: Any, world_size: int,
                            max_steps: int, model: nn.Module | None = None) -> dict[str, Any]:
    """`config` (a DeepSpeed-style dict or JSON file; None is {}) with its "auto" values replaced.

    args: the Trainer's `TrainingArguments`; world_size: the data-parallel ranks; max_steps: the
    optimizer steps of the run (the scheduler's total_num_steps). Raises ConfigError listing every
    value that contradicts `args`. The input is not modified.
    """
    filled = _as_dict(config)
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    mismatches: list[str] = []

    def fill(path: str, value: Any, hf_key: str, if_absent: bool = False, must_match: bool = True) -> None:
        problem = _fill(filled, path, value, if_absent, must_match)
        if problem is not None:
            mismatches.append(f"- config key {path!r} = {json.dumps(problem)} but TrainingArguments {hf_key} = "
                              f"{json.dumps(value)}")

    fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", if_absent=True)
    fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps", if_absent=True)
    fill("train_batch_size", micro * gas * world_size,
         f"per_device_train_batch_size x gradient_accumulation_steps x world size {world_size}", if_absent=True)
    fill("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm", if_absent=True)
    fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval", if_absent=True)
    fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval", if_absent=True)
    fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2")
    fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_min_lr", 0.0, "(none)", must_match=False)
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill("scheduler.params.total_num_steps", max_steps, "max_steps (the run's optimizer steps)")
    fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(max_steps)), "warmup_steps")
    _fill_bucket_sizes(filled, model)
    if mismatches:
        raise ConfigError("the zerodp config contradicts the TrainingArguments:\n" + "\n".join(mismatches)
                          + "\nset these keys to \"auto\" (or leave them out where allowed) to take the "
                          "TrainingArguments values")
    return filled


def _as_dict(config: dict[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        config = read_config_file(config)
    if not isinstance(config, dict):
        raise ConfigError(f"the zerodp config must be a dict or a JSON file path, got {type(config).__name__}")
    return copy.deepcopy(config)


def _fill(config: dict[str, Any], path: str, value: Any, if_absent: bool, must_match: bool) -> Any:
    """Set `path` to `value` where it is "auto" (or absent, with if_absent). Returns the value that
    contradicts `value`, or None."""
    *parents, key = path.split(".")
    node = config
    for part in parents:
        child = node.get(part)
        if child is None:
            if not if_absent:
                return None  # the section is absent: the Trainer's own optimizer / scheduler apply
            child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return None  # a malformed section: the config's own validation names it
        node = child
    current = node.get(key, _ABSENT)
    if current == "auto" or (current is _ABSENT and if_absent):
        node[key] = value
        return None
    if current is _ABSENT or not must_match or _same(current, value):
        return None
    return current


def _same(given: Any, wanted: Any) -> bool:
    if isinstance(wanted, list) and isinstance(given, (list, tuple)):
        return len(given) == len(wanted) and all(_same(g, w) for g, w in zip(given, wanted))
    if isinstance(wanted, bool) or isinstance(given, bool):
        return given is wanted
    if isinstance(wanted, (int, float)) and isinstance(given, (int, float)):
        return float(given) == float(wanted)
    return given == wanted



def _fill_bucket_sizes(config: dict[str, Any], model: nn.Module | None) -> None:
    """"auto" bucket sizes from the model's hidden size, with HF's DeepSpeed formulas."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    auto = [k for k in bucket_sizes(1) if zero.get(k) == "auto"]
    if not auto:
        return
    hidden = hidden_size(getattr(model, "config", None))
    if hidden is None:
        raise ConfigError(f"config keys {', '.join('zero_optimization.' + k for k in auto)} are \"auto\", which "
                          "needs the model's config.hidden_size (or hidden_sizes), and the model has none; "
                          "give these keys numbers")
    sizes = bucket_sizes(hidden)
    for k in auto:
        zero[k] = sizes[k]
