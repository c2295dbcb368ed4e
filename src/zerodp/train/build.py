"""What the job trains: the model (a GPT, or a Hugging Face causal LM of a GPT size's shape), its
AdamW and the learning-rate schedule."""

from __future__ import annotations

import argparse
import math
from typing import Callable

import torch
from torch import nn

from .model import GPT, GPTConfig, gpt_config
from .sizes import HF_MODELS


class HFCausalLM(nn.Module):
    """(x, y) -> loss for a Hugging Face causal LM, which it holds unchanged as `.model`.

    Hugging Face shifts the labels itself, so it is given the inputs as labels: y is x shifted.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, labels=x).loss


def build_model(name: str, vocab_size: int, block_size: int | None) -> tuple[nn.Module, GPTConfig]:
    """The model to train and its shape: a GPT size, or an HF model of that size's shape."""
    family, _, size = name.partition(":")
    overrides = {"block_size": block_size} if block_size else {}
    if family not in HF_MODELS:
        shape = gpt_config(name, vocab_size=vocab_size, **overrides)
        return GPT(shape), shape
    shape = gpt_config(size or "small", vocab_size=vocab_size, **overrides)
    import transformers  # only for the HF options: importing it is slow

    if family == "hf-gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=shape.block_size,
                                      n_embd=shape.n_embd, n_layer=shape.n_layer, n_head=shape.n_head,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=shape.n_embd,
                                       intermediate_size=4 * shape.n_embd,
                                       num_hidden_layers=shape.n_layer,
                                       num_attention_heads=shape.n_head,
                                       num_key_value_heads=shape.n_head,
                                       max_position_embeddings=shape.block_size,
                                       tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    return HFCausalLM(model), shape


def build_optimizer(model: nn.Module, opts: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices and embeddings (2-D) only, not on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opts.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
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
