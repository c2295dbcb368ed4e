"""`zerodp bench` runs end to end at tiny size on CPU: every mode measured or skipped with a reason.

Speed itself is never asserted here (DESIGN.md: speed is measured by benchmarks, not timed tests);
what is asserted is the harness: one row per requested mode, plain PyTorch as the baseline of the
same run, the same model and batch everywhere (identical fp32 losses), the modes run in rounds (A B C,
A B C), each mode's spread and its round-by-round ratios recomputable from the JSON's runs, the verdict
rule on planted numbers, and JSON that says how it was made.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
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
from zerodp.bench import driver, spread

TINY = ["--model", "tiny", "--micro-batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1",
        "--dtype", "fp32", "--threads", "1", "--world", "1", "--repeats", "1"]
ROUNDS = 2  # the fixture's: A B C A B C, the least that shows the order


# One mode of each kind the worker builds (a process each, ~5 s of the suite's time): zerodp0/1/2 differ from
# zerodp3 by the stage only (the engine's own tests cover every stage; test_multi_rank_modes runs zerodp2),
# zerodp3 is the one whose parameters the worker gathers, zerodp2-offload the one with a host optimizer;
# fsdp2-noreshard differs from fsdp2 by one flag, deepspeed2-offload from deepspeed2 likewise.
SUITE_MODES = ["plain", "ddp", "fsdp2", "zerodp3", "zerodp2-offload", "deepspeed2"]


@pytest.fixture(scope="module")
def world1(tmp_path_factory) -> dict:
    """One invocation (a process per mode and round): a mode of each kind in ROUNDS rounds, and the fake world,
    with what it printed under "printed". --fork (a user's option on a CPU): each mode's process is forked from
    one that imported torch and the worker once (~5 CPU s less per process); the default, a fresh interpreter
    per mode, runs in test_multi_rank_modes below."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    printed, progress = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(progress):
        bench.main(TINY + ["--modes", *SUITE_MODES, "--checkpointing", "--fake-world", "8", "--fork",
                           "--repeats", str(ROUNDS), "--json", str(out)])
    return {**json.loads(out.read_text()), "printed": printed.getvalue(), "progress": progress.getvalue()}


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


def test_modes_run_in_rounds_a_b_c_a_b_c(world1):
    """The order the runs really had: sequence numbers, rounds and start times, one mode after another."""
    runs = world1["runs"]
    assert [r["mode"] for r in runs] == SUITE_MODES * ROUNDS
    # and said so as each ended (stderr): a long run shows its progress, one stopped keeps its numbers
    lines = [line for line in world1["progress"].splitlines() if line.startswith("round ")]
    assert len(lines) == len(runs)
    assert all(line.startswith(f"round {r['round'] + 1}/{ROUNDS}: {r['mode']} ") for line, r in zip(lines, runs))
    assert lines[-1] == f"round {ROUNDS}/{ROUNDS}: deepspeed2 skipped: {runs[-1]['reason']}" or \
        lines[-1] == f"round {ROUNDS}/{ROUNDS}: deepspeed2 {runs[-1]['tokens_per_s']:,.0f} tokens/s"
    assert [r["sequence"] for r in runs] == list(range(len(runs)))
    assert [r["round"] for r in runs] == [i for i in range(ROUNDS) for _ in SUITE_MODES]
    assert all(a["ended"] <= b["started"] for a, b in itertools.pairwise(runs)), "a run began before the last ended"


def test_every_spread_and_ratio_can_be_recomputed_from_the_runs(world1):
    """A reader with the JSON's raw runs gets the table's spreads: each mode's tokens/s, lowest, median (the
    lower middle) and highest over the rounds, and its ratio to DDP and to FSDP2 round by round."""
    by_mode = {m: [r["tokens_per_s"] for r in world1["runs"] if r["mode"] == m and r["status"] == "ok"]
               for m in SUITE_MODES}
    measured = [m for m, v in by_mode.items() if len(v) == ROUNDS]
    assert set(measured) >= {"plain", "ddp", "fsdp2", "zerodp3"} and set(world1["spread"]) == set(measured)
    for mode in measured:
        own = world1["spread"][mode]
        low, *_, high = sorted(by_mode[mode])
        assert own["tokens_per_s"] == {"n": ROUNDS, "low": low, "median": low, "high": high}  # 2: the lower one
        for base in ("ddp", "fsdp2"):
            ratios = sorted(a / b for a, b in zip(by_mode[mode], by_mode[base]))
            assert own[base] == {"n": ROUNDS, "low": ratios[0], "median": ratios[0], "high": ratios[-1]}
    row = next(r for r in world1["results"] if r["mode"] == "zerodp3")
    assert row["samples"] == by_mode["zerodp3"] and row["tokens_per_s"] == min(by_mode["zerodp3"])


def test_printed_table_carries_the_spreads_and_says_what_cannot_be_told_apart(world1):
    printed, own = world1["printed"], world1["spread"]["zerodp3"]
    for column in ("tokens/s min-max", "vs ddp (rounds)", "vs fsdp2 (rounds)"):
        assert column in printed
    zerodp3_row = next(line for line in printed.splitlines() if line.startswith("│ zerodp3 "))
    tokens, ddp = own["tokens_per_s"], own["ddp"]
    assert f"{tokens['low']:,.0f}-{tokens['high']:,.0f}" in zerodp3_row
    assert f"{ddp['median']:.2f} ({ddp['low']:.2f}-{ddp['high']:.2f})" in zerodp3_row
    for other in ("ddp", "fsdp2"):  # 2 rounds: too few to tell, whatever the numbers
        assert f"zerodp3 vs {other}: " in printed and "cannot be told apart with 2 repeats (3 needed)" in printed
    assert [(v["mode"], v["other"], v["told_apart"]) for v in world1["verdicts"]] == \
        [(m, other, False) for m in ("zerodp3", "zerodp2-offload") for other in ("ddp", "fsdp2")]


def test_spread_is_lowest_lower_middle_and_highest():
    assert spread.spread([30.0, 10.0, 40.0, 20.0]) == spread.Spread(4, 10.0, 20.0, 40.0)
    assert spread.spread([5.0]) == spread.Spread(1, 5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="at least one measured repeat"):
        spread.spread([])


def test_modes_whose_ranges_do_not_overlap_are_told_apart():
    """Planted: zerodp2 is faster than DDP in every repeat, by more than either's spread."""
    fast, slow = [100.0, 104.0, 98.0, 101.0, 99.0], [90.0, 91.0, 89.0, 95.0, 88.0]
    v = spread.tell_apart("zerodp2", fast, "ddp", slow)
    assert v.told_apart and v.chance_if_equal == pytest.approx(2 / 252)
    assert v.ratio == spread.spread([a / b for a, b in zip(fast, slow)])
    assert "told apart: zerodp2 is faster" in v.sentence() and "98-104 against 88-95 tokens/s" in v.sentence()
    assert spread.tell_apart("ddp", slow, "zerodp2", fast).sentence().count("zerodp2 is faster") == 1


def test_modes_whose_ranges_overlap_cannot_be_told_apart():
    """Planted: a 5% gain in the medians inside a spread of 25%: not a difference this bench can see."""
    mine, theirs = [105.0, 84.0, 110.0, 100.0, 95.0], [100.0, 82.0, 95.0, 108.0, 88.0]
    v = spread.tell_apart("zerodp2", mine, "ddp", theirs)
    assert not v.told_apart
    assert v.sentence().endswith("cannot be told apart (ranges 84-110 against 82-108 tokens/s overlap)")
    # apart, but only 2 repeats: 1 chance in 3 were they equal, so not called
    v = spread.tell_apart("zerodp2", [200.0, 210.0], "ddp", [100.0, 110.0])
    assert not v.told_apart and "cannot be told apart with 2 repeats (3 needed)" in v.sentence()


@pytest.mark.parametrize("m,n", [(3, 3), (3, 4), (4, 4)])
def test_chance_of_ranges_apart_is_counted_over_every_split(m, n):
    """2 / C(m + n, m): of all the ways m + n interchangeable values split into m and n, those with one side
    wholly above the other, counted."""
    splits = list(itertools.combinations(range(m + n), m))
    apart = sum(max(s) < min(set(range(m + n)) - set(s)) or min(s) > max(set(range(m + n)) - set(s)) for s in splits)
    assert spread.chance_if_equal(m, n) == pytest.approx(apart / len(splits))


def test_round_ratios_need_one_value_per_round_from_each():
    assert spread.round_ratios([2.0, 3.0], [1.0, 6.0]) == [2.0, 0.5]
    with pytest.raises(ValueError, match="one value per round"):
        spread.round_ratios([1.0, 2.0], [1.0])


def test_each_zerodp_mode_is_weighed_against_ddp_and_fsdp2():
    assert spread.pairs_that_matter(["plain", "ddp", "fsdp2", "zerodp1", "zerodp3", "deepspeed2"]) == \
        [("zerodp1", "ddp"), ("zerodp1", "fsdp2"), ("zerodp3", "ddp"), ("zerodp3", "fsdp2")]
    assert spread.pairs_that_matter(["plain", "ddp", "zerodp2"]) == [("zerodp2", "ddp")]
    rows = [bench.Result("ddp", "ok", samples=[10.0, 20.0, 30.0]), bench.Result("fsdp2", "failed", reason="exit 1"),
            bench.Result("zerodp2", "ok", samples=[5.0, 30.0, 15.0])]
    assert driver.mode_spreads(rows)["zerodp2"] == {"tokens_per_s": spread.Spread(3, 5.0, 15.0, 30.0),
                                                     "ddp": spread.Spread(3, 0.5, 0.5, 1.5)}
    assert [(v.mode, v.other) for v in driver.verdicts(rows)] == [("zerodp2", "ddp")]


def _shape(argv: list[str]):
    args = driver.parser().parse_args(argv)
    driver.apply_shape(args)
    return args.model, args.micro_batch, args.seq


def test_shape_sets_issue_44s_shapes_and_the_train_jobs(monkeypatch):
    assert _shape(["--shape", "2x64"]) == ("small", 2, 64)
    assert _shape(["--shape", "4x256", "--seq", "256"]) == ("small", 4, 256)  # the same value given: no conflict
    assert _shape(["--shape", "train"]) == ("small", 8, 256)  # zerodp train's default: small's 256-token context
    from zerodp.train import options
    monkeypatch.setitem(options.DEFAULTS, "micro_batch", 16)  # read from the job's defaults, not copied
    assert _shape(["--shape", "train"]) == ("small", 16, 256)


def test_shape_refuses_a_flag_that_contradicts_it():
    with pytest.raises(SystemExit, match="--shape 2x64 sets --seq 64, and --seq 128 was given: drop --seq or --shape"):
        _shape(["--shape", "2x64", "--seq", "128"])


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
        # rank 0's time blocked in zerodp's collectives, per step: measured for zerodp's modes only
        assert plain["exposed_comm_ms"] is None and zero2["exposed_comm_ms"] > 0
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
