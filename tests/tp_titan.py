"""Rank-side runs of tests/test_tp_titan.py, inside tests/test_tensor_parallel.py's one 4-rank launch (issue 31):
tensor parallelism as torchtitan, torch and Hugging Face ship it, every gradient placement they produce.

A Llama-shaped model (token embedding, RMSNorm, attention q/k/v/o, SwiGLU MLP, final norm, untied head) in
torchtitan's own module layout, split by `apply_tp` below, written as torchtitan's `parallelize_llama` writes
it with torch's own styles: a vocabulary-parallel embedding whose backward returns a Replicate gradient of the
Shard(0) table, SequenceParallel norms whose weights' gradients are Partial(sum), PrepareModuleInput
gathering the sequence before attention and the MLP, Colwise / Rowwise(output_layouts=Shard(1)), and the
head from Shard(1), with or without loss parallel. The oracle: one process, the whole model, the whole batch.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import tp_export
import zerodp

# 3 steps (issue 32 says 5): still several, AdamW's and Muon's state carried across steps, at 3/5 of the launch's
# time for its ~14 runs; STEPS = 5 here restores the count.
VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH, STEPS, LR, CLIP = 32, 16, 4, 32, 2, 4, 4, 3, 2e-3, 0.05
HEAD_DIM = DIM // HEADS
TOL = 2e-5


# ---- the model, in torchtitan's llama3 layout ---------------------------------------------------------

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: this tp rank's heads (ColwiseParallel hands back the local columns)
        q, k, v = (w(x).view(b, t, -1, HEAD_DIM) for w in (self.wq, self.wk, self.wv))
        q, k = q * freqs[None, :, None, :], k * freqs[None, :, None, :]  # a stand-in for rotary embedding
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(HIDDEN, DIM, bias=False), \
            nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, vocab, bias=False)
        self.register_buffer("freqs", torch.empty(SEQ, HEAD_DIM), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The buffer's values (what a build on meta runs, as torchtitan's init_weights fills freqs_cis)."""
        with torch.no_grad():
            self.freqs.copy_(1 + 0.1 * torch.cos(torch.arange(SEQ * HEAD_DIM).float()).view(SEQ, HEAD_DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        return self.output(self.norm(h))


def build(vocab: int = VOCAB) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(vocab)
    with torch.no_grad():  # RMSNorm weights start at 1: moved off it, a partial sum trained as the whole shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, loss_parallel: bool) -> Transformer:
    """torchtitan's llama3 apply_tp (torchtitan/models/llama3/infra/parallelize.py), float8 left out."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def data(step: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(400 + step)
    return (torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g))


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


# ---- shape-aware optimizers on the tp-sharded matrices (issue 33) -------------------------------------
class Fp32Muon(torch.optim.Optimizer):
    """Muon as torch writes it (Nesterov momentum, quintic Newton-Schulz, the 'original' lr scale), but
    orthogonalising in fp32: a user's own shape-aware optimizer whose runs can be compared to 1e-6 (torch's
    Muon rounds to bf16, OPTIMIZER_ATOL). On a Shard(0) or Shard(1) piece of a matrix its update is another."""

    def __init__(self, params, lr: float = LR, momentum: float = 0.95, weight_decay: float = 0.1):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"])
                x = g.T if g.shape[0] > g.shape[1] else g
                x = x / x.norm().clamp(min=1e-7)
                for _ in range(5):
                    gram = x @ x.T
                    x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
                x = x.T if g.shape[0] > g.shape[1] else x
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(x, alpha=-group["lr"] * max(1, p.shape[0] / p.shape[1]) ** 0.5)


def muon_and_adamw(model: nn.Module, muon=torch.optim.Muon, lr: float = LR) -> list[torch.optim.Optimizer]:
    """Muon as people run it: the 2-D hidden matrices (attention q/k/v/o and the MLP's, tp-sharded Shard(0) and
    Shard(1)); AdamW on the embedding, the norms and the head."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("layers.") and p.dim() == 2)]
    return [muon(hidden, lr=lr), torch.optim.AdamW(rest, lr=LR, weight_decay=0.1)]


def fp32_muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Fp32Muon at 10x the lr (larger steps: a sharper check of the gather) + AdamW."""
    return muon_and_adamw(model, Fp32Muon, lr=10 * LR)


def reference(steps: int = STEPS, vocab: int = VOCAB, optimizers=adamw) -> dict:
    """One process, the whole model, the whole batch: AdamW (or `optimizers`) and clip_grad_norm_."""
    model = build(vocab)
    opts = optimizers(model)
    opt = opts if isinstance(opts, torch.optim.Optimizer) else Together(opts)
    losses, norms = [], []
    for step in range(steps):
        x, y = data(step, vocab)
        loss = loss_of(model(x), y)
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


class Together:
    """The reference's list of optimizers stepped together."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()


def _config(stage: int, dp: int, bf16: bool = False, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // dp, "gradient_clipping": CLIP, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 1500, **zero}}


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()).float()
            for n, p in model.named_parameters()}


def _placements_seen(model: nn.Module) -> dict:
    """The placements of the embedding's and the final norm's gradients as autograd hands them over."""
    seen = {}
    for name in ("tok_embeddings.weight", "norm.weight"):
        p = dict(model.named_parameters())[name]
        if isinstance(p, DTensor):
            p.register_hook(lambda g, name=name: seen.setdefault(name, str(tuple(g.placements))) and None)
    return seen


def steps(engine, mesh: DeviceMesh | None, lp: bool, run: range, vocab: int = VOCAB) -> tuple[list[float], list[float]]:
    """Train the given steps of the oracle's run, each dp rank its rows of the batch; world-mean losses."""
    dp, dp_rank = (mesh["dp"].size(), mesh.get_local_rank("dp")) if mesh is not None else (dist.get_world_size(), dist.get_rank())
    rows = slice(dp_rank * (BATCH // dp), (dp_rank + 1) * (BATCH // dp))
    losses, norms = [], []
    for step in run:
        x, y = (t[rows] for t in data(step, vocab))
        with loss_parallel() if lp else nullcontext():
            loss = loss_of(engine(x), y)
            engine.backward(loss)
        engine.step()
        mean = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(mean)  # tp ranks of one dp rank hold the same loss: the world mean is the dp mean
        losses.append(float(mean) / dist.get_world_size())
        norms.append(engine.grad_norm)
    return losses, norms


def train(mesh: DeviceMesh, stage: int, lp: bool = False, bf16: bool = False, weights: str | None = None,
          vocab: int = VOCAB, optimizers=adamw, **zero) -> dict:
    """The titan-style model over (dp, tp): losses, norms, whole weights, the export, the gradient placements.
    With `weights` (a file of the whole model) it is built on meta and its values read from there."""
    if weights is not None:
        with torch.device("meta"):
            model = apply_tp(Transformer(), mesh["tp"], lp)
    else:
        model = apply_tp(build(vocab), mesh["tp"], lp)
    engine = zerodp.initialize(model, optimizers(model), _config(stage, mesh["dp"].size(), bf16, **zero),
                               device_mesh=mesh, weights=weights)
    seen = _placements_seen(model)  # (after: a model built on meta has its parameters made by initialize)
    losses, norms = steps(engine, mesh, lp, range(STEPS), vocab)
    with engine.gathered_parameters():
        weights = whole(model)
    return {"losses": losses, "norms": norms, "weights": weights, "export": tp_export.exported(engine)["full"],
            "seen": dict(seen)}


def runs(mesh: DeviceMesh) -> dict:
    """Every case test_tp_titan.py reads, on the launch's (dp 2, tp 2) mesh and its other shapes."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {"reference": reference()}
    for stage in (1, 2, 3):
        out[f"titan dp2 tp2 stage {stage}"] = train(mesh, stage)
    out["titan dp2 tp2 stage 2 loss parallel"] = train(mesh, 2, lp=True)
    out["titan dp2 tp2 stage 3 loss parallel"] = train(mesh, 3, lp=True)
    for dp, tp in ((1, 4), (4, 1)):
        out[f"titan dp{dp} tp{tp} stage 2"] = train(init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")), 2)
    out["titan dp2 tp2 stage 2 bf16"] = train(mesh, 2, bf16=True)
    with tempfile.TemporaryDirectory(prefix="tp_titan.") as folder:  # the large-model recipe: meta, files, offload
        path = os.path.join(folder, "whole.safetensors")  # each rank's own copy of the same file
        save_file({n: p.detach().contiguous() for n, p in build().named_parameters()}, path)
        cpu = {"device": "cpu"}
        out["titan dp2 tp2 stage 3 meta weights offload"] = train(mesh, 3, weights=path, offload_optimizer=cpu,
                                                                  offload_param=cpu)
    out["refused"] = refused(mesh)
    # 33 rows over 2 tp ranks (17 and 16): the tp ranks' buckets differ, the norms' Partial gradients are summed
    # in their hooks instead of at the step
    out["reference vocab 33"] = reference(vocab=33)
    out["titan dp2 tp2 stage 2 vocab 33"] = train(mesh, 2, vocab=33)
    out["mpu reference"], out["mpu sequence parallel"] = mpu_reference(), mpu_sequence_parallel(mesh)
    out.update(shape_aware(mesh))
    return out


def shape_aware(mesh: DeviceMesh) -> dict:
    """Muon (torch's, and an fp32 one) on the tp-sharded hidden matrices + AdamW on the rest, at (dp 2, tp 2)
    stage 2 (torch's) and stage 3 with both offloads (the fp32 one: host masters, at 1e-6 the gather is exact; its
    stage-2 path is test_tensor_parallel.py's "mpu dp2 tp2 stage 2 muon"), and the one-process references with the
    same two optimizers (test_tp_titan.py's tolerances)."""
    fp32 = fp32_muon_and_adamw
    return {"reference muon": reference(optimizers=muon_and_adamw), "reference fp32 muon": reference(optimizers=fp32),
            "titan dp2 tp2 stage 2 muon": train(mesh, 2, optimizers=muon_and_adamw),
            "titan dp2 tp2 stage 3 fp32 muon offload": train(mesh, 3, optimizers=fp32, offload_optimizer={"device": "cpu"},
                                                              offload_param={"device": "cpu"})}


def hf_own_mesh(mesh: DeviceMesh) -> str:
    """A Llama loaded with transformers' own tensor parallelism (DistributedConfig(tp_size=4): its mesh over
    the whole world, not the given mesh's "tp"): zerodp.initialize's error."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    with tempfile.TemporaryDirectory(prefix="tp_titan_hf.") as folder:  # each rank its own copy
        llama = tp_export._tiny_llama()  # written by hand: save_pretrained writes on the world's rank 0 only
        llama.config.to_json_file(os.path.join(folder, "config.json"))
        save_file({n: t.contiguous() for n, t in llama.state_dict().items()}, os.path.join(folder, "model.safetensors"))
        model = LlamaForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_size=4))
    try:
        zerodp.initialize(model, adamw(model), _config(2, 2), device_mesh=mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def refused(mesh: DeviceMesh) -> str:
    """A gradient placement zerodp cannot bring to its parameter's (a Replicate norm weight's gradient made
    Shard(0) by a hook): the error every rank raises from engine.backward."""
    model = apply_tp(build(), mesh["tp"], False)
    model.norm.weight.register_hook(lambda g: g.redistribute(placements=[Shard(0)]))
    engine = zerodp.initialize(model, adamw(model), _config(2, mesh["dp"].size()), device_mesh=mesh)
    x, y = data(0)
    try:
        engine.backward(loss_of(engine(x[:2]), y[:2]))
    except Exception as e:  # noqa: BLE001 - the test reads its text
        return f"{type(e).__name__}: {e}"
    return "no error"


SAVE_AT = 2  # of STEPS: the resumed runs train the last


def save(mesh: DeviceMesh, root: str) -> None:
    """At (dp 2, tp 2), stage 2: SAVE_AT steps of the oracle's run, saved under root/titan; and of the fp32 Muon
    run (shape_aware), under root/titan muon."""
    for name, optimizers in (("titan", adamw), ("titan muon", fp32_muon_and_adamw)):
        model = apply_tp(build(), mesh["tp"], False)
        engine = zerodp.initialize(model, optimizers(model), _config(2, mesh["dp"].size()), device_mesh=mesh)
        steps(engine, mesh, False, range(SAVE_AT))
        engine.save_checkpoint(os.path.join(root, name))


def resume(root: str) -> dict[str, torch.Tensor]:
    """At (dp 1, tp 2) (test_tp_ckpt.py's 2-rank launch): root/titan resumed and trained to STEPS; whole weights."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = apply_tp(build(), mesh["tp"], False)
    engine = zerodp.initialize(model, adamw(model), _config(2, 1), device_mesh=mesh)
    engine.load_checkpoint(os.path.join(root, "titan"))
    steps(engine, mesh, False, range(SAVE_AT, STEPS))
    with engine.gathered_parameters():
        return whole(model)


def resume_muon(root: str) -> dict[str, torch.Tensor]:
    """At (dp 2) without tp (test_tp_ckpt.py's 2-rank launch): root/titan muon, saved at (dp 2, tp 2) with each
    Muon matrix's state whole, resumed and trained to STEPS; whole weights."""
    model = build()
    engine = zerodp.initialize(model, fp32_muon_and_adamw(model), _config(2, dist.get_world_size()))
    engine.load_checkpoint(os.path.join(root, "titan muon"))
    steps(engine, None, False, range(SAVE_AT, STEPS))
    return whole(model)


# ---- Megatron-style sequence parallelism through an mpu -----------------------------------------------
# test_tensor_parallel's Net split by hand (SplitLinear) and run as Megatron runs it with
# sequence_parallel: the residual stream holds this tp rank's slice of the sequence; it is gathered before
# each column-parallel layer and the row-parallel outputs are reduce-scattered back to slices. The norms
# (and the row-parallel biases, added after the reduce-scatter) see only their slice: Megatron marks them
# `sequence_parallel`, and their gradients are summed over tp.
MPU_SEQ = 4


def _chunk(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), 1)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 1)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return _chunk(x, group)


class _ToSlices(torch.autograd.Function):
    """The whole sequence -> this rank's slice; backward gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group), None


class _Gather(torch.autograd.Function):
    """Slices -> the whole sequence; backward reduce-scatters (the consumer is tensor-parallel: partial
    input gradients) or takes this rank's slice (it is replicated: every rank's gradient is whole)."""

    @staticmethod
    def forward(ctx, x, group, summed):
        ctx.group, ctx.summed = group, summed
        return _gather(x, group)

    @staticmethod
    def backward(ctx, g):
        return (_reduce_scatter(g, ctx.group) if ctx.summed else _chunk(g, ctx.group)), None, None


class _ReduceScatter(torch.autograd.Function):
    """Partial sums of the whole sequence -> this rank's slice of their sum; backward gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group), None


class MegatronSequenceParallel(nn.Module):
    """test_tensor_parallel's Net (split by hand into SplitLinear shards) run with sequence parallelism."""

    def __init__(self, net: nn.Module, group):
        super().__init__()
        self.net, self.group = net, group
        for name, p in net.named_parameters():  # Megatron's marking of what sees only its sequence slice
            if "ln" in name or name.startswith("norm") or name.endswith(("o.bias", "fc2.bias")):
                p.sequence_parallel = True

    def _attention(self, attn, a: torch.Tensor) -> torch.Tensor:
        from test_tensor_parallel import HEAD_DIM as HD
        b, t, _ = a.shape
        q, k, v = (F.linear(a, m.weight, m.bias).view(b, t, -1, HD).transpose(1, 2) for m in (attn.q, attn.k, attn.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return _ReduceScatter.apply(F.linear(out, attn.o.weight), self.group) + attn.o.bias

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        net, g = self.net, self.group
        h = _ToSlices.apply(net.inp(x), g)
        for block in net.blocks:
            h = h + self._attention(block.attn, _Gather.apply(block.ln1(h), g, True))
            m = _Gather.apply(block.ln2(h), g, True)
            hidden = F.gelu(F.linear(m, block.fc1.weight, block.fc1.bias))
            h = h + _ReduceScatter.apply(F.linear(hidden, block.fc2.weight), g) + block.fc2.bias
        return F.mse_loss(net.head(_Gather.apply(net.norm(h), g, False)), y)


def _mpu_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from test_tensor_parallel import BATCH as B, D_IN, D_OUT
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(B, MPU_SEQ, D_IN, generator=g), torch.randn(B, MPU_SEQ, D_OUT, generator=g)


def mpu_reference() -> dict:
    """One process, the whole Net, the whole batch of MPU_SEQ positions."""
    import test_tensor_parallel as tp
    model = tp.build()
    opt = tp.optimizer(model)
    losses = []
    for step in range(tp.STEPS):
        loss = model(*_mpu_data(step))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), tp.CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def mpu_sequence_parallel(mesh: DeviceMesh) -> dict:
    """(dp 2, tp 2) at stage 2 through an mpu, Megatron's sequence parallelism: losses and whole weights."""
    import test_tensor_parallel as tp
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    model = MegatronSequenceParallel(tp.split_by_hand(tp.build(), tp_group, "tensor_model_parallel"), tp_group)
    engine = zerodp.initialize(model, tp.optimizer(model), tp.config(2, 2), mpu=tp.ParallelState(dp_group, tp_group))
    rows = slice(mesh.get_local_rank("dp") * (tp.BATCH // 2), (mesh.get_local_rank("dp") + 1) * (tp.BATCH // 2))
    losses = []
    for step in range(tp.STEPS):
        loss = engine(*(t[rows] for t in _mpu_data(step)))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    weights = {}
    with engine.gathered_parameters():
        for name, module in model.net.named_modules():
            if isinstance(module, tp.SplitLinear):
                weights.update({f"{name}.{k}": v for k, v in module.whole().items()})
        weights.update({n: p.detach().clone() for n, p in model.net.named_parameters() if n not in weights})
    return {"losses": losses, "weights": weights}
