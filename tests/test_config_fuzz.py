"""Seeded mutations of real DeepSpeed configs: every refusal is a ConfigError naming the key, and
nothing nonsensical is accepted (inf/nan anywhere, a value of another JSON type than the key's own,
a negative size, rate or step count).

Each mutation replaces one leaf of a real config from tests/data/configs (or deletes it, or adds an unknown
key beside it) and goes through load_config; a sample also goes through zerodp.initialize and
zerodp.deepspeed.initialize on a tiny model in a world of one, where the batch arithmetic, the
optimizer and the scheduler are built for real.
"""

from __future__ import annotations

import copy
import json
import math
import random
import warnings
from pathlib import Path

import pytest
import torch

import zerodp
import zerodp.deepspeed
from zerodp.config import ConfigError, load_config

# The real configs that zerodp runs (test_deepspeed_configs.py), the CIFAR one (the only one with a
# scheduler section) less the key zerodp refuses by name.
CONFIGS = [Path(__file__).parent / "data" / "configs" / name for name in
           ("dse_alpaca_lora_fp16_zero3_offload.json", "dse_imagenet_fp16_zero1.json", "dse_megatron_fp16_zero3.json",
            "dse_cifar_fp16_zero2_offload.json")]
REFUSED_AS_WRITTEN = [("fp16", "fp16_master_weights_and_grads")]
MUTATIONS, THROUGH_INITIALIZE, SEED = 400, 24, 20
VALUES = [math.inf, -math.inf, math.nan, -1, -0.5, 0, 0.5, 3, 1e30, True, False, "x", "1e-3", None, [], {}, [0.9],
          [0.9, 0.99, 0.999], {"a": 1}]
# Keys whose negative values some configs legitimately use.
NEGATIVE_OK = {"mics_shard_size", "beta2_decay"}
# Keys of several JSON types (DeepSpeed never reads this one; its examples write a number or a string).
ANY_TYPE = {"cuda_visible_devices"}
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "clipping", "scale", "size", "steps", "batch", "timeout",
                 "threshold", "window", "hysteresis", "power", "ratio", "count", "distance", "live")


def _leaves(node, path=()):
    """(path, value) of every leaf (a value that is not a non-empty dict)."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    else:
        yield path, node


def _set(config: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        config = config[k]
    if value is _DELETE:
        del config[path[-1]]
    elif value is _UNKNOWN:
        config[path[-1] + "_typo"] = 1
    else:
        config[path[-1]] = value


_DELETE, _UNKNOWN = object(), object()


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def mutations() -> list[tuple[str, dict, tuple, object, object]]:
    """(config file, mutated config, path, old value, new value), the same every run."""
    rng = random.Random(SEED)
    bases = [(p.name, _runnable(json.loads(p.read_text()))) for p in CONFIGS]
    out = []
    for _ in range(MUTATIONS):
        name, base = rng.choice(bases)
        path, old = rng.choice(list(_leaves(base)))
        new = rng.choice(VALUES + [_DELETE, _UNKNOWN])
        config = copy.deepcopy(base)
        _set(config, path, new)
        out.append((name, config, path, old, new))
    return out


def _runnable(config: dict) -> dict:
    for section, key in REFUSED_AS_WRITTEN:
        config.get(section, {}).pop(key, None)
    return config


def nonsensical(path: tuple, old, new) -> str | None:
    """Why accepting `new` for the key at `path` (which held `old`) would be wrong, or None."""
    if new is _DELETE or new is _UNKNOWN:
        return "an unknown key was accepted" if new is _UNKNOWN else None
    if isinstance(new, float) and not math.isfinite(new):
        return "a non-finite number was accepted"
    if new is not None and _kind(new) != _kind(old) and path[-1] not in ANY_TYPE and not (_kind(old) == "number" and new == 1e30):
        return f"a {_kind(new)} was accepted where the config had a {_kind(old)}"
    key = path[-1]
    if (_kind(new) == "number" and new < 0 and key not in NEGATIVE_OK
            and any(part in key for part in _NON_NEGATIVE)):
        return "a negative value was accepted"
    return None


def names_the_key(message: str, path: tuple, new) -> bool:
    """The message names the mutated key (or, for an unknown key, the key it added)."""
    key = path[-1] + "_typo" if new is _UNKNOWN else path[-1]
    return key in message or (new is _DELETE and len(path) > 1 and path[-2] in message)


def _refusal_problem(error: Exception, path: tuple, new, where: str) -> str | None:
    if not isinstance(error, ConfigError):
        return f"{where}: {type(error).__name__} instead of ConfigError: {error}"
    # A required key removed may be named by its section or by the rule that needs it.
    if not (names_the_key(str(error), path, new) or new is _DELETE):
        return f"{where}: the key is not named: {error}"
    return None


def test_every_mutation_is_refused_naming_its_key_or_is_sensible():
    accepted, problems = 0, []
    for name, config, path, old, new in mutations():
        where = f"{name} {'.'.join(path)} = {new!r}"
        try:
            load_config(config)
        except Exception as e:  # noqa: BLE001 - what kind of error it is, is the point
            problems.append(_refusal_problem(e, path, new, where))
            continue
        accepted += 1
        why = nonsensical(path, old, new)
        problems.append(why and f"{where}: {why}")
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)
    assert 0 < accepted < MUTATIONS  # the pool makes both outcomes common


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _initialize_both(config: dict) -> None:
    model = _tiny_model()
    optimizer = None if "optimizer" in config else torch.optim.AdamW(model.parameters(), lr=1e-3)
    zerodp.initialize(model, optimizer, copy.deepcopy(config))
    model = _tiny_model()
    optimizer = None if "optimizer" in config else torch.optim.AdamW(model.parameters(), lr=1e-3)
    zerodp.deepspeed.initialize(model=model, optimizer=optimizer, config=copy.deepcopy(config))


def test_a_sample_of_mutations_through_both_initializes_fails_only_with_config_errors():
    loads, refused = [], []
    for m in mutations():
        try:
            load_config(m[1])
            loads.append(m)
        except ConfigError:
            refused.append(m)
    # Mostly values load_config accepts: they must also build an engine, or be refused by name there.
    rng = random.Random(SEED + 1)
    sample = rng.sample(loads, THROUGH_INITIALIZE * 3 // 4) + rng.sample(refused, THROUGH_INITIALIZE // 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slow bf16, offload on a CPU: not what this test is about
        problems, built = [], 0
        for name, config, path, old, new in sample:
            where = f"{name} {'.'.join(path)} = {new!r}"
            if path[0] not in BATCH_KEYS:  # batch sizes written for many GPUs, here on one rank
                config = _one_rank(config)
            try:
                _initialize_both(config)
                built += 1
            except Exception as e:  # noqa: BLE001
                if isinstance(e, ConfigError) and "world size" in str(e) and "world size" not in where:
                    continue  # the batch arithmetic of a config for many GPUs on one rank
                problems.append(_refusal_problem(e, path, new, where))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)
    assert built >= THROUGH_INITIALIZE // 2, "too few mutations reached the engine to test anything"


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _one_rank(config: dict) -> dict:
    """The config with batch sizes a world of one can have."""
    return {**{k: v for k, v in config.items() if k not in BATCH_KEYS}, "train_micro_batch_size_per_gpu": 2}


@pytest.mark.parametrize("path", [p.name for p in CONFIGS])
def test_the_unmutated_configs_initialize(path):
    config = _one_rank(_runnable(json.loads((Path(__file__).parent / "data" / "configs" / path).read_text())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _initialize_both(config)
