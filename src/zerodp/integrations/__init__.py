"""Compatibility layers with other training frameworks, one sub-package each (thin: the engine never
learns their names). `zerodp.integrations.hf`: Hugging Face's `transformers.Trainer`.

  hf/           Hugging Face's `transformers.Trainer` (ZeroTrainer) and its config from TrainingArguments.
  trl.py        TRL's SFT / DPO / GRPO trainers on ZeroTrainer.
  lightning.py  ZeroStrategy / ZeroFabricStrategy for Lightning's Trainer and Fabric.
"""
