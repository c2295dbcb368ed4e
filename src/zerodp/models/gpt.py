"""A GPT decoder: the model zerodp trains by default.

nanoGPT's model, read top to bottom: config and named sizes, attention, MLP, block, GPT.
Pre-LayerNorm blocks, learned position embeddings, an output head tied to the token embedding,
GPT-2 initialisation. Nothing here knows about data parallelism: zerodp wraps it unchanged.

The initialisation is each layer's own `reset_parameters()`, run as the layer is built: a GPT built on
the meta device and initialised layer by layer in module order (what zerodp.initialize does, and
init_weights()) gets the same values, bit for bit, as one built whole with the same seed.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    block_size: int = 1024  # longest sequence; length of the position table
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2
    # Tokens per piece of the output head and loss; 0: all at once. The fp32 logits of a large
    # vocabulary are the biggest activation of the model (4 x 1024 tokens x 50304 x 4 B = 0.8 GB, with
    # their gradients 2.3 GB at the start of backward); in pieces, recomputed in backward, only one
    # piece's exist at a time, for one more head matmul forward.
    loss_chunk: int = 0


from zerodp.models.sizes import SIZES  # noqa: E402 - torch-free, so --help can list them (sizes.py)


def gpt_config(size: str, **overrides) -> GPTConfig:
    """The config of a named size, with any field overridden: gpt_config("125M", dropout=0.1)."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; expected one of {', '.join(SIZES)}")
    config = GPTConfig(**{**SIZES[size], **overrides})
    if config.n_embd % config.n_head != 0:
        raise ValueError(
            f"n_embd={config.n_embd} must be divisible by n_head={config.n_head} "
            f"(each head gets n_embd // n_head channels)"
        )
    return config


class Linear(nn.Linear):
    """nn.Linear with GPT-2's initialisation: weight ~ N(0, std), bias 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02):
        self.std = std  # read by reset_parameters, which nn.Linear's constructor calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding with GPT-2's initialisation: N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


def residual_std(config: GPTConfig) -> float:
    """Each block adds two residual projections to the stream; their weights are scaled so that its
    variance does not grow with depth (GPT-2 paper, section 2.3)."""
    return 0.02 / math.sqrt(2 * config.n_layer)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # The head draws its own weight, which the tie then replaces (a meta build draws it too).
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): one Parameter is both the input and output embedding.
        self.lm_head.weight = self.wte.weight

    def init_weights(self) -> None:
        """GPT-2 initialisation again, layer by layer as at construction (the same values for the same
        seed); also re-ties the head after `to_empty()` from the meta device."""
        self.lm_head.weight = nn.Parameter(torch.empty_like(self.wte.weight))  # drawn, then tied, as built
        for module in self.modules():
            if module is not self and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids idx (B, T); with targets, the mean cross-entropy."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x)
        if targets is None:
            return self.lm_head(h)
        h, targets = h.flatten(0, 1), targets.flatten(0, 1)
        chunk = self.config.loss_chunk
        if chunk <= 0 or chunk >= len(targets):
            # The softmax runs in fp32 even for a bf16/fp16 model: the loss sums many tiny terms.
            return F.cross_entropy(self.lm_head(h).float(), targets, ignore_index=-1)
        total = sum(
            checkpoint(self._loss_sum, h[i : i + chunk], targets[i : i + chunk], use_reentrant=False)
            for i in range(0, len(targets), chunk)
        )
        return total / (targets != -1).sum()

    def _loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, the tied embedding counted once.

        non_embedding leaves out the position table only: the token table is also the output
        head, so it does compute (nanoGPT's convention).
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied one once
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the matmuls forward and backward plus attention
        scores and values, 12 * n_layer * n_embd * seq_len (Kaplan et al. 2020; PaLM app. B)."""
        return 6 * self.num_params() + 12 * self.config.n_layer * self.config.n_embd * seq_len

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Sample max_new_tokens after the prompt idx (B, T); returns (B, T + max_new_tokens)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits = self(context)[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx
