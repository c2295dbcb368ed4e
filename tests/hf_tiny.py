"""Tiny Hugging Face model folders made offline, as save_pretrained writes them: a GPT-2 (tied head)
and a Llama (untied head), both with a 300-token byte-level BPE tokenizer trained on a few strings."""

from __future__ import annotations

from pathlib import Path

TEXTS = ["def forward(self, x):\n    return self.proj(x) + 1\n",
         "the quick brown fox jumps over the lazy dog. " * 3,
         "import torch\nfrom torch import nn\n\nclass Model(nn.Module):\n    pass\n"]
VOCAB = 300


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def make_folders(root: Path) -> dict[str, Path]:
    """{"gpt2": folder, "llama": folder} under root, each with config, weights and tokenizer."""
    import torch
    import transformers

    tok = tokenizer()
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    models = {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, **special)),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, **special)),
    }
    folders = {}
    for name, model in models.items():
        folders[name] = root / name
        model.save_pretrained(folders[name])
        tok.save_pretrained(folders[name])
    return folders
