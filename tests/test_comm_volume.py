"""ZeRO-2 adds no communication: bytes per step counted at the collective calls (inside(engine).comm.traffic).

Per step and rank, a ring all_reduce moves 2(N-1)/N of the buffer, reduce_scatter and all_gather
(N-1)/N each. Stage 0 all-reduces every gradient bucket; stages 1 and 2 reduce-scatter it and
all-gather the updated parameters: the same 2(N-1)/N·Ψ·bytes, up to the padding of the buckets
(stage 0 pads each bucket to ALIGN elements, stages 1-2 to N·ALIGN). The only other collective in
a step is the all_reduce of the squared gradient norm with the non-finite-loss flags, three fp64 (24 bytes),
and one fp64 "got a gradient" bit per parameter tensor (unused.py), stages 1-2; stage 0 all-reduces
those bits on their own.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zerodp
from zerodp.engine.engine import inside
from in_process import fake_group
from zerodp.engine.layout.flat import ALIGN
from zerodp.engine.sharding.gather import planned_gathers
from zerodp.models.gpt import GPT, gpt_config
from zerodp.plan import communication as comm_plan

STEPS, MICRO, SEQ = 3, 2, 16
NORM_BYTES = 24  # the fp64 squared norm and the two non-finite-loss flags (non_finite.py)


def norm_bytes(run: dict) -> int:
    """The norm's all_reduce: NORM_BYTES and 8 bytes of used bit per parameter tensor (unused.py)."""
    return NORM_BYTES + 8 * run["slots"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BUCKETS = {"one_bucket": 500_000_000, "many_buckets": 30_000}
JOBS = [(stage, dtype, bucket) for stage in (0, 1, 2) for dtype in DTYPES for bucket in BUCKETS]
# Hierarchical sharding, mics_shard_size 2 (flat at world 2): bytes per group against comm_plan.py.
HIER_JOBS = [(stage, "bf16", "many_buckets", 2) for stage in (1, 2, 3)]


def _traffic(rank: int, world: int, stage: int, dtype: str, bucket: str, shard: int = -1) -> dict:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKETS[bucket], "mics_shard_size": shard,
                                    "stage3_param_persistence_threshold": 0}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    assert inside(engine).comm.traffic.total() == 0, "initialize() must reset the tally after its broadcasts"
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS + 1):
        if step == 1:  # stage 3 learns the forward's last unit in the first step; count the steps after it
            inside(engine).comm.traffic.reset()
        tokens = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    traffic = inside(engine).comm.traffic
    # Stage 3 gathers per micro-step: every bucket in the forward, and in the backward those that the
    # model's own unit and the last unit (kept gathered from the forward) do not read.
    gathered = None if inside(engine).sharded.gatherer is None else planned_gathers(
        inside(engine).spec.units, inside(engine).training.partitioned_optimizer.buckets, inside(engine).sharded.gatherer.last_unit)
    return {"bytes": dict(traffic.bytes), "calls": dict(traffic.calls), "psi": psi, "by_group": dict(traffic.by_group),
            "gathered": gathered,
            "bucket_numels": [b.numel for fg in inside(engine).layout.groups for b in fg.buckets],
            "slots": sum(len(b.slots) for fg in inside(engine).layout.groups for b in fg.buckets), "world": world,
            "element_size": torch.empty((), dtype=DTYPES[dtype]).element_size()}


def _all_jobs(rank: int, world: int) -> dict:
    return {job: _traffic(rank, world, *job) for job in JOBS + HIER_JOBS}


@functools.cache
def runs(world: int) -> dict:
    """Rank 0's tallies of every job, for one world size, as rank 0 of `world` on torch's fake process group
    (in_process.py), in this process. Comm tallies a collective before it asks whether its group is fake
    (comm.py's _all_reduce, _reduce_scatter, _all_gather), and the engine makes the same calls on either:
    forked gloo ranks gave these tallies key for key at 2 and 4 ranks, for 3 and 5 processes' CPU."""
    with fake_group(world):
        return _all_jobs(0, world)


def _ring(world: int, nbytes: int) -> float:
    return nbytes * (world - 1) / world


def gradient_bytes(run: dict) -> int:
    """Bytes of the gradient/parameter collectives, the norm's scalar all_reduce taken out."""
    b = dict(run["bytes"])
    b.pop("broadcast", None)
    if b.get("reduce_scatter"):  # stages 1-2: the only all_reduce is the norm, once per step
        return b["reduce_scatter"] + b["all_gather"]
    # stage 0: less the non-finite flags and the used bits
    return b["all_reduce"] - STEPS * int(2 * _ring(run["world"], 16 + 8 * run["slots"]))


WORLDS = pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world={w}")
CASES = pytest.mark.parametrize("dtype,bucket", [(d, b) for d in DTYPES for b in BUCKETS])


@WORLDS
@CASES
def test_stage0_all_reduces_every_padded_bucket_once_per_step(world, dtype, bucket):
    run = runs(world)[(0, dtype, bucket)]
    padded = sum(run["bucket_numels"])
    assert set(run["bytes"]) == {"all_reduce"}, "stage 0 uses all_reduce only (the norm is local)"
    # Every bucket, and the two non-finite flags with the used bits in an all_reduce of their own.
    assert run["calls"]["all_reduce"] == STEPS * (len(run["bucket_numels"]) + 1)
    assert run["bytes"]["all_reduce"] == STEPS * (2 * _ring(world, padded * run["element_size"])
                                                  + int(2 * _ring(world, 16 + 8 * run["slots"])))


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
    assert run["bytes"]["all_reduce"] == STEPS * int(2 * _ring(world, norm_bytes(run)))


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


# ---- hierarchical sharding: per group, and against the plan of `zerodp estimate --comm` ----------
@WORLDS
@pytest.mark.parametrize("stage", [1, 2, 3], ids=lambda s: f"stage={s}")
def test_counted_bytes_per_group_match_the_communication_plan(stage, world):
    run = runs(world)[(stage, "bf16", "many_buckets", 2)]
    job = comm_plan.Job(sum(run["bucket_numels"]), world, stage, 2, run["element_size"], len(run["bucket_numels"]),
                        gathered=run["gathered"], params=run["slots"])
    planned = {(x.group, x.op): x for x in comm_plan.transfers(job)}
    counted = {k: v for k, v in run["by_group"].items() if v and k[1] != "broadcast"}
    assert counted.keys() == planned.keys()
    for key, x in planned.items():  # the tally rounds each call down to whole bytes
        assert counted[key] == pytest.approx(STEPS * x.bytes, abs=STEPS * x.calls), key
    assert sum(run["calls"].values()) == STEPS * sum(x.calls for x in planned.values())


def test_shard_size_2_of_4_keeps_gathers_in_the_pair_and_sends_half_a_shard_across():
    """World 4, S = 2, stage 2: reduce_scatter and all_gather of the padded buckets inside the pair
    (intra-node when pairs share a node), all_reduce of the 1/2 shard across the pairs (inter-node):
    each ring sends half of the buffer here; only the norm (24 bytes and the used bits) uses the whole world."""
    run = runs(4)[(2, "bf16", "many_buckets", 2)]
    g, nbytes = run["by_group"], sum(run["bucket_numels"]) * run["element_size"]
    assert g[("shard", "reduce_scatter")] == g[("shard", "all_gather")] == STEPS * nbytes / 2
    assert g[("replica", "all_reduce")] == STEPS * 2 * _ring(2, nbytes / 2)
    assert {k for k, v in g.items() if v and k[0] == "world"} == {("world", "all_reduce")}
    assert g[("world", "all_reduce")] == STEPS * int(2 * _ring(4, norm_bytes(run)))
