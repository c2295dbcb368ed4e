"""What the job trains besides the model (zerodp.models.build): the data its tokenizer reads, its AdamW
and the learning-rate schedule."""

from __future__ import annotations

import argparse
import math
from typing import Callable

import torch
from torch import nn

from zerodp.models import hf_folder
from zerodp.train.data import Corpus, load_corpus


def build_corpus(model: str, data: str | None) -> Corpus:
    """The tokens to train on: `data` read by the model folder's tokenizer when it has one, else
    as bytes (or a .bin file's tokens, as they are)."""
    corpus = load_corpus(data)
    if not hf_folder.is_model_folder(model) or corpus.source.endswith(".bin"):
        return corpus
    tokenizer = hf_folder.load_tokenizer(model)
    if tokenizer is None:
        return corpus
    train, val = (hf_folder.tokenize(t.tobytes().decode("utf-8", errors="replace"), tokenizer)
                  for t in (corpus.train, corpus.val))
    return Corpus(train=train, val=val, vocab_size=len(tokenizer),
                  source=f"{corpus.source}, tokenized by {model}'s tokenizer")


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The job's two param groups: weight decay on matrices and embeddings (2-D and up) only, not on
    biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, opts: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW on decay_groups."""
    groups = decay_groups(model, opts.weight_decay)
    # fused: one kernel per flat master shard, on CPU and GPU (see zerodp.config's optimizer build)
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), fused=True)


def warmup_cosine(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """lr multiplier at optimizer step t: linear warmup, then cosine down to min_ratio at `total`.

    A plain function, not an object: LambdaLR then keeps nothing of it in its state dict, so a run
    resumed with a larger --steps follows the new, longer cosine rather than the saved one.
    """
    def multiplier(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        progress = min(1.0, (t - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return multiplier
