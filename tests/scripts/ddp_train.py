"""A DistributedDataParallel training script of nanoGPT's kind (gradient accumulation with
require_backward_grad_sync, the loss divided by the accumulation steps, GradScaler, autocast,
clip_grad_norm_, rank-0 evaluation, its own checkpoint of model.state_dict() and optimizer.state_dict() saved
from rank 0, resumed before wrapping). tests/test_ddp_port.py ports it to zerodp by the lines docs/USAGE.md's
"Porting a DDP script" gives, and only those.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ACCUMULATION = 2  # micro-batches per step on each rank
BATCH = 8         # examples per step, over all ranks and micro-batches


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 24)
        self.fc2 = nn.Linear(24, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def get_batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s batch: the same BATCH examples however many ranks there are."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    per = BATCH // (world * ACCUMULATION)
    start = (rank * ACCUMULATION + micro) * per
    return x[start:start + per], y[start:start + per]


@torch.no_grad()
def evaluate(model: nn.Module) -> float:
    model.eval()
    x, y = get_batch(1000, 0, 0, 1)
    loss = F.cross_entropy(model(x), y).item()
    model.train()
    return loss


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save_at", type=int, default=0)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    start, checkpoint = 0, None
    if args.resume:
        checkpoint = torch.load(args.ckpt)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["step"]
    checkpoint = None
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model = DDP(model)
    raw_model = model.module
    losses, evals = [], []
    for step in range(start, args.steps):
        for micro in range(ACCUMULATION):
            x, y = get_batch(step, micro, rank, world)
            model.require_backward_grad_sync = micro == ACCUMULATION - 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
                loss = F.cross_entropy(model(x), y)
                loss = loss / ACCUMULATION
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(norm))
        if rank == 0:
            evals.append(evaluate(raw_model))
        if step + 1 == args.save_at:
            if rank == 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
                torch.save(checkpoint, args.ckpt)
            dist.barrier()
    return {"norms": losses, "evals": evals, "weights": {k: v.clone() for k, v in raw_model.state_dict().items()}}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(None)
    dist.destroy_process_group()
