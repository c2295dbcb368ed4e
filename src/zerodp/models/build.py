"""The models zerodp's commands build by name: a GPT size (gpt.py), a Hugging Face causal LM of a GPT
size's shape, or a local Hugging Face model folder with its weights, each as an (x, y) -> loss module."""

from __future__ import annotations

import torch
from torch import nn

from zerodp.models import hf_folder
from zerodp.models.gpt import GPT, GPTConfig, gpt_config
from zerodp.models.sizes import HF_MODELS


class HFCausalLM(nn.Module):
    """(x, y) -> loss for a Hugging Face causal LM, which it holds unchanged as `.model`.

    Hugging Face shifts the labels itself, so it is given the inputs as labels: y is x shifted.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        if getattr(model, "loss_type", "ForCausalLM") is None:
            # A class whose name does not say ForCausalLM (GPT2LMHeadModel) gets HF's causal-LM loss
            # anyway, after a warning on every rank that it guessed: say it.
            model.loss_type = "ForCausalLM"

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, labels=x).loss


def build_model(name: str, vocab_size: int, block_size: int | None) -> tuple[nn.Module, GPTConfig]:
    """The model to train and its shape: a GPT size, an HF model of that size's shape, or an HF
    model folder's model (its weights read by zerodp.initialize: `weights_of(name)`)."""
    if hf_folder.is_model_folder(name):
        return _pretrained(name, vocab_size, block_size)
    family, _, size = name.partition(":")
    overrides = {"block_size": block_size} if block_size else {}
    if family not in HF_MODELS:
        shape = gpt_config(name, vocab_size=vocab_size, **overrides)
        return GPT(shape), shape
    shape = gpt_config(size or "small", vocab_size=vocab_size, **overrides)
    import transformers  # only for the HF options: importing it is slow

    hf_folder.quiet_other_ranks()
    # Byte-level tokens have no bos/eos: GPT-2's default 50256 would be outside the vocabulary.
    special = dict(bos_token_id=None, eos_token_id=None) if vocab_size <= 256 else {}
    if family == "hf-gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=shape.block_size,
                                      n_embd=shape.n_embd, n_layer=shape.n_layer, n_head=shape.n_head,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **special)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=shape.n_embd,
                                       intermediate_size=4 * shape.n_embd,
                                       num_hidden_layers=shape.n_layer,
                                       num_attention_heads=shape.n_head,
                                       num_key_value_heads=shape.n_head,
                                       max_position_embeddings=shape.block_size,
                                       tie_word_embeddings=True, **special)
        model = transformers.LlamaForCausalLM(cfg)
    return HFCausalLM(model), shape


def weights_of(name: str) -> str | None:
    """Where the values of build_model(name)'s parameters come from, for zerodp.initialize(weights=):
    the model folder, or None when the model is initialised as built."""
    return name if hf_folder.is_model_folder(name) else None


def _pretrained(path: str, vocab_size: int, block_size: int | None) -> tuple[nn.Module, GPTConfig]:
    model = hf_folder.model_from_config(path)
    cfg = model.config
    if vocab_size > cfg.vocab_size:
        raise ValueError(f"--model {path!r} has {cfg.vocab_size} token embeddings, fewer than the data's "
                         f"vocabulary of {vocab_size}: give the folder a tokenizer that fits it")
    longest = getattr(cfg, "max_position_embeddings", None) or 1024
    if block_size and block_size > longest:
        raise ValueError(f"--block-size {block_size} exceeds --model {path!r}'s "
                         f"max_position_embeddings={longest}")
    # The shape the memory report's activation estimate reads (zerodp.plan.formulas).
    shape = GPTConfig(vocab_size=cfg.vocab_size, block_size=block_size or min(longest, 1024),
                      n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads, n_embd=cfg.hidden_size)
    return HFCausalLM(model), shape


def hf_description(model: nn.Module, name: str) -> dict | None:
    """What a checkpoint records to write this model as an HF folder (hf_folder.description), or None
    for zerodp's own GPT."""
    if not isinstance(model, HFCausalLM):
        return None
    tokenizer = name if hf_folder.is_model_folder(name) and hf_folder.has_tokenizer(name) else None
    return hf_folder.description(model.model, tokenizer)
