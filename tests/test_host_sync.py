"""The step path without host syncs, and a fake world whose gradients are real numbers.

Host syncs: `DeviceReads` (a TorchDispatchMode) counts, during engine.backward() and engine.step(),
what would make the host wait for a GPU:
  - `aten._local_scalar_dense`: item(), bool(), int(), float() of a tensor, a tensor in an `if`. On a
    device tensor it is a blocking device-to-host read; on the CPU it is counted all the same, as the
    read it would be (the engine's tensors are on its device). This is what the CPU can show.
  - copies (`aten._to_copy`, `aten.copy_`) from a device tensor into host memory that is not pinned,
    or not non_blocking (`.cpu()`, `.to("cpu")`, `.tolist()` of a device tensor), and copies from
    pageable host memory to a device (a blocking copy behind the whole stream). Seen only where the
    engine's device is not the CPU: between CPU tensors these are no transfer (and `.cpu()` or
    `.tolist()` of a CPU tensor dispatches nothing).
The engine reads a step's decision without a sync with `non_finite.read_back: "next_step"` (the
default on an accelerator); "same_step" asks for one read per step, which the test sees.

Fake world: one process as rank 0 of N on torch's "fake" process group (zerodp estimate --measure
real, zerodp bench --fake-world). Its collectives send nothing; zerodp gives them the values of a
world whose every rank holds this rank's data, so a gradient shard is this rank's chunk of the
one-process gradient (of the parameters it gathered: in stage 3 rank 0's chunk in every place),
whatever the allocator held there before. The test fills every uninitialised
tensor with nan (torch's deterministic mode), as a GPU's reused memory may be.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logs
import oracle
import zerodp
from zerodp.engine.engine import inside
from in_process import fake_group
from spawn import run_ranks
from zerodp.distributed.device import accelerator_type, current
from zerodp.monitor.step import StepMonitor
from test_non_finite import BAD, lr_schedule

aten = torch.ops.aten

FAKE_WORLD = 4
STAGES = [0, 1, 2, 3]


@contextlib.contextmanager
def _uninitialised_memory_is_nan():
    """torch's deterministic mode fills every uninitialised tensor with nan (torch.empty gives nan), for the
    block only: the test process's later tests run as before."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def _fake_world_step(stage: int) -> dict:
    """Rank 0 of FAKE_WORLD on the fake group: its gradient shard after one backward, the plain
    PyTorch gradient of the same batch and parameters laid out the same way, and what the step did."""
    case = oracle.CASES["plain"]
    model = oracle.build(case)
    plain = copy.deepcopy(model)
    cfg = oracle.config_for(oracle.Case(gas=1, clip=0.0), stage, FAKE_WORLD)
    engine = zerodp.initialize(model, case.optimizer(model), cfg)
    # Stage 3 gathers its parameters through the fake collective too: every rank's chunk is rank 0's.
    with engine.gathered_parameters():
        plain.load_state_dict({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    x, y = oracle.batches(1, 1)[0][0]
    engine.backward(engine(x, y))
    inside(engine).training.reducer.wait()  # stages 0-1 finish their reductions at the step
    grads = [g.clone() for g in inside(engine).training.reducer.shard_grads()]
    plain(x, y).backward()
    by_name = dict(plain.named_parameters())
    names = {id(p): n for n, p in engine.module.named_parameters()}
    expected = []
    for b in inside(engine).training.partitioned_optimizer.buckets:
        flat = torch.zeros(b.numel)
        for s in b.slots:
            flat[s.offset:s.offset + s.numel] = by_name[names[id(s.param)]].grad.reshape(-1)
        rank = inside(engine).training.partitioned_optimizer.rank
        expected.append(flat if stage == 0 else flat[rank * b.shard_numel:(rank + 1) * b.shard_numel])
    engine.step()
    out = {"grads": grads, "expected": expected, "skipped": engine.skipped_steps,
           "masters_finite": all(bool(torch.isfinite(m).all()) for m in inside(engine).training.partitioned_optimizer.masters)}
    return out


@functools.cache
def fake_world() -> dict:
    """Every stage's run, in this process (a fake process group each, destroyed after it): no child to fork,
    whose copy of this process's gloo and OpenMP threads once hung it, nor a fresh interpreter to spawn, whose
    imports cost ~5 s of CPU (what a fresh one adds, no earlier test's state, deterministic mode gives here:
    every uninitialised tensor is nan, so a gradient the fake collective failed to write shows)."""
    out = {}
    with _uninitialised_memory_is_nan():
        for stage in STAGES:
            with fake_group(FAKE_WORLD):
                out[stage] = _fake_world_step(stage)
    return out


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage={s}")
def test_fake_world_gradient_shard_is_this_ranks_share_of_the_plain_gradient(stage):
    out = fake_world()[stage]
    for got, want in zip(out["grads"], out["expected"], strict=True):
        assert torch.isfinite(got).all(), "the fake collective left an unwritten (nan) gradient"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert out["skipped"] == 0 and out["masters_finite"]


class DeviceReads(TorchDispatchMode):
    """The ops that would wait for the device (see the module docstring), as (op, where) pairs."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            self.seen.append(f"{func} of a {args[0].device.type} tensor of shape {tuple(args[0].shape)}")
        elif func in (aten._to_copy.default, aten.copy_.default):
            self._copy(func, args, kwargs)
        return func(*args, **kwargs)

    def _copy(self, func, args, kwargs) -> None:
        if func is aten.copy_.default:
            dst, src, blocking = args[0], args[1], not (args[2] if len(args) > 2 else kwargs.get("non_blocking"))
            dst_device, pinned = dst.device, dst.device.type == "cpu" and dst.is_pinned()
        else:
            src, blocking = args[0], not kwargs.get("non_blocking", False)
            dst_device, pinned = kwargs.get("device") or src.device, bool(kwargs.get("pin_memory"))
        to_host = src.device.type != "cpu" and torch.device(dst_device).type == "cpu"
        from_pageable = src.device.type == "cpu" and torch.device(dst_device).type != "cpu" and not src.is_pinned()
        if (to_host and (blocking or not pinned)) or from_pageable:
            self.seen.append(f"{func} from {src.device} to {dst_device} (blocking {blocking}, pinned {pinned})")


def _fused_config(stage: int, world: int, dtype: str, read_back: str) -> dict:
    cfg = oracle.config_for(oracle.CASES["plain"], stage, world, dtype)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": oracle.LR, "weight_decay": 0.1}}  # fused=True
    cfg["non_finite"] = {"read_back": read_back, "policy": "skip"}
    return cfg


def _reads_per_step(rank: int, world: int, stage: int, dtype: str, read_back: str) -> list[list[str]]:
    """What DeviceReads saw in backward() and step() of each step after the first two (steady state:
    the optimizer state exists, the gather order is known)."""
    sl = slice(rank * oracle.MICRO, (rank + 1) * oracle.MICRO)
    model = oracle.build(oracle.CASES["plain"])
    engine = zerodp.initialize(model, None, _fused_config(stage, world, dtype, read_back), lr_scheduler=lr_schedule)
    seen = []
    for step, micro in enumerate(oracle.batches(world, oracle.CASES["plain"].gas)):
        reads = DeviceReads()
        for x, y in micro:  # on the engine's device (a GPU's in a world of one there)
            loss = engine(x[sl].to(inside(engine).spec.device), y[sl].to(inside(engine).spec.device))
            with reads if step >= 2 else contextlib.nullcontext():
                engine.backward(loss)
                engine.step()
        if step >= 2:
            seen.append(reads.seen)
    return seen


def _reads_jobs(rank: int, world: int, jobs: list[tuple]) -> dict:
    return {job: _reads_per_step(rank, world, *job) for job in jobs}


# bf16 in a world of one only: on a CPU without bf16 kernels it is slow, and two ranks add nothing to it.
READ_JOBS = {1: [(stage, dtype, read_back) for stage in STAGES for dtype in ("fp32", "bf16")
                 for read_back in ("next_step", "same_step")],
             2: [(stage, "fp32", read_back) for stage in STAGES for read_back in ("next_step", "same_step")]}


@functools.cache
def reads(world: int) -> list[dict]:
    if world == 1:
        try:
            return [_reads_jobs(0, 1, READ_JOBS[1])]  # on one thread, as every in-process test (conftest.py)
        finally:
            torch.distributed.destroy_process_group()
    return [ranks["reads"] for ranks in world2()]


def _world2_jobs(rank: int, world: int) -> dict:
    """The reads and the skipped-step runs on 2 ranks: one launch (forking ranks and their gloo group is
    the slow part)."""
    return {"reads": _reads_jobs(rank, world, READ_JOBS[2]), "skip": _skip_jobs(rank, world, SKIP_JOBS)}


@functools.cache
def world2() -> list[dict]:
    return run_ranks(_world2_jobs, 2)


@pytest.mark.parametrize("stage, dtype, world", [(stage, dtype, world) for world, jobs in READ_JOBS.items()
                                                 for stage, dtype, read_back in jobs if read_back == "next_step"])
def test_backward_and_step_read_nothing_back_from_the_device_at_steady_state(stage, dtype, world):
    for rank, runs in enumerate(reads(world)):
        for step, seen in enumerate(runs[(stage, dtype, "next_step")], start=3):
            assert seen == [], f"rank {rank}, step {step}: {seen}"


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world={w}")
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage={s}")
def test_same_step_read_back_reads_the_decision_once_per_step(stage, world):
    for runs in reads(world):
        for seen in runs[(stage, "fp32", "same_step")]:
            assert len(seen) == 1 and "_local_scalar_dense" in seen[0], seen


def _skip_run(rank: int, world: int, stage: int, dtype: str, read_back: str, bad: frozenset, limit: int) -> dict:
    """oracle's plain case with the fused AdamW and an lr schedule; the last rank's loss is nan in the
    first micro-step of the steps in `bad`. Between steps rank 0 reads the lr, the others nothing."""
    sl = slice(rank * oracle.MICRO, (rank + 1) * oracle.MICRO)
    model = oracle.build(oracle.CASES["plain"])
    cfg = _fused_config(stage, world, dtype, read_back)
    cfg["non_finite"].update(policy="raise", max_consecutive_skips=limit)
    engine = zerodp.initialize(model, None, cfg, lr_scheduler=lr_schedule)
    error = raised_at = None
    with logs.captured("zerodp") as lines:
        try:
            for step, micro in enumerate(oracle.batches(world, oracle.CASES["plain"].gas)):
                for j, (x, y) in enumerate(micro):
                    x = x[sl].clone()
                    if step in bad and rank == world - 1 and j == 0:
                        x[0, 0] = float("nan")
                    engine.backward(engine(x, y[sl]))
                    engine.step()
                if rank == 0:  # a read of the engine's state on one rank settles the step there only
                    engine.get_lr()
        except zerodp.NonFiniteError as e:
            error, raised_at = str(e), (engine.global_steps, step)
    return {"state": engine.full_state_dict(), "optimizer": [dict(s) for s in engine.optimizer.state.values()],
            "lr": engine.get_lr(), "skipped": engine.skipped_steps, "steps": engine.global_steps,
            "log": lines, "error": error, "raised_at": raised_at}


SKIP_DTYPES = [(stage, "fp32") for stage in STAGES] + [(2, "bf16"), (3, "bf16")]
SKIP_JOBS = ([(stage, dtype, read_back, frozenset({BAD}), 3) for stage, dtype in SKIP_DTYPES
              for read_back in ("next_step", "same_step")]
             + [(stage, "fp32", read_back, frozenset({1, 2}), 2) for stage in STAGES
                for read_back in ("next_step", "same_step")])


def _skip_jobs(rank: int, world: int, jobs: list[tuple]) -> dict:
    return {job: _skip_run(rank, world, *job) for job in jobs}


def skip_runs() -> list[dict]:
    return [ranks["skip"] for ranks in world2()]


@pytest.mark.parametrize("stage, dtype", SKIP_DTYPES)
def test_a_step_skipped_on_the_device_trains_exactly_as_one_skipped_by_the_host(stage, dtype):
    for rank, runs in enumerate(skip_runs()):
        device, host = (runs[(stage, dtype, rb, frozenset({BAD}), 3)] for rb in ("next_step", "same_step"))
        assert device["skipped"] == host["skipped"] == 1 and device["steps"] == host["steps"] == oracle.STEPS
        for name, value in host["state"].items():
            assert torch.equal(device["state"][name], value), f"rank {rank}: {name}"
        for a, b in zip(device["optimizer"], host["optimizer"], strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b), f"rank {rank}: optimizer state (step counts too)"
        assert device["lr"] == host["lr"], "the scheduler steps after taken steps only, as on the host"
        assert device["log"] == host["log"] and (rank > 0 or len(host["log"]) == 1), (device["log"], host["log"])


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage={s}")
def test_next_step_read_back_raises_at_the_next_step_with_the_same_error_and_model(stage):
    for runs in skip_runs():
        device, host = (runs[(stage, "fp32", rb, frozenset({1, 2}), 2)] for rb in ("next_step", "same_step"))
        assert host["error"] is not None and device["error"] == host["error"]
        # The same global step raises, on every rank in the next step() call (rank 0, which settled it
        # earlier by reading the lr, too: an error there would leave rank 1 alone in a collective).
        assert host["raised_at"] == (3, 2) and device["raised_at"] == (3, 3), (host["raised_at"], device["raised_at"])
        assert device["skipped"] == host["skipped"] == 2
        for name, value in host["state"].items():
            assert torch.equal(device["state"][name], value), name


@pytest.mark.parametrize("what, cfg, optimizer", [
    ("found_inf", {}, oracle.one_group),  # torch's default AdamW (foreach): no found_inf
    ("offload_optimizer", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, None),
    ("dynamic loss scale", {"fp16": {"enabled": True}}, None),
])
def test_next_step_read_back_where_the_device_cannot_skip_is_refused(what, cfg, optimizer):
    config = _fused_config(2, 1, "fp32", "next_step")
    for key, value in cfg.items():
        config[key] = {**config.get(key, {}), **value}
    model = oracle.build(oracle.CASES["plain"])
    with pytest.raises(zerodp.ConfigError, match=f"non_finite.read_back .*{what}"):
        zerodp.initialize(model, optimizer(model) if optimizer else None, config)


@pytest.mark.skipif(accelerator_type() != "cuda", reason="needs a CUDA device: on the CPU values are read as they come")
def test_monitor_reads_a_gpu_steps_values_only_once_their_copy_has_landed():
    config = zerodp.load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    device = current()
    monitor = StepMonitor(config, SimpleNamespace(rank=0, world_size=1, everyone=SimpleNamespace(rank=0)), device)
    with logs.captured("zerodp") as lines:
        torch.cuda._sleep(2 ** 31)  # about a second of GPU work queued before the values exist
        loss = torch.full((), 3.25, device=device)
        monitor.after_step(1, loss, 1, torch.full((), 0.5, device=device), lambda: 1e-3, 1.0, lambda: 0)
        monitor.flush()  # at once: the copy is still queued behind the sleep
    assert "loss 3.2500" in lines[-1][1] and "grad_norm 0.5" in lines[-1][1], lines
