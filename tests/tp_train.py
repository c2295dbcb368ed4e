"""Rank-side checks of zerodp's GPT split by its tensor-parallel plan (models/gpt.py: parallelize), run in
test_tensor_parallel's 4-rank launch: `gpt_oracle(mesh)` on its (dp 2, tp 2) mesh. test_train_tp.py reads them.

The oracle is the same GPT unsplit, in one process: the split one must give the same logits, loss and
gradients on the same weights, hold the same whole weights (c_attn's q | k | v rows keep their meaning),
and trained by zerodp over (dp 2, tp 2) end where one process training it on the whole batch ends, in
the module and in its export.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import zerodp
from zerodp.checkpoint.whole import its_shard
from zerodp.engine.layout.flat import join_tp, place_tp_shard, tp_parts
from zerodp.models.gpt import GPT, GPTConfig, parallelize

# 4 heads of 4 channels: 2 heads per tp rank. Tiny vocabulary and context: the launch's budget.
SHAPE = GPTConfig(vocab_size=48, block_size=8, n_layer=2, n_head=4, n_embd=16)
BATCH, STEPS, LR, CLIP = 4, 4, 3e-3, 0.5


def build(mesh: DeviceMesh | None = None, sequence_parallel: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(SHAPE)
    return parallelize(model, mesh["tp"], sequence_parallel) if mesh is not None else model


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(0, SHAPE.vocab_size, (BATCH, SHAPE.block_size), generator=g)
    return x, torch.randint(0, SHAPE.vocab_size, (BATCH, SHAPE.block_size), generator=g)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def same_step(mesh: DeviceMesh, sequence_parallel: bool = False) -> dict:
    """Logits, loss and every gradient of the split GPT and the whole one, on the same weights and batch."""
    ref, split = build(), build(mesh, sequence_parallel)
    x, y = data(0)
    out = {"logits": (split(x) - ref(x)).abs().max().item()}
    loss_ref, loss = ref(x, y), split(x, y)
    loss_ref.backward()
    loss.backward()
    out["loss"] = abs(loss.item() - loss_ref.item())
    params = dict(split.named_parameters())
    out["weights"] = {n: (whole(params[n]) - p).abs().max().item() for n, p in ref.named_parameters()}
    out["grads"] = {n: (whole(params[n].grad) - p.grad).abs().max().item() for n, p in ref.named_parameters()}
    out["placements"] = {n: str(p.placements) for n, p in params.items() if isinstance(p, DTensor)}
    out["joined"] = joined(mesh, params)
    return out


def joined(mesh: DeviceMesh, params: dict[str, torch.Tensor]) -> dict[str, float]:
    """Against full_tensor() and the local shard: the tp ranks' shards joined by the placement's dim and
    flat.tp_parts (flat.join_tp: the export; flat.place_tp_shard one shard at a time: consolidate), and this
    rank's shard cut from the whole (checkpoint.whole.its_shard: a resume on another tp size)."""
    group, tp, out = mesh.get_group("tp"), mesh["tp"].size(), {}
    for name in ("blocks.0.attn.c_attn.weight", "blocks.0.attn.c_attn.bias", "blocks.0.mlp.c_fc.weight",
                 "blocks.0.mlp.c_proj.weight"):
        p, dim = params[name], params[name].placements[0].dim
        shards = [torch.empty_like(p.to_local()) for _ in range(tp)]
        dist.all_gather(shards, p.to_local().contiguous(), group=group)
        out[f"{name} joined"] = (join_tp(shards, dim, tp_parts(p)) - p.full_tensor()).abs().max().item()
        placed = torch.zeros_like(p.full_tensor())
        for r, shard in enumerate(shards):
            place_tp_shard(placed, shard, dim, r * shard.shape[dim], tp_parts(p))
        out[f"{name} placed"] = (placed - p.full_tensor()).abs().max().item()
        cut = its_shard(p, mesh.get_local_rank("tp"), tp, p.to_local().shape, p.full_tensor())
        out[f"{name} cut"] = (cut - p.to_local()).abs().max().item()
    return out


def reference() -> dict:
    """One process, the whole GPT, the whole batch: AdamW and clip_grad_norm_."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*data(step))
        loss.backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train(mesh: DeviceMesh, stage: int) -> dict:
    """The split GPT trained by zerodp over (dp 2, tp 2): world-mean losses and the whole weights."""
    model = build(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    config = {"train_micro_batch_size_per_gpu": BATCH // 2, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}
    engine = zerodp.initialize(model, opt, config, device_mesh=mesh)
    lo = mesh.get_local_rank("dp") * (BATCH // 2)  # the tp ranks of a dp rank read the same rows
    losses, norms = [], []
    for step in range(STEPS):
        loss = engine(*(t[lo:lo + BATCH // 2] for t in data(step)))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        norms.append(engine.grad_norm)
    with engine.gathered_parameters():
        weights = {n: whole(p) for n, p in model.named_parameters()}
    # The export (engine_weights: final.pt, consolidate's twin) joins each tp shard by its placement.
    return {"losses": losses, "norms": norms, "weights": weights, "export": engine.full_state_dict()}


def on_meta(mesh: DeviceMesh) -> str:
    """zerodp.initialize's error for the split GPT built on meta: c_attn's strided shard is no one box."""
    with torch.device("meta"):
        model = GPT(SHAPE)
    parallelize(model, mesh["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    try:
        zerodp.initialize(model, opt, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}},
                          device_mesh=mesh)
    except NotImplementedError as e:
        return str(e)
    return "no error"


def gpt_oracle(mesh: DeviceMesh) -> dict:
    return {"same step": same_step(mesh), "same step sequence parallel": same_step(mesh, sequence_parallel=True),
            "reference": reference(), "on meta": on_meta(mesh),
            **{f"stage {s}": train(mesh, s) for s in (2, 3)}}
