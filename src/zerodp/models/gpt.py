"""A GPT decoder: the model zerodp trains by default.

nanoGPT's model, read top to bottom: config and named sizes, attention, MLP, block, GPT.
Pre-LayerNorm blocks, learned position embeddings, an output head tied to the token embedding,
GPT-2 initialisation. Nothing here knows about data parallelism: zerodp wraps it unchanged. The last
section splits it over tensor-parallel ranks (`parallelize`: Megatron's layout, torch's parallelize_module).

The initialisation is each layer's own `reset_parameters()`, run as the layer is built: a GPT built on
the meta device and initialised layer by layer in module order (what zerodp.initialize does, and
init_weights()) gets the same values, bit for bit, as one built whole with the same seed.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
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
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The heads are counted from the output, not from the config: under tensor parallelism
        # c_attn's output is this rank's heads only (their q, k, v, side by side: see parallelize).
        qkv = self.c_attn(x)
        q, k, v = qkv.split(qkv.size(-1) // 3, dim=2)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
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


# ---- tensor parallelism ---------------------------------------------------------------------------
# Megatron's split of a block (Shoeybi et al. 2019, section 3): attention by heads and the MLP by its
# hidden units, each a column-parallel Linear then a row-parallel one, so a block costs one all-reduce
# forward and one backward per half. The norms, the embeddings and the tied head stay whole on every
# tp rank (replicated): the head's gradient then needs no vocabulary-parallel loss.


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Linear whose output is `parts` equal tensors side by side (c_attn's q | k | v).

    A plain column split would give tp rank 0 all of q and half of k. Here each rank takes its slice of
    every part (torch's _StridedShard(0, split_factor=parts)): its local output is its own heads' q | k | v,
    which forward splits in three. The stored rows keep their meaning: the DTensor's whole tensor
    (full_tensor(), any export that joins by the placements) is the model's own q | k | v, as without tp.
    """

    def __init__(self, parts: int):
        super().__init__()
        self.placement = _StridedShard(0, split_factor=parts)

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in module.named_parameters():
            whole = distribute_tensor(param, device_mesh, [self.placement], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(whole, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # The output is strided like the weight (each part's slice): its local tensor is this rank's
        # q | k | v as it is. ColwiseParallel's own would redistribute it to Shard(-1), rank 0's q and k.
        return outputs.to_local() if use_local_output else outputs


def tp_plan(config: GPTConfig, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """parallelize_module's plan for a GPT: each block's attention split by heads, its MLP by hidden units.

    sequence_parallel (Korthikanti et al. 2022; torchtitan's plan): between the blocks' tensor-parallel halves
    each tp rank holds its slice of the sequence, and the norms run on that slice (SequenceParallel: their
    weights' gradients are partial sums, which zerodp sums over tp). The sequence is cut before the first block,
    gathered before each half (PrepareModuleInput) and reduce-scattered after it (Rowwise to Shard(1)); ln_f's
    slices are gathered again for the tied head, which every tp rank holds whole (parallelize)."""
    plan: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        plan["blocks.0"] = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                              use_local_output=True)
        plan["ln_f"] = SequenceParallel()
    to_slices = {"output_layouts": Shard(1)} if sequence_parallel else {}
    for i in range(config.n_layer):
        plan[f"blocks.{i}.attn.c_attn"] = FusedColwiseParallel(parts=3)
        plan[f"blocks.{i}.attn.c_proj"] = RowwiseParallel(**to_slices)
        plan[f"blocks.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.c_proj"] = RowwiseParallel(**to_slices)
        if sequence_parallel:
            for half, norm in (("attn", "ln_1"), ("mlp", "ln_2")):
                plan[f"blocks.{i}.{norm}"] = SequenceParallel()
                plan[f"blocks.{i}.{half}"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    return plan


def check_tp(config: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """A GPT splits over `tp` ranks when its heads and its width do (n_head and n_embd divisible by tp), and
    with sequence parallelism its sequence (block_size). Raises a ValueError naming the sizes otherwise (no
    collective: call it on every rank first)."""
    if config.n_head % tp or config.n_embd % tp:
        raise ValueError(f"tensor parallelism {tp} splits attention by heads: n_head={config.n_head} and "
                         f"n_embd={config.n_embd} must be divisible by it; choose a tp that divides both")
    if sequence_parallel and config.block_size % tp:
        raise ValueError(f"sequence parallelism over {tp} ranks splits the sequence: block_size={config.block_size} "
                         "must be divisible by it")


def parallelize(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> GPT:
    """Split `model` over the tensor-parallel mesh `tp_mesh` (1-D, e.g. mesh["tp"]) by tp_plan, in place;
    returns it. Without it, or with tp 1, the model computes the same values."""
    check_tp(model.config, tp_mesh.size(), sequence_parallel)
    parallelize_module(model, tp_mesh, tp_plan(model.config, sequence_parallel))
    if sequence_parallel:  # after SequenceParallel's own output hook: ln_f's slices joined, as a plain tensor
        parallelize_module(model, tp_mesh, {"ln_f": PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)})
    return model
