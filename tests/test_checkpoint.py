"""Checkpoints: resume on other world sizes and stages exactly, atomic saves, consolidation, errors.

Three sets of ranks do the distributed work (4 gloo ranks, then 2); a world of one runs in this
process. Every run trains on the same global batch of 12 samples per step however it is split
(world x gradient accumulation = 4), so a resumed run must continue exactly like an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import oracle
import zerodp
from spawn import run_ranks
from zerodp import checkpoint as ck

MICRO, GLOBAL, SAVE_AT, STEPS = 3, 12, 2, 5


# ---- one training run, on any world size -------------------------------------------------------
def config(world: int, stage: int, dtype: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL // MICRO // world,
           "gradient_clipping": 1.0, "seed": 5, "zero_optimization": {"stage": stage},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear",
                                                         "warmup_max_lr": 1e-2}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def global_batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL, oracle.D_IN, generator=g), 5 * torch.randn(GLOBAL, oracle.D_OUT, generator=g))
            for _ in range(steps)]


def make_engine(world: int, stage: int, dtype: str = "fp32", seed: int = 0, model_kw: dict | None = None):
    torch.manual_seed(seed)
    model = oracle.Toy(**(model_kw or {}))
    return zerodp.initialize(model, oracle.two_groups(model), config(world, stage, dtype))


def train(engine, rank: int, world: int, steps: range) -> None:
    gas, batches = engine.gas, global_batches()
    for step in steps:
        x, y = batches[step]
        for k in range(gas):
            sl = slice((rank * gas + k) * MICRO, (rank * gas + k + 1) * MICRO)
            engine.backward(engine(x[sl], y[sl]))
            engine.step()


def snapshot(engine) -> dict:
    return {"pieces": ck.local_state(engine), "full": engine.full_state_dict(),
            "scaler": engine.scaler.state_dict(), "lr": engine.get_lr(), "steps": engine.global_steps,
            "working": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}


def save_run(rank: int, world: int, stage: int, path: str, dtype: str = "fp32") -> dict:
    """Train SAVE_AT steps, save, train on to STEPS: the snapshot at the save and at the end."""
    engine = make_engine(world, stage, dtype)
    train(engine, rank, world, range(SAVE_AT))
    engine.save_checkpoint(path, client_state={"data": {"step": SAVE_AT, "rank": rank}})
    at_save = snapshot(engine)
    train(engine, rank, world, range(SAVE_AT, STEPS))
    return {"at_save": at_save, "end": snapshot(engine)}


def resume_run(rank: int, world: int, stage: int, path: str, dtype: str = "fp32") -> dict:
    """A fresh engine (other initial weights) loads the checkpoint and trains on to STEPS."""
    engine = make_engine(world, stage, dtype, seed=1)
    client = engine.load_checkpoint(path)
    loaded = snapshot(engine)
    train(engine, rank, world, range(SAVE_AT, STEPS))
    return {"client": client, "loaded": loaded, "end": snapshot(engine)}


def run_jobs(rank: int, world: int, jobs: list[tuple]) -> dict:
    """Many runs in one set of ranks, in order: ('save'|'resume', key, stage, path, dtype)."""
    fns = {"save": save_run, "resume": resume_run}
    return {job[1]: fns[job[0]](rank, world, *job[2:]) for job in jobs}


# ---- the runs, shared by the tests ---------------------------------------------------------------
@functools.cache
def workdir() -> str:
    return tempfile.mkdtemp(prefix="zerodp-ckpt-test-")


def ckpt(name: str) -> str:
    return os.path.join(workdir(), name)


@contextlib.contextmanager
def world_of_one():
    """A one-rank process group in this process: no spawn needed for world = 1."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@functools.cache
def runs() -> dict:
    """{world: {job key: [result per rank]}}, run once in dependency order: 4 -> 1 -> 2."""
    out = {4: _by_key(run_ranks(run_jobs, 4, [("save", "s2", 2, ckpt("w4"))]))}
    with world_of_one():
        out[1] = _by_key([run_jobs(0, 1, [("resume", "from4", 2, ckpt("w4")),
                                          ("save", "s1", 1, ckpt("w1"))])])
    out[2] = _by_key(run_ranks(run_jobs, 2, [
        ("resume", "from4", 2, ckpt("w4")), ("resume", "from1", 1, ckpt("w1")),
        ("save", "stage2", 2, ckpt("st2")), ("resume", "2to0", 0, ckpt("st2")),
        ("save", "stage0", 0, ckpt("st0")), ("resume", "0to2", 2, ckpt("st0")),
        ("save", "bf16_save", 2, ckpt("bf16"), "bf16"), ("resume", "bf16_resume", 1, ckpt("bf16"), "bf16"),
        ("save", "fp16_save", 1, ckpt("fp16"), "fp16"), ("resume", "fp16_resume", 2, ckpt("fp16"), "fp16"),
    ]))
    return out


def _by_key(per_rank: list[dict]) -> dict:
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The layout-free model + optimizer state: every saved piece of every rank, put together."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for snap in per_rank:
        for key, t in snap["pieces"].items():
            if key.startswith(("master/", "optim/")):
                name, _, start = key.rpartition("@")
                parts.setdefault(name, {})[int(start)] = t
    out = {name: torch.cat([p[s] for s in sorted(p)]) for name, p in parts.items()}
    out.update({k: t for k, t in per_rank[0]["pieces"].items() if k.startswith("optim_scalar/")})
    return out


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_close(a: dict, b: dict, tol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")


# ---- resume on other world sizes and stages ------------------------------------------------------
RESUMES = {  # (resumed on world, job key): (saved on world, job key)
    (2, "from4"): (4, "s2"), (1, "from4"): (4, "s2"), (2, "from1"): (1, "s1"),
    (2, "2to0"): (2, "stage2"), (2, "0to2"): (2, "stage0"),
}


@pytest.mark.parametrize("resumed,saved", list(RESUMES.items()),
                         ids=[f"world={s[0]}->{r[0]}[{r[1]}]" for r, s in RESUMES.items()])
def test_resume_restores_state_exactly_and_continues(resumed, saved):
    before = runs()[saved[0]][saved[1]]
    after = runs()[resumed[0]][resumed[1]]
    pieces = assemble([r["at_save"] for r in before])
    assert any(k.startswith("optim/exp_avg_sq/") for k in pieces) and any("/step" in k for k in pieces)
    assert_identical(assemble([r["loaded"] for r in after]), pieces)
    for r in after:
        assert_identical(r["loaded"]["full"], before[0]["at_save"]["full"])
        assert r["loaded"]["lr"] == before[0]["at_save"]["lr"] and r["loaded"]["steps"] == SAVE_AT
        assert r["client"] == {"data": {"step": SAVE_AT, "rank": 0}}
    for r in after:  # the uninterrupted run and the resumed one end on the same weights
        assert_close(r["end"]["full"], before[0]["end"]["full"])
        assert r["end"]["lr"] == before[0]["end"]["lr"]


def test_bf16_round_trip_masters_exact_working_params_rounded():
    saved = runs()[2]["bf16_save"][0]["at_save"]
    for r in runs()[2]["bf16_resume"]:
        loaded = r["loaded"]
        assert_identical(loaded["full"], saved["full"])
        for name, w in loaded["working"].items():
            assert w.dtype == torch.bfloat16
            assert torch.equal(w, loaded["full"][name].to(torch.bfloat16)), name
        assert_close(r["end"]["full"], runs()[2]["bf16_save"][0]["end"]["full"], tol=1e-2)
    assert_identical(assemble([r["loaded"] for r in runs()[2]["bf16_resume"]]),
                     assemble([r["at_save"] for r in runs()[2]["bf16_save"]]))


def test_fp16_loss_scaler_state_restored():
    saved = runs()[2]["fp16_save"][0]["at_save"]
    assert saved["scaler"]["dynamic"] and saved["scaler"]["cur_iter"] == SAVE_AT
    assert saved["scaler"]["scale"] != 2.0 ** 8, "the scale must have moved before the save"
    for r in runs()[2]["fp16_resume"]:
        assert r["loaded"]["scaler"] == saved["scaler"]
        assert_identical(r["loaded"]["full"], saved["full"])
        assert r["end"]["scaler"] == runs()[2]["fp16_save"][0]["end"]["scaler"]
