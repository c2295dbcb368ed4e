"""A Hugging Face example script in the style of examples/pytorch/language-modeling/run_clm.py: its
arguments parsed by HfArgumentParser into (model, data, TrainingArguments), a causal LM and its tokenizer
from a folder, the text tokenized and grouped into blocks, `Trainer(...).train()`, the model saved.

Ported to zerodp by one added line, after the transformers imports:
    from zerodp.integrations.hf import ZeroTrainer as Trainer
and launched with ZERODP_CONFIG=ds_config.json where it would take --deepspeed ds_config.json.
"""

from dataclasses import dataclass, field

import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

TEXT = "the quick brown fox jumps over the lazy dog. def forward(self, x):\n    return self.proj(x) + 1\n" * 8


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder (save_pretrained's)"})


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=16, metadata={"help": "tokens per training sequence"})


def group_texts(ids, block_size):
    total = (len(ids) // block_size) * block_size
    return [{"input_ids": ids[i:i + block_size], "labels": ids[i:i + block_size]} for i in range(0, total, block_size)]


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    transformers.set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    train_dataset = group_texts(tokenizer(TEXT)["input_ids"], data_args.block_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, processing_class=tokenizer,
                      data_collator=default_data_collator)
    train_result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_state()
    return trainer


if __name__ == "__main__":
    main()
