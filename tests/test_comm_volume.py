"""ZeRO-2 adds no communication: bytes per step counted at the collective calls (engine.comm.traffic).

Per step and rank, a ring all_reduce moves 2(N-1)/N of the buffer, reduce_scatter and all_gather
(N-1)/N each. Stage 0 all-reduces every gradient bucket; stages 1 and 2 reduce-scatter it and
all-gather the updated parameters: the same 2(N-1)/N·Ψ·bytes, up to the padding of the buckets
(stage 0 pads each bucket to ALIGN elements, stages 1-2 to N·ALIGN). The only other collective in
a step is the all_reduce of the squared gradient norm with the non-finite-loss flags: three fp64 (24 bytes), stages 1-2.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zerodp
from spawn import run_ranks
from zerodp.flat import ALIGN
from zerodp.train.model import GPT, gpt_config

STEPS, MICRO, SEQ = 3, 2, 16
NORM_BYTES = 24  # the fp64 squared norm and the two non-finite-loss flags (non_finite.py)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BUCKETS = {"one_bucket": 500_000_000, "many_buckets": 30_000}
JOBS = [(stage, dtype, bucket) for stage in (0, 1, 2) for dtype in DTYPES for bucket in BUCKETS]


def _traffic(rank: int, world: int, stage: int, dtype: str, bucket: str) -> dict:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKETS[bucket]}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    assert engine.comm.traffic.total() == 0, "initialize() must reset the tally after its broadcasts"
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    traffic = engine.comm.traffic
    return {"bytes": dict(traffic.bytes), "calls": dict(traffic.calls), "psi": psi,
            "bucket_numels": [b.numel for fg in engine.flat_groups for b in fg.buckets],
            "slots": sum(len(b.slots) for fg in engine.flat_groups for b in fg.buckets),
            "element_size": torch.empty((), dtype=DTYPES[dtype]).element_size()}


def _all_jobs(rank: int, world: int) -> dict:
    return {job: _traffic(rank, world, *job) for job in JOBS}


@functools.cache
def runs(world: int) -> dict:
    """Rank 0's tallies of every job, for one world size, in one set of spawned ranks."""
    return run_ranks(_all_jobs, world)[0]


def _ring(world: int, nbytes: int) -> float:
    return nbytes * (world - 1) / world


def gradient_bytes(run: dict) -> int:
    """Bytes of the gradient/parameter collectives, the norm's scalar all_reduce taken out."""
    b = dict(run["bytes"])
    b.pop("broadcast", None)
    if b.get("reduce_scatter"):  # stages 1-2: the only all_reduce is the norm, once per step
        return b["reduce_scatter"] + b["all_gather"]
    return b["all_reduce"]


WORLDS = pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world={w}")
CASES = pytest.mark.parametrize("dtype,bucket", [(d, b) for d in DTYPES for b in BUCKETS])


@WORLDS
@CASES
def test_stage0_all_reduces_every_padded_bucket_once_per_step(world, dtype, bucket):
    run = runs(world)[(0, dtype, bucket)]
    padded = sum(run["bucket_numels"])
    assert set(run["bytes"]) == {"all_reduce"}, "stage 0 uses all_reduce only (the norm is local)"
    assert run["calls"]["all_reduce"] == STEPS * len(run["bucket_numels"])
    assert run["bytes"]["all_reduce"] == STEPS * 2 * _ring(world, padded * run["element_size"])


@WORLDS
@CASES
@pytest.mark.parametrize("stage", [1, 2], ids=lambda s: f"stage={s}")
def test_stage_moves_2_psi_per_step_reduce_scatter_plus_all_gather(stage, world, dtype, bucket):
    run = runs(world)[(stage, dtype, bucket)]
    n_buckets, padded, esz = len(run["bucket_numels"]), sum(run["bucket_numels"]), run["element_size"]
    assert set(run["bytes"]) == {"reduce_scatter", "all_gather", "all_reduce"}
    assert run["calls"]["reduce_scatter"] == run["calls"]["all_gather"] == STEPS * n_buckets
    assert run["bytes"]["reduce_scatter"] == STEPS * _ring(world, padded * esz)
    assert run["bytes"]["all_gather"] == STEPS * _ring(world, padded * esz)
    # The norm: exactly one scalar all_reduce per step, excluded from the comparison with stage 0.
    assert run["calls"]["all_reduce"] == STEPS
    assert run["bytes"]["all_reduce"] == STEPS * int(2 * _ring(world, NORM_BYTES))


@WORLDS
@CASES
@pytest.mark.parametrize("stage", [1, 2], ids=lambda s: f"stage={s}")
def test_stage_moves_the_same_bytes_per_step_as_stage0(stage, world, dtype, bucket):
    """2(N-1)/N·Ψ·bytes in both, equal up to the padding of the buckets and slots."""
    zero, ours = runs(world)[(0, dtype, bucket)], runs(world)[(stage, dtype, bucket)]
    psi, esz = ours["psi"], ours["element_size"]
    ideal = 2 * _ring(world, psi * esz)
    # Padding: under ALIGN elements per parameter slot, under N·ALIGN per bucket.
    slack = 2 * _ring(world, (ours["slots"] * ALIGN + len(ours["bucket_numels"]) * world * ALIGN) * esz)
    for run in (zero, ours):
        per_step = gradient_bytes(run) / STEPS
        assert ideal <= per_step <= ideal + slack
    assert abs(gradient_bytes(ours) - gradient_bytes(zero)) / STEPS <= slack
    # Where both lay the buckets out without padding differences the match is exact.
    if sum(ours["bucket_numels"]) == sum(zero["bucket_numels"]):
        assert gradient_bytes(ours) == gradient_bytes(zero)
