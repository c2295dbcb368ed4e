"""Hugging Face Trainer integration: `ZeroTrainer` trains with `transformers.Trainer` and
`TrainingArguments`, zerodp doing the data-parallel part. Needs `pip install zerodp[hf]`."""

from .auto import fill_from_training_args
from .trainer import EngineModule, EngineOptimizer, EngineScheduler, ZeroTrainer

__all__ = ["ZeroTrainer", "fill_from_training_args", "EngineModule", "EngineOptimizer", "EngineScheduler"]
