"""Compatibility layers with other training frameworks, one sub-package each (thin: the engine never
learns their names). `zerodp.integrations.hf`: Hugging Face's `transformers.Trainer`."""
