"""Hugging Face in one place: `ZeroTrainer` trains with `transformers.Trainer` and `TrainingArguments`,
zerodp doing the data-parallel part; `folder` reads and writes model folders (save_pretrained's).
Needs `pip install zerodp[hf]`; names load on first use, so `zerodp train --help` never imports
transformers."""

import importlib
from typing import Any

_LAZY = {"fill_from_training_args": "auto", "ZeroTrainer": "trainer", "EngineModule": "trainer",
         "EngineOptimizer": "trainer", "EngineScheduler": "trainer"}
__all__ = ["ZeroTrainer", "fill_from_training_args", "EngineModule", "EngineOptimizer", "EngineScheduler"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
