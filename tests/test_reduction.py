"""Specification of the gradient reduction keys, on 2 gloo ranks in one spawn:
prescale_gradients / gradient_predivide_factor (where the division by the world size happens, as
DeepSpeed does it), communication_data_type (the dtype gradients are summed in),
data_types.grad_accum_dtype, seed, and checkpoint.tag_validation (tags differing between ranks).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import oracle
import zerodp
from zerodp.engine.engine import inside
from spawn import run_ranks

WORLD = 2
OVERFLOW_KEYS = ({}, {"prescale_gradients": True}, {"gradient_predivide_factor": 2.0},
                 {"gradient_predivide_factor": 1.0})
# A whole bucket divided before the sum (stage 0), the owned chunk multiplied after it (stage 1), a
# shard multiplied after it (stages 2-3 share that path), with fp32 comm on fp32 gradients: a no-op.
ORACLE_KEYS = [({"prescale_gradients": True}, 0), ({"gradient_predivide_factor": 2.0}, 1),
               ({"gradient_predivide_factor": 8.0, "communication_data_type": "fp32"}, 2)]


def _oracle_run(rank: int, world: int, keys: dict, stage: int) -> dict:
    """oracle.train_engine with top-level config keys added (it sets zero_optimization keys only)."""
    original = oracle.config_for
    oracle.config_for = lambda *a, **kw: {**original(*a, **kw), **keys}
    try:
        return oracle.train_engine(rank, world, "plain", stage)["state"]
    finally:
        oracle.config_for = original


def _overflows(rank: int, world: int, keys: dict, stage: int) -> bool:
    """fp16, static scale 1: every rank's gradient is 40000, fp16's largest value 65504. A sum of the
    raw gradients overflows at 2 ranks; a sum of them divided first does not. Returns whether the
    step was skipped."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    config = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "loss_scale": 1.0},
              "zero_optimization": {"stage": stage}, **keys}
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), config)
    engine.backward((engine.module.weight * 40000.0).sum())
    engine.step()
    return engine.skipped_steps == 1


def _reduced_bf16(rank: int, world: int, comm_dtype: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's reduced gradient shard of a stage-2 bf16 engine over 2 micro-steps, accumulated in
    fp32, and the exact fp64 mean of every rank's and micro-step's bf16 gradients, the same shard)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    data = [[torch.randn(8, 64, generator=torch.Generator().manual_seed(100 + 10 * r + m)) for m in range(2)]
            for r in range(world)]
    exact = []
    for x in (x for per_rank in data for x in per_rank):  # every bf16 gradient, computed on each rank
        local = nn.Linear(64, 64).bfloat16()
        local.load_state_dict(model.state_dict())
        (local(x.bfloat16()).square().sum() / 2).backward()  # / gradient_accumulation_steps, as the engine
        exact.append({id(p): q.grad.double() for p, q in zip(model.parameters(), local.parameters())})
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}}
    if comm_dtype is not None:
        config["communication_data_type"] = comm_dtype
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), config)
    for x in data[rank]:
        engine.backward(engine(x).square().sum())
    (bucket,), (grad,) = inside(engine).training.reducer.buckets, inside(engine).training.reducer.shard_grads()
    full = torch.zeros(bucket.numel, dtype=torch.float64)
    for s in bucket.slots:
        full[s.offset:s.offset + s.numel] = sum(e[id(s.param)] for e in exact).reshape(-1) / world
    return grad.double(), bucket.shard(full, rank)


def _accum_dtypes(rank: int, world: int) -> dict:
    out = {}
    for accum in (None, "fp32", "bf16"):
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 2}}
        if accum is not None:
            config["data_types"] = {"grad_accum_dtype": accum}
        engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        out[accum] = inside(engine).training.reducer.acc_dtype
    return out


def _seeded(rank: int, world: int) -> torch.Tensor:
    zerodp.initialize(nn.Linear(2, 2), None, {"train_micro_batch_size_per_gpu": 1, "seed": 7,
                                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return torch.rand(3)


def _different_tags(rank: int, world: int, directory: str) -> str:
    model = nn.Linear(2, 2)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {"train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": "Warn"}})
    try:
        engine.save_checkpoint(directory, tag=f"tag_of_rank{rank}")
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        return f"{type(e).__name__}: {e}"
    return "saved"


def _different_save_dirs(rank: int, world: int, directory: str) -> tuple[str, list[str]]:
    """Each rank saves into a folder of its own name (as a clock-named folder would be)."""
    model = nn.Linear(2, 2)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"train_micro_batch_size_per_gpu": 1})
    os.makedirs(directory, exist_ok=True)
    mine = os.path.join(directory, f"run_{rank}")
    try:
        engine.save_checkpoint(mine)
        error = "saved"
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        error = f"{type(e).__name__}: {e}"
    dist.barrier()
    return error, sorted(os.listdir(directory))


def _all(rank: int, world: int, directory: str) -> dict:
    return {
        "oracle": {(tuple(k.items()), s): _oracle_run(rank, world, k, s) for k, s in ORACLE_KEYS},
        "overflow": {(tuple(k.items()), s): _overflows(rank, world, k, s)
                     for k in OVERFLOW_KEYS for s in (0, 2)},
        "bf16": {c: _reduced_bf16(rank, world, c) for c in (None, "fp32")},
        "accum": _accum_dtypes(rank, world),
        "seed": _seeded(rank, world),
        "tags": _different_tags(rank, world, directory),
        "dirs": _different_save_dirs(rank, world, os.path.join(directory, "dirs")),
    }


@functools.cache
def ranks() -> list[dict]:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        return run_ranks(_all, WORLD, d, timeout_s=120)


@pytest.mark.parametrize("keys, stage", ORACLE_KEYS, ids=[f"{k}-stage{s}" for k, s in ORACLE_KEYS])
def test_prescale_predivide_and_fp32_comm_keep_the_fp32_oracle(keys, stage):
    reference = oracle.train_reference("plain", WORLD)["state"]
    state = ranks()[0]["oracle"][(tuple(keys.items()), stage)]
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [0, 2])
def test_where_the_division_by_the_world_happens_is_deepspeeds(stage):
    overflow = ranks()[0]["overflow"]
    # Unset, as DeepSpeed: stage 0 sums then divides (2 x 40000 > 65504 overflows in fp16), the ZeRO
    # stages divide first.
    assert overflow[((), stage)] == (stage == 0)
    assert not overflow[((("prescale_gradients", True),), stage)]  # divides by 2 first
    assert not overflow[((("gradient_predivide_factor", 2.0),), stage)]  # by 2 first, by 1 after
    assert overflow[((("gradient_predivide_factor", 1.0),), stage)]  # by 1 first: the raw sum


def test_bf16_gradients_reduced_in_fp32_are_closer_to_the_exact_mean():
    """Reduced in bf16 each micro-step's sum is rounded to bf16 before the fp32 accumulation; in fp32
    only fp32 rounding is left."""
    for r in ranks():
        errors = {comm: ((reduced - exact).abs() / exact.abs().clamp_min(1e-12)).max().item()
                  for comm, (reduced, exact) in r["bf16"].items()}
        assert errors["fp32"] < 1e-6 < 2.0 ** -10 < errors[None], errors


def test_grad_accum_dtype_sets_the_accumulation_dtype():
    assert ranks()[0]["accum"] == {None: torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16}


def test_grad_accum_dtype_other_than_working_or_fp32_is_refused():
    with pytest.raises(zerodp.ConfigError, match=r"'data_types.grad_accum_dtype' = \"fp16\" is not supported "
                                                 r"with torch.bfloat16 training.*use \"fp32\""):
        zerodp.load_config({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}})


def test_seed_seeds_every_rank_with_seed_plus_rank():
    drawn = [r["seed"] for r in ranks()]
    for rank, values in enumerate(drawn):
        torch.manual_seed(7 + rank)
        assert torch.equal(values, torch.rand(3))


def test_checkpoint_tags_differing_between_ranks_fail_on_every_rank():
    messages = [r["tags"] for r in ranks()]
    assert all("different checkpoint tags" in m and "tag_of_rank1" in m for m in messages), messages


def test_save_dirs_differing_between_ranks_fail_on_every_rank_before_anything_is_written():
    for error, listing in (r["dirs"] for r in ranks()):
        assert error.startswith("CheckpointError: ranks passed different save_dir") and "run_1" in error, error
        assert listing == [], listing


def test_tag_validation_ignore_is_refused_and_modes_are_case_insensitive():
    with pytest.raises(zerodp.ConfigError, match=r"'checkpoint.tag_validation' = \"Ignore\".*always checked"):
        zerodp.load_config({"checkpoint": {"tag_validation": "Ignore"}})
    assert zerodp.load_config({"checkpoint": {"tag_validation": "FAIL"}}).checkpoint.tag_validation == "Fail"
