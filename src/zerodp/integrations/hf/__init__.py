"""Hugging Face in one place: `ZeroTrainer` trains with `transformers.Trainer` and `TrainingArguments`,
zerodp doing the data-parallel part; model folders (save_pretrained's) are read and written by zerodp.models.hf_folder.
Needs `pip install zerodp[hf]`; names load on first use, so `zerodp train --help` never imports
transformers.

  trainer.py  `ZeroTrainer`: transformers.Trainer with zerodp doing the data-parallel part.
  auto.py     a zerodp config completed from TrainingArguments, as the Trainer does for DeepSpeed.
"""

from zerodp.lazy import lazy_names

_LAZY = {"fill_from_training_args": "auto", "ZeroTrainer": "trainer", "EngineModule": "trainer",
         "EngineOptimizer": "trainer", "EngineScheduler": "trainer"}
__all__ = ["ZeroTrainer", "fill_from_training_args", "EngineModule", "EngineOptimizer", "EngineScheduler"]


__getattr__ = lazy_names(__name__, _LAZY)
