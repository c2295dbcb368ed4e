"""ZeRO-Infinity's disk tiers (engine/stepping/disk.py, offload_optimizer "nvme"; engine/sharding/on_disk.py,
offload_param "nvme"): the oracle with the fp32 masters and optimizer states on disk at stages 1-3 on 1 and 2
ranks, and at stage 3 with the parameter shards on disk too, their config keys, checkpoints across "nvme", "cpu"
and no offload, and their faults: a missing, read-only or full nvme_path, a failing write and a stalled read,
each an error on every rank within seconds, with no scratch file left behind.

The read-only and full directories are small tmpfs mounts (root only: skipped where mount is refused)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import threading
import time

import pytest
import torch

import oracle
import zerodp
from spawn import run_ranks
from zerodp.engine.engine import inside
from zerodp.engine.stepping import disk as disk_module

# Each stage with other pipeline and aio settings (each must give the same result): stage 1 plain and
# fast_init, stage 2 reading two sub-groups ahead while writing one back (block_size requests in 3 runs on 2
# threads), stage 3 reading ahead only, one system call per request.
SETTINGS = {1: ({"fast_init": True}, {}),
            2: ({"pipeline_read": True, "pipeline_write": True, "buffer_count": 16},
                {"aio": {"block_size": 4096, "queue_depth": 3, "thread_count": 2}}),
            3: ({"pipeline_read": True, "buffer_count": 8}, {"aio": {"single_submit": True, "block_size": 8192}})}
CASES = ["plain", "unused", "tiny_group"]
RUNS = [(case, stage, world) for world in (1, 2) for stage in (1, 2, 3) for case in CASES]
# Stage 3 with the parameter shards on disk too (offload_param "nvme"): a unit per module, so that shards are
# read ahead of the next units' gathers through 3 buffers; the first shards within max_in_cpu stay in memory.
PARAM_CASES = ["plain", "frozen"]
PARAM_RUNS = [(case, world) for world in (1, 2) for case in PARAM_CASES]


def _params(root: str, **keys) -> dict:
    return {"offload_param": {"device": "nvme", "nvme_path": root, "buffer_count": 3, "max_in_cpu": 300, **keys},
            "stage3_unit": "module"}


def _zero(stage: int, root: str) -> dict:
    # small buckets and sub-groups: several sub-groups stream through the pool
    return {"offload_optimizer": {"device": "nvme", "nvme_path": root, **SETTINGS[stage][0]},
            "reduce_bucket_size": 500, "sub_group_size": 700}


def _train(rank, world, case, stage, root):
    return oracle.train_engine(rank, world, case, stage, top=SETTINGS[stage][1], **_zero(stage, root))


def _train_params(rank, world, case, root, meta=False):
    """Stage 3 with the optimizer states and the parameter shards on disk (meta: the model built on the meta
    device, each shard written to the file as it is materialised)."""
    return oracle.train_engine(rank, world, case, 3, top=SETTINGS[3][1], meta=meta, **_zero(3, root), **_params(root))


def _fault(rank, world, kind, root):
    """initialize (and a step) with the fault `kind`; the error's text on this rank, and how long it took."""
    start = time.monotonic()
    params, kind = kind.startswith("param_"), kind.removeprefix("param_")  # param_*: offload_param's tier
    # The parameter files and a "full" fault's files exceed the full tmpfs's 16k on each rank, so that neither
    # rank's fits, whichever checks first: two files that each fit but not together would race for the space.
    wide = params or kind == "full"
    model = oracle.build(oracle.Case(model={"hidden": 80}) if wide else oracle.CASES["plain"])
    cfg = (oracle.config_for(oracle.Case(gas=1), 3, world, reduce_bucket_size=500, **_params(root, max_in_cpu=0))
           if params else
           oracle.config_for(oracle.Case(gas=1), 2, world, offload_optimizer={"device": "nvme", "nvme_path": root}))
    try:
        engine = zerodp.initialize(model, oracle.one_group(model), cfg)
        if kind == "write":  # rank 1's descriptor turned read-only: its next write fails (EBADF)
            tier = inside(engine).sharded.on_disk if params else inside(engine).training.partitioned_optimizer.disk
            if rank == 1:
                read_only = os.open(f"/proc/self/fd/{tier.file.fd}", os.O_RDONLY)
                os.dup2(read_only, tier.file.fd)
                os.close(read_only)
        x, y = oracle.batches(world, 1)[0][0]
        engine.backward(engine(x[:oracle.MICRO], y[:oracle.MICRO]))
        engine.step()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _save_midway(rank, world, root, ckpt, stage=2):
    """4 steps with the states on disk (at stage 3 the parameter shards too), saved after step 2; the final
    weights."""
    case = oracle.Case(gas=1)
    model = oracle.build(case)
    cfg = oracle.config_for(case, stage, world, offload_optimizer={"device": "nvme", "nvme_path": root},
                            **(_params(root, max_in_cpu=0) if stage == 3 else {}))
    engine = zerodp.initialize(model, oracle.one_group(model), cfg)
    for step, micro in enumerate(oracle.batches(world, 1, steps=4)):
        if step == 2:
            engine.save_checkpoint(ckpt)
        mine = slice(rank * oracle.MICRO, (rank + 1) * oracle.MICRO)
        engine.backward(engine(micro[0][0][mine], micro[0][1][mine]))
        engine.step()
    return engine.full_state_dict()


def _jobs(rank, world, jobs):
    run = {"train": _train, "train_params": _train_params, "fault": _fault, "save": _save_midway}
    return {job: run[job[0]](rank, world, *job[1:]) for job in jobs}


@functools.cache
def _mounts() -> dict[str, str] | None:
    """A read-only and a full tmpfs (None where this process may not mount)."""
    out = {}
    for kind, options in (("read_only", "ro,size=1m"), ("full", "size=16k")):
        path = tempfile.mkdtemp(prefix=f"zerodp-nvme-{kind}-")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True).returncode:
            return None
        out[kind] = path
    return out


_MADE: list[str] = []  # the directories the launches made (nvme_path, the checkpoint's), removed at the end


@pytest.fixture(scope="module", autouse=True)
def _unmount():
    yield
    for path in (_mounts() or {}).values():
        subprocess.run(["umount", path], check=False)
        os.rmdir(path)
    for path in _MADE:
        shutil.rmtree(path, ignore_errors=True)


@functools.cache
def runs(world: int) -> tuple[dict, str, list[str]]:
    """Every run of one world size in one launch: (rank 0's results, nvme_path, what is left in it after)."""
    root = tempfile.mkdtemp(prefix="zerodp-nvme-")
    _MADE.append(root)
    jobs = [("train", case, stage, root) for case, stage, w in RUNS if w == world]
    jobs += [("train_params", case, root) for case, w in PARAM_RUNS if w == world]
    jobs += [("fault", "missing", os.path.join(root, "absent"))]
    if world == 2:
        _MADE.append(tempfile.mkdtemp(prefix="zerodp-ckpt-"))
        jobs += [("fault", "write", root), ("fault", "param_write", root), ("save", root, os.path.join(_MADE[-1], "c"))]
        jobs += [("save", root, os.path.join(_MADE[-1], "c3"), 3), ("train_params", "plain", root, True)]
        jobs += [("fault", "param_missing", os.path.join(root, "absent"))]
        if _mounts() is not None:
            jobs += [("fault", kind, path) for kind, path in _mounts().items()]
            jobs += [("fault", f"param_{kind}", path) for kind, path in _mounts().items()]
    ranks = run_ranks(_jobs, world, jobs, timeout_s=120)
    return ranks, root, os.listdir(root)


@pytest.mark.parametrize("case,stage,world", RUNS, ids=[f"{c}-stage={s}-world={w}" for c, s, w in RUNS])
def test_states_on_disk_match_single_process_fp32(case, stage, world):
    ranks, root, _ = runs(world)
    ours, ref = ranks[0][("train", case, stage, root)], oracle.train_reference(case, world)
    assert ours["steps"] == oracle.CASES[case].steps
    for k in ref["state"]:
        torch.testing.assert_close(ours["state"][k], ref["state"][k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert ours["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    memory = ours["memory"]
    assert memory["disk_model_states"] == memory["fp32_master"] + memory["optimizer_states"] > 0
    assert memory["nvme_file"] >= memory["disk_model_states"]
    assert memory["host_model_states"] == memory["nvme_host_buffers"] > 0


@pytest.mark.parametrize("case,world", PARAM_RUNS, ids=[f"{c}-world={w}" for c, w in PARAM_RUNS])
def test_states_and_parameters_on_disk_at_stage3_match_single_process_fp32(case, world):
    ranks, root, _ = runs(world)
    ours, ref = ranks[0][("train_params", case, root)], oracle.train_reference(case, world)
    assert ours["steps"] == oracle.CASES[case].steps
    for k in ref["state"]:
        torch.testing.assert_close(ours["state"][k], ref["state"][k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(ours["params"][k], ref["state"][k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert ours["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    memory = ours["memory"]
    assert memory["params_on_disk"] > 0 and memory["nvme_param_file"] >= memory["params_on_disk"]
    assert memory["params_on_disk"] + memory["params_in_cpu"] == memory["working_params"] + memory["frozen_params"]
    assert memory["disk_model_states"] == memory["fp32_master"] + memory["optimizer_states"] + memory["params_on_disk"]
    assert memory["host_model_states"] == (memory["nvme_host_buffers"] + memory["nvme_param_buffers"]
                                           + memory["params_in_cpu"])


def test_parameters_on_disk_from_a_meta_build_match_single_process_fp32():
    ranks, root, _ = runs(2)
    ours, ref = ranks[0][("train_params", "plain", root, True)], oracle.train_reference("plain", 2)
    for k in ref["state"]:
        torch.testing.assert_close(ours["state"][k], ref["state"][k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert ours["memory"]["params_on_disk"] > 0


@pytest.mark.parametrize("world", [1, 2])
def test_no_scratch_file_is_left_after_the_ranks_exit(world):
    assert runs(world)[2] == []


@pytest.mark.parametrize("tier", ["", "param_"])
def test_a_missing_nvme_path_is_a_clear_error_at_initialize(tier):
    key = "offload_param.nvme_path" if tier else "offload_optimizer.nvme_path"
    for rank in runs(2)[0]:
        error, seconds = next(v for k, v in rank.items() if k[:2] == ("fault", f"{tier}missing"))
        assert key in error and "is not a directory" in error, error
        assert seconds < 30


@pytest.mark.parametrize("tier", ["", "param_"])
@pytest.mark.parametrize("kind,expected", [("read_only", "is not writable"), ("full", "bytes free")])
def test_an_unwritable_or_full_nvme_path_is_an_error_on_every_rank(kind, expected, tier):
    if _mounts() is None:
        pytest.skip("mounting a tmpfs needs root")
    key = "offload_param.nvme_path" if tier else "offload_optimizer.nvme_path"
    for rank in runs(2)[0]:
        error, seconds = next(v for k, v in rank.items() if k[:2] == ("fault", f"{tier}{kind}"))
        assert expected in error and key in error, error
        assert seconds < 30


def test_a_failing_write_is_an_error_on_every_rank():
    errors = [next(v for k, v in rank.items() if k[:2] == ("fault", "write"))[0] for rank in runs(2)[0]]
    assert "writing sub-group" in errors[1] and "Bad file descriptor" in errors[1], errors[1]
    assert "rank 1" in errors[0] and "writing sub-group" in errors[0], errors[0]


def test_a_failing_parameter_write_is_an_error_on_every_rank():
    """Rank 1's parameter file turned read-only: the step's write-back of the new shards fails there, and the
    step ends in that error on both ranks (test_no_scratch_file_is_left_after_the_ranks_exit: nothing left)."""
    errors = [next(v for k, v in rank.items() if k[:2] == ("fault", "param_write"))[0] for rank in runs(2)[0]]
    assert "writing the parameter shard of bucket" in errors[1] and "Bad file descriptor" in errors[1], errors[1]
    assert "rank 1" in errors[0] and "writing the parameter shard" in errors[0], errors[0]


# ---- in one process ------------------------------------------------------------------------------------
def _engine(offload: dict, stage: int = 2, seed: int = 0, timeout: float | None = None):
    torch.manual_seed(seed)
    model = oracle.Toy(hidden=60)
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 900, "sub_group_size": 1500,
                                 **({"offload_optimizer": offload} if offload else {})},
           **({"comm_timeout_s": timeout} if timeout else {})}
    return zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), cfg)


def _steps(engine, first: int, last: int) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, oracle.D_IN, generator=g), 5 * torch.randn(3, oracle.D_OUT, generator=g))
            for _ in range(last)]
    for x, y in data[first:last]:
        engine.backward(engine(x, y))
        engine.step()


@pytest.mark.parametrize("saved,resumed", [("nvme", "cpu"), ("nvme", "none"), ("cpu", "nvme"), ("none", "nvme")])
def test_a_checkpoint_resumes_across_nvme_cpu_and_no_offload(tmp_path, saved, resumed):
    place = {"nvme": {"device": "nvme", "nvme_path": str(tmp_path)}, "cpu": {"device": "cpu"}, "none": None}
    _resumes_as_uninterrupted(tmp_path, lambda seed=0: _engine(place[saved], seed=seed),
                              lambda seed=0: _engine(place[resumed], seed=seed))


def _resumes_as_uninterrupted(tmp_path, saving, resuming) -> None:
    """2 steps built by `saving`, its checkpoint loaded into `resuming` (seed 1) and 2 more steps: equal to 4
    steps of `resuming`, with no scratch file left in the directory."""
    straight = resuming()
    _steps(straight, 0, 4)
    first = saving()
    _steps(first, 0, 2)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    second = resuming(seed=1)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    _steps(second, 2, 4)
    a, b = straight.full_state_dict(), second.full_state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert second.global_steps == 4
    assert [f for f in os.listdir(tmp_path) if f != "ckpt"] == []  # the scratch files are never in the directory


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_saved_from_disk_on_two_ranks_resumes_on_one_with_host_offload(stage):
    """Saved midway by 2 ranks with their states on disk (at stage 3 the parameter shards too), loaded by one
    process with "cpu" offload and the 2 ranks' batch: it ends where the 2 ranks ended."""
    ranks, root, _ = runs(2)
    job = next(k for k in ranks[0] if k[0] == "save" and (len(k) > 3) == (stage == 3))
    case = oracle.Case(gas=1)
    model = oracle.build(case)
    cfg = oracle.config_for(case, stage, 1, offload=True, **({"offload_param": True} if stage == 3 else {}))
    cfg["train_micro_batch_size_per_gpu"] = 2 * oracle.MICRO
    engine = zerodp.initialize(model, oracle.one_group(model), cfg)
    engine.load_checkpoint(job[2])
    for micro in oracle.batches(2, 1, steps=4)[2:]:
        engine.backward(engine(*micro[0]))
        engine.step()
    ended = ranks[0][job]
    for k, v in engine.full_state_dict().items():
        torch.testing.assert_close(v, ended[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_a_stalled_read_is_named_within_comm_timeout_s(tmp_path, monkeypatch):
    engine = _engine({"device": "nvme", "nvme_path": str(tmp_path)}, timeout=1.0)
    real, disk_answers = os.preadv, threading.Event()
    monkeypatch.setattr(disk_module.os, "preadv", lambda *a: disk_answers.wait() and real(*a))
    start = time.monotonic()
    try:
        with pytest.raises(OSError, match=r"reading sub-group 0 of \d+ .* has not finished after 1 s"):
            _steps(engine, 0, 1)
        assert time.monotonic() - start < 30
    finally:
        disk_answers.set()


@pytest.mark.parametrize("fast_init", [True, False])
def test_fast_init_writes_only_the_masters_at_initialize(tmp_path, monkeypatch, fast_init):
    written = []
    real = disk_module.ScratchFile.transfer
    monkeypatch.setattr(disk_module.ScratchFile, "transfer",
                        lambda self, write, offset, buf: written.append(buf.numel() if write else 0)
                        or real(self, write, offset, buf))
    engine = _engine({"device": "nvme", "nvme_path": str(tmp_path), "fast_init": fast_init})
    tier = inside(engine).training.partitioned_optimizer.disk
    masters = sum(tier.slot_bytes)
    assert tier.base[-1] == 3 * masters  # AdamW: each master and its two moments
    assert sum(written) == (masters if fast_init else tier.base[-1])


def test_too_few_buffers_for_the_pipeline_is_refused_naming_the_count(tmp_path):
    with pytest.raises(ValueError, match="buffer_count 4 holds 1 sub-group.*set buffer_count to at least 12"):
        _engine({"device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": True, "pipeline_write": True})


def test_the_step_holds_only_the_pool_and_the_file_holds_the_states(tmp_path):
    """Eight equal layers, a bucket and a sub-group each: between steps no master or moment is in memory,
    and the pool is one sub-group's 2 + 2 buffers, a sixth of the 8 x 3 slots on disk."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 4200, "sub_group_size": 4200,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), cfg)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 64)).square().mean())
        engine.step()
    part = inside(engine).training.partitioned_optimizer
    assert len(part.disk.groups) == 8
    assert all(m.numel() == 0 for m in part.masters)  # between steps nothing of them is in memory
    assert all(t.dim() == 0 for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    report = engine.memory_report()
    slot = part.disk.slot_bytes[0]
    assert report["nvme_host_buffers"] == 4 * slot and report["nvme_file"] == 8 * 3 * slot
    assert report["disk_model_states"] == 3 * 4 * sum(p.numel() for p in model.parameters())


_VERB = {"reading": "read", "writing": "write"}


def _events(tmp_path, monkeypatch, **offload) -> list[tuple]:
    """The transfers started and finished, and the optimizer's steps, in one step over eight sub-groups."""
    events = []
    real_start, real_finish = disk_module.DiskTier._start, disk_module.DiskTier._finish
    monkeypatch.setattr(disk_module.DiskTier, "_start",
                        lambda self, write, g, slot: events.append(("start", "write" if write else "read", g))
                        or real_start(self, write, g, slot))
    monkeypatch.setattr(disk_module.DiskTier, "_finish",
                        lambda self, doing, g, requests: events.append(("finish", _VERB[doing], g))
                        or real_finish(self, doing, g, requests))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 4200, "sub_group_size": 4200,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), **offload}}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), cfg)
    engine.optimizer.register_step_pre_hook(lambda *a: events.append(("step",)))
    events.clear()
    engine.backward(engine(torch.randn(2, 64)).square().mean())
    engine.step()
    return events


@pytest.mark.parametrize("read,write", [(False, False), (True, False), (False, True), (True, True)])
def test_pipeline_read_and_write_overlap_the_transfers_with_the_step(tmp_path, monkeypatch, read, write):
    """pipeline_read: sub-group 1 is being read while sub-group 0 steps; pipeline_write: sub-group 0 is being
    written while sub-group 1 steps. Off: each transfer is finished before the next step."""
    events = _events(tmp_path, monkeypatch, pipeline_read=read, pipeline_write=write, buffer_count=16)
    first_step = events.index(("step",))
    assert (("start", "read", 1) in events[:first_step]) == read
    second_step = events.index(("step",), first_step + 1)
    assert (events.index(("finish", "write", 0)) > second_step) == write
    assert events.count(("step",)) == 8 and sum(e[:2] == ("start", "write") for e in events) == 8


@pytest.mark.parametrize("single_submit", [False, True])
def test_aio_keys_shape_the_requests(tmp_path, monkeypatch, single_submit):
    """block_size cuts a transfer into requests, queue_depth groups them into runs in flight at once (one
    vectored call each, or one call per request with single_submit), on thread_count threads; what is
    written reads back."""
    calls = []
    real = os.pwritev
    monkeypatch.setattr(disk_module.os, "pwritev",
                        lambda fd, bufs, offset: calls.append([len(b) for b in bufs]) or real(fd, bufs, offset))
    settings = disk_module.DiskSettings(str(tmp_path), 4, False, False, True, block_size=8192, queue_depth=3,
                                        thread_count=2, single_submit=single_submit, timeout_s=60, pin=False)
    scratch = disk_module.ScratchFile(str(tmp_path), 0, 10 * 8192, settings)
    assert scratch.pool._max_workers == 2
    out = disk_module.aligned_bytes(10 * 8192)
    out.copy_(torch.randint(0, 255, (10 * 8192,), dtype=torch.uint8))
    runs = scratch.transfer(True, 0, out)
    assert len(runs) == 3 and all(r.result() is None for r in runs)  # 10 requests in runs of 4, 4 and 2
    assert sorted(calls) == ([[8192]] * 10 if single_submit else [[8192] * 2, [8192] * 4, [8192] * 4])
    back = disk_module.aligned_bytes(10 * 8192)
    for r in scratch.transfer(False, 0, back):
        r.result()
    assert torch.equal(back, out)
    scratch.close()
    assert os.listdir(tmp_path) == []


def test_estimates_disk_bytes_are_the_engines_and_its_buffers_bound_the_pool(tmp_path):
    """formulas.on_disk (zerodp estimate --offload nvme) against an engine's memory_report: the same bytes on
    disk, and a pool within the formula's buffers plus each buffer's rounding to 4096 bytes."""
    from zerodp.plan.formulas import on_disk
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 4200, "sub_group_size": 4200,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), cfg)
    engine.backward(engine(torch.randn(2, 64)).square().mean())
    engine.step()
    report = engine.memory_report()
    planned = on_disk(sum(p.numel() for p in model.parameters()), 1, 2, "adamw", sub_group_size=4200, buffer_count=4)
    assert planned["disk"] == report["disk_model_states"]
    assert report["nvme_host_buffers"] <= planned["host_buffers"] + 4 * 4096
    assert planned["traffic"] == 2 * planned["disk"]


def test_estimate_offload_nvme_prints_the_disk_table(capsys):
    from zerodp.plan import estimate
    estimate.main(["--model", "125M", "--world", "8", "--stage", "3", "--measure", "none", "--offload", "nvme",
                   "--step-time", "2"])
    out = capsys.readouterr().out
    assert "Optimizer states on disk" in out and "disk GB/s needed" in out


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_on_disk_trains_as_host_offload_bit_for_bit(tmp_path, dtype):
    """The same host step as "cpu" offload (casts to the working dtype on the host), the states on disk."""
    out = {}
    for device in ("cpu", "nvme"):
        torch.manual_seed(0)
        model = oracle.Toy(hidden=60)
        cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1.0, dtype: {"enabled": True},
               "zero_optimization": {"stage": 2, "reduce_bucket_size": 900, "sub_group_size": 1500,
                                     "offload_optimizer": {"device": device, "nvme_path": str(tmp_path)}}}
        engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
        _steps(engine, 0, 3)
        out[device] = engine.full_state_dict()
    for k in out["cpu"]:
        assert torch.equal(out["nvme"][k], out["cpu"][k]), k


# ---- parameter shards on disk, in one process --------------------------------------------------------
def _stage3(root, offload_param: str = "nvme", offload_optimizer: str = "none", seed: int = 0,
            timeout: float | None = None, **keys):
    """The 60-wide Toy at stage 3, a unit per module, its parameter shards where `offload_param` says."""
    torch.manual_seed(seed)
    model = oracle.Toy(hidden=60)
    place = {"nvme": {"device": "nvme", "nvme_path": str(root), "max_in_cpu": 0, "buffer_count": 3, **keys},
             "cpu": {"device": "cpu"}, "none": {"device": "none"}}
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 900, "sub_group_size": 1500,
                                 "stage3_param_persistence_threshold": 0, "stage3_unit": "module",
                                 "stage3_prefetch_bucket_size": 0, "offload_param": place[offload_param],
                                 "offload_optimizer": {"device": offload_optimizer, "nvme_path": str(root)}},
           **({"comm_timeout_s": timeout} if timeout else {})}
    return zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), cfg)


@pytest.mark.parametrize("saved,resumed", [("nvme", "cpu"), ("nvme", "none"), ("cpu", "nvme"), ("none", "nvme")])
def test_a_checkpoint_resumes_parameters_on_disk_across_nvme_cpu_and_no_offload(tmp_path, saved, resumed):
    """Stage 3 with the parameter shards (and the optimizer states) on disk: saved from the tiers, loaded into
    them, and either way continuing as the uninterrupted run with the other placement."""
    _resumes_as_uninterrupted(tmp_path, lambda seed=0: _stage3(tmp_path, saved, saved, seed=seed),
                              lambda seed=0: _stage3(tmp_path, resumed, resumed, seed=seed))


def test_a_stalled_parameter_read_is_named_within_comm_timeout_s(tmp_path, monkeypatch):
    engine = _stage3(tmp_path, timeout=1.0)
    real, disk_answers = os.preadv, threading.Event()
    monkeypatch.setattr(disk_module.os, "preadv", lambda *a: disk_answers.wait() and real(*a))
    start = time.monotonic()
    try:
        with pytest.raises(OSError, match=r"reading the parameter shard of bucket \d+ \(unit '\w+'.* of .*\.params "
                                          r"\(rank 0's scratch file.* has not finished after 1 s \(comm_timeout_s\)"):
            _steps(engine, 0, 1)
        assert time.monotonic() - start < 30
    finally:
        disk_answers.set()


@pytest.mark.parametrize("buffer_count", [1, 3])
def test_parameter_shards_are_read_ahead_through_buffer_count_buffers(tmp_path, monkeypatch, buffer_count):
    """Once the first forward has given the order, each unit's shard is read while the unit before it computes
    (forward) or after it (backward), buffer_count - 1 ahead, and the next forward's first after a step: a
    gather finds its shard read already. One buffer reads nothing ahead. The shards reach the gathers equal to
    "cpu" offload's, and the host holds only the buffers between steps."""
    from zerodp.engine.sharding.on_disk import ShardsOnDisk
    found = []  # per gather of a shard on disk: was it read ahead?
    real = ShardsOnDisk.reading
    monkeypatch.setattr(ShardsOnDisk, "reading",
                        lambda self, b: found.append(b.index in self.reads) or real(self, b))
    engine = _stage3(tmp_path, buffer_count=buffer_count)
    _steps(engine, 0, 1)
    found.clear()
    _steps(engine, 1, 3)
    tier = inside(engine).sharded.on_disk
    assert len(found) >= 2 * len(tier.offset) >= 6  # each shard gathered in each forward (and backward)
    # (read ahead: all but the backward's first, which the forward's last gather released: one a step)
    assert found.count(False) <= 2 if buffer_count > 1 else not any(found)
    assert len(tier.buffers) == buffer_count
    assert all(b.owned.numel() == 0 for b in inside(engine).layout.gathered)  # only the buffers hold shards
    cpu = _stage3(tmp_path, "cpu")
    _steps(cpu, 0, 3)
    for k, v in cpu.full_state_dict().items():
        assert torch.equal(engine.full_state_dict()[k], v), k


def test_a_shard_larger_than_buffer_size_is_refused_naming_the_size(tmp_path):
    with pytest.raises(ValueError, match=r"offload_param.buffer_size 100 elements is smaller than this rank's shard "
                                         r"of bucket \d+ \([\d,]+ elements, unit '\w+'\).*set buffer_size to at least"):
        _stage3(tmp_path, buffer_size=100)
    assert os.listdir(tmp_path) == []


def test_max_in_cpu_elements_of_shards_stay_in_host_memory(tmp_path):
    """The first buckets whose shards fit in max_in_cpu elements are host tensors for good, the rest in the
    file; memory_report counts each where it is."""
    engine = _stage3(tmp_path, max_in_cpu=4000)
    _steps(engine, 0, 1)
    tier, layout = inside(engine).sharded.on_disk, inside(engine).layout
    kept = [b for b in layout.gathered if b.index in tier.kept]
    assert kept and sum(b.shard_numel for b in kept) <= 4000 < sum(b.shard_numel for b in layout.gathered)
    assert all(b.owned.numel() == b.shard_numel for b in kept)
    assert all(b.owned.numel() == 0 for b in layout.gathered if b.index in tier.offset)
    report = engine.memory_report()
    assert report["params_in_cpu"] == 4 * sum(b.shard_numel for b in kept)
    assert report["params_on_disk"] == report["working_params"] - report["params_in_cpu"] > 0
    assert report["nvme_param_buffers"] == 3 * max(tier.slot.values())
    assert report["host_model_states"] == report["params_in_cpu"] + report["nvme_param_buffers"]
    everything = _stage3(tmp_path, max_in_cpu=10**9)  # DeepSpeed's default: a small model stays in memory
    assert inside(everything).sharded.on_disk.file is None and everything.memory_report()["nvme_param_file"] == 0


def test_estimates_parameter_bytes_on_disk_are_the_engines(capsys, tmp_path):
    """formulas.params_on_disk (zerodp estimate --offload nvme, stage 3's "+ params" row) against an engine's
    memory_report: the parameter partition on disk (the engine's padding to 64-element rows beside it), and
    buffers within the formula's bound plus each buffer's rounding to 4096 bytes."""
    from zerodp.plan import estimate
    from zerodp.plan.formulas import params_on_disk
    engine = _stage3(tmp_path)
    _steps(engine, 0, 1)
    report, slots = engine.memory_report(), [s for b in inside(engine).layout.gathered for s in b.slots]
    n, tensors = sum(s.numel for s in slots), len(slots)  # (the parameters themselves are empty between uses)
    planned = params_on_disk(n, 1, "fp32", buffer_count=3, buffer_size=100_000_000)
    buckets = len(inside(engine).layout.gathered)
    assert planned["disk"] <= report["params_on_disk"] <= planned["disk"] + 4 * 64 * (tensors + buckets)
    assert report["nvme_param_buffers"] <= planned["host_buffers"] + 3 * 4096
    assert planned["traffic"] == 3 * planned["disk"]  # read for the forward and the backward, written once
    estimate.main(["--model", "125M", "--world", "8", "--stage", "3", "--measure", "none", "--offload", "nvme"])
    assert "+ params" in capsys.readouterr().out


def test_weights_written_through_gathered_parameters_reach_the_parameter_file(tmp_path):
    """gathered_parameters(modifier_rank=0) writes the new values into the shards on disk (and the masters):
    the next gathers read them back, and a step starts from them."""
    engine = _stage3(tmp_path)
    model = inside(engine).module
    with engine.gathered_parameters(modifier_rank=0):
        for p in model.parameters():
            p.data.fill_(0.25)
    assert all(b.owned.numel() == 0 for b in inside(engine).layout.gathered)  # back on disk
    with engine.gathered_parameters():
        assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in model.parameters())
    assert all(torch.equal(v, torch.full_like(v, 0.25)) for v in engine.full_state_dict().values())


def test_the_set_up_line_says_where_each_offload_goes():
    from zerodp.engine.summary import set_up_line
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}
    both = {**zero, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    mixed = {**zero, "offload_optimizer": {"device": "cpu"}}
    line = {name: set_up_line(zerodp.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": z}), 1, 1)
            for name, z in (("both", both), ("mixed", mixed))}
    assert "offload: optimizer and parameters to nvme;" in line["both"]
    assert "offload: optimizer to cpu and parameters to nvme;" in line["mixed"]
