"""BatchNorm running statistics stay equal across ranks (broadcast_buffers), as under DDP.

Two gloo ranks train a small BatchNorm model on different data; DDP trains the same model on the
same data in the same ranks. After the training steps and one eval forward under no_grad (the
forward that takes rank 0's statistics after a training forward), weights and buffers equal DDP's
on every rank, and every rank holds the same statistics.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerodp
from spawn import run_ranks

MICRO, STEPS, STAGES = 4, 4, [0, 1, 2, 3]


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.mse_loss(self.out(torch.tanh(self.norm(self.inp(x)))), y)


def _data(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data, with its own statistics
    return [(torch.randn(MICRO, 6, generator=g) * (1 + rank), torch.randn(MICRO, 3, generator=g))
            for _ in range(STEPS + 1)]


def _model() -> BatchNormNet:
    torch.manual_seed(0)
    return BatchNormNet()


def _zerodp(rank: int, stage: int, broadcast: bool) -> dict[str, torch.Tensor]:
    model = _model()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "train_micro_batch_size_per_gpu": MICRO, "broadcast_buffers": broadcast,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    *train, last = _data(rank)
    for x, y in train:
        engine.backward(engine(x, y))
        engine.step()
    engine.eval()
    with torch.no_grad():
        engine(*last)
    return engine.full_state_dict()


def _ddp(rank: int) -> dict[str, torch.Tensor]:
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)  # broadcast_buffers=True is DDP's default
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    *train, last = _data(rank)
    for x, y in train:
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ddp.eval()
    with torch.no_grad():
        ddp(*last)
    return {k: v.detach().float() if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}


def _runs(rank: int, world: int) -> dict:
    out = {("zerodp", stage, True): _zerodp(rank, stage, True) for stage in STAGES}
    out["zerodp", 2, False] = _zerodp(rank, 2, False)
    out["ddp"] = _ddp(rank)
    return out


@functools.cache
def runs() -> list[dict]:
    return run_ranks(_runs, 2)


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage={s}")
def test_batchnorm_weights_and_running_stats_match_ddp_on_every_rank(stage):
    for rank, per_rank in enumerate(runs()):
        ours, ddp = per_rank["zerodp", stage, True], per_rank["ddp"]
        assert ours.keys() == ddp.keys()
        for k in ddp:
            torch.testing.assert_close(ours[k], ddp[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage={s}")
def test_running_stats_are_equal_on_every_rank(stage):
    rank0, rank1 = (r["zerodp", stage, True] for r in runs())
    for k in ("norm.running_mean", "norm.running_var"):
        assert torch.equal(rank0[k], rank1[k]), k


def test_broadcast_buffers_false_leaves_each_rank_its_own_running_stats():
    rank0, rank1 = (r["zerodp", 2, False] for r in runs())
    assert not torch.equal(rank0["norm.running_mean"], rank1["norm.running_mean"])
    assert not torch.equal(rank0["norm.running_var"], rank1["norm.running_var"])
    assert torch.equal(rank0["inp.weight"], rank1["inp.weight"]), "weights are kept equal either way"
