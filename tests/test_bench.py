"""`zerodp bench` runs end to end at tiny size on CPU: every mode measured or skipped with a reason.

Speed itself is never asserted here (DESIGN.md: speed is measured by benchmarks, not timed tests);
what is asserted is the harness: one row per requested mode, plain PyTorch as the baseline of the
same run, the same model and batch everywhere (identical fp32 losses), JSON that says how it was made.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from zerodp import bench

TINY = ["--model", "tiny", "--micro-batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1",
        "--dtype", "fp32", "--threads", "1", "--world", "1"]


# One mode of each kind the worker builds (a process each, ~5 s of the suite's time): zerodp0/1/2 differ from
# zerodp3 by the stage only (the engine's own tests cover every stage; test_multi_rank_modes runs zerodp2),
# zerodp3 is the one whose parameters the worker gathers, zerodp2-offload the one with a host optimizer;
# fsdp2-noreshard differs from fsdp2 by one flag, deepspeed2-offload from deepspeed2 likewise.
SUITE_MODES = ["plain", "ddp", "fsdp2", "zerodp3", "zerodp2-offload", "deepspeed2"]


@pytest.fixture(scope="module")
def world1(tmp_path_factory) -> dict:
    """One invocation (a process per mode): a mode of each kind, and the fake world. --fork (a user's option
    on a CPU): each mode's process is forked from one that imported torch and the worker once (8 processes:
    ~45 s of CPU less); the default, a fresh interpreter per mode, runs in test_multi_rank_modes below."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    bench.main(TINY + ["--modes", *SUITE_MODES, "--checkpointing", "--fake-world", "8", "--fork", "--json", str(out)])
    return json.loads(out.read_text())


def test_every_mode_is_one_the_worker_builds():
    kinds = ("plain", "ddp", "fsdp2", "zerodp", "deepspeed")
    assert set(SUITE_MODES) <= set(bench.MODES)
    assert all(any(m == k or m.startswith(k) for k in kinds) for m in bench.MODES), list(bench.MODES)
    assert {next(k for k in kinds if m.startswith(k)) for m in SUITE_MODES} == set(kinds)


def test_every_requested_mode_is_measured_or_skipped_with_a_reason(world1):
    rows = {r["mode"]: r for r in world1["results"]}
    assert list(rows) == SUITE_MODES
    for mode, r in rows.items():
        assert r["status"] in ("ok", "skipped"), f"{mode}: {r['status']}: {r['reason']}"
        if r["status"] == "skipped":
            assert r["reason"], f"{mode} was skipped without a reason"
        else:
            assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["seconds"] > 0
            assert r["mfu"] is None, "a CPU has no tensor-core peak: MFU is n/a"
            assert len(r["losses"]) == 2
    for mode in ("plain", "ddp", "fsdp2", "zerodp3", "zerodp2-offload"):
        assert rows[mode]["status"] == "ok", f"{mode} must run on CPU: {rows[mode]['reason']}"


def test_ratios_are_to_plain_pytorch_of_the_same_run(world1):
    rows = {r["mode"]: r for r in world1["results"]}
    assert rows["plain"]["ratio_to_plain"] == 1.0
    for r in rows.values():
        if r["status"] == "ok":
            assert r["ratio_to_plain"] == pytest.approx(r["tflops"] / rows["plain"]["tflops"])
        else:
            assert r["ratio_to_plain"] is None


def test_every_mode_trains_the_same_model_on_the_same_batch(world1):
    """fp32, world 1, same seed: every mode computes the same losses (a wrong setup shows here)."""
    plain = world1["results"][0]["losses"]
    for r in world1["results"]:
        if r["status"] == "ok":
            assert r["losses"] == pytest.approx(plain, rel=1e-4), r["mode"]


def test_json_records_how_it_was_made(world1):
    assert world1["command"].startswith("zerodp bench --model tiny")
    assert world1["device"].startswith("CPU")
    assert world1["args"]["steps"] == 2 and world1["args"]["warmup"] == 1
    assert all("checkpoint" in r["note"] for r in world1["results"] if r["status"] == "ok")


def test_on_cpu_modes_run_on_the_train_jobs_2_ranks_and_the_table_says_cpu_ratios_are_not_gpu_ratios(world1):
    import torch

    from zerodp.bench import driver

    args = driver.parser().parse_args([])
    driver.fill_device_defaults(args)
    if torch.cuda.is_available():
        pytest.skip("the CPU defaults are checked on a machine without CUDA")
    assert args.world == 2
    assert "these ratios are not GPU ratios" in world1["device_note"]


def test_plain_is_always_run_first_as_the_baseline():
    assert bench.modes_to_run(["zerodp2", "ddp", "zerodp2"]) == ["plain", "zerodp2", "ddp"]
    assert bench.modes_to_run(["zerodp2", "plain"]) == ["plain", "zerodp2"]


def test_fake_world_reports_the_bytes_each_mode_owns_as_rank_0_of_8(world1):
    fake = {r["mode"]: r for r in world1["fake_world"]}
    assert set(fake) == set(bench.FAKE_MODES)
    for mode, r in fake.items():
        assert r["status"] == "ok", f"{mode}: {r['reason']}"
        assert r["world"] == 8 and bench.owned_total(r["owned_bytes"]) > 0


def test_add_ratios_leaves_modes_without_a_measurement_alone():
    rows = [bench.Result("plain", "ok", tflops=2.0), bench.Result("zerodp2", "ok", tflops=1.0),
            bench.Result("deepspeed2", "skipped", reason="not installed")]
    bench.add_ratios(rows)
    assert [r.ratio_to_plain for r in rows] == [1.0, 0.5, None]


def test_zerodp_step_time_is_given_over_its_deepspeed_counterparts_of_the_same_run():
    rows = [bench.Result("plain", "ok", tflops=2.0, tokens_per_s=10.0),
            bench.Result("zerodp2-offload", "ok", world=2, tflops=1.0, tokens_per_s=40.0),
            bench.Result("deepspeed2-offload", "ok", world=2, tflops=1.0, tokens_per_s=44.0),
            bench.Result("zerodp2", "ok", world=2, tflops=1.0, tokens_per_s=40.0),
            bench.Result("deepspeed2", "skipped", world=2, reason="not installed")]
    bench.add_ratios(rows)
    assert [r.step_vs_deepspeed for r in rows] == [None, pytest.approx(1.1), None, None, None]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_offload_row_runs_beside_deepspeed_zero_offload_in_the_same_run(tmp_path):
    """zerodp stage 2 offloaded, with torch.optim.AdamW as built by default, and DeepSpeed ZeRO-Offload
    (DeepSpeedCPUAdam, JIT-built on first use: minutes once) on the same model and batch."""
    out = tmp_path / "offload.json"
    bench.main(TINY + ["--modes", "zerodp2-offload", "deepspeed2-offload", "--json", str(out)])
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    ours, theirs = rows["zerodp2-offload"], rows["deepspeed2-offload"]
    assert ours["status"] == theirs["status"] == "ok", (ours["reason"], theirs["reason"])
    assert ours["step_vs_deepspeed"] == pytest.approx(theirs["tokens_per_s"] / ours["tokens_per_s"])
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-4)  # the same training


def test_repeats_report_the_median_and_keep_every_sample():
    runs = [bench.Result("zerodp2", "ok", tokens_per_s=t) for t in (30.0, 10.0, 20.0)]
    chosen = bench.median_result(runs)
    assert chosen.tokens_per_s == 20.0 and chosen.samples == [30.0, 10.0, 20.0]
    failed = bench.Result("zerodp2", "failed", reason="exit 1")
    assert bench.median_result([runs[0], failed]) is failed


def test_multi_rank_modes_run_under_torchrun_on_2_gloo_ranks(tmp_path):
    """The default: every mode in a fresh interpreter, zerodp2's two ranks under torchrun. Then the same with
    --fork (torch's elastic launcher forking the ranks): the same training, to the bit."""
    runs = {}
    for name, extra in (("fresh", []), ("fork", ["--fork"])):
        out = tmp_path / f"world2-{name}.json"
        bench.main(TINY + ["--world", "2", "--modes", "zerodp2", "--steps", "1", "--json", str(out), *extra])
        runs[name] = json.loads(out.read_text())["results"]
    for plain, zero2 in runs.values():
        assert (plain["world"], zero2["world"]) == (1, 2)
        assert plain["status"] == zero2["status"] == "ok", (plain["reason"], zero2["reason"])
        assert zero2["ratio_to_plain"] == pytest.approx(zero2["tflops"] / plain["tflops"])
        # tokens/s counts both ranks; TFLOP/s is per device
        assert zero2["tflops"] == pytest.approx(zero2["tokens_per_s"] / 2 * plain["tflops"] / plain["tokens_per_s"])
    assert [r["losses"] for r in runs["fork"]] == [r["losses"] for r in runs["fresh"]]


def test_fork_is_refused_on_an_accelerator(monkeypatch):
    """A forked process could inherit a device context it cannot use: with a GPU, --fork is refused by name."""
    from zerodp.distributed import device
    monkeypatch.setattr(device, "accelerator_type", lambda: "cuda")
    with pytest.raises(SystemExit, match="--fork is for CPU runs"):
        bench.main(TINY + ["--fork"])


def _marked(mark: str) -> list[int]:
    """The processes started with `mark` in their environment (a fork keeps its parent's at exec)."""
    pids = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and mark.encode() in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                pids.append(int(entry))
    return pids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_fork_run_leaves_no_mode_running(tmp_path, sig):
    """--fork's mode runs in a session of its own, which the signal a terminal (Ctrl-C: SIGINT) or `timeout`
    (SIGTERM) sends the driver's process group does not reach: the driver ends it as it stops."""
    mark = f"ZERODP_TEST_MARK={uuid.uuid4()}"
    env = {**os.environ, mark.split("=")[0]: mark.split("=")[1]}
    driver = subprocess.Popen([sys.executable, "-m", "zerodp.bench", *TINY, "--modes", "plain", "--steps", "100000",
                               "--fork"], env=env, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not [pid for pid in _marked(mark) if pid != driver.pid and os.getsid(pid) == pid]:  # the mode
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[1][-3000:]
            time.sleep(0.1)
        os.killpg(driver.pid, sig)
        _, stderr = driver.communicate(timeout=60)
        deadline = time.monotonic() + 10  # the fork server ends once the driver is gone
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert driver.returncode != 0 and not _marked(mark), (driver.returncode, _marked(mark), stderr[-3000:])
        if sig == signal.SIGINT:
            assert stderr.strip().splitlines()[-1] == "zerodp bench: stopped by Ctrl-C while mode plain ran", stderr
    finally:
        for pid in _marked(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_overhead_benchmark_runs_every_mode_and_profiles_zerodp():
    """The many-small-parameters benchmark (zerodp.bench.overhead), at toy size: the harness only, never speed."""
    from zerodp.bench import overhead
    out = overhead.main(["--layers", "2", "3", "--worlds", "1", "--steps", "1", "--warmup", "0",
                         "--profile-stage", "3", "--profile-steps", "1", "--top", "3", "--quiet"])
    runs = [m for m in overhead.MODES if overhead.skip_reason(m) is None]  # deepspeed3 where it imports
    assert [(r["layers"], r["mode"]) for r in out["rows"]] == [(n, m) for n in (2, 3) for m in runs]
    assert all(r["cpu_ms"] > 0 for r in out["rows"])
    assert "| 1 | 3 (12) | zerodp3 |" in out["table"] and "x for 1.5x params" in out["table"]
    assert "zerodp stage 3, world 1, 3 layers" in out["profile"] and "zerodp/engine/stepping/reducer.py" in out["profile"]
