"""benchmarks/gpu/check.sh, the one prepared GPU check (issue 27): on a CPU machine it runs what a CPU
can (environment, correctness at tiny size), marks the GPU pieces "no CUDA device" and exits 0; its
pieces write their summary lines as they end; its list of GPU-only tests is every test that needs a
GPU; and benchmarks/step_phases.py frees each engine before building the next."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "gpu" / "check.sh"
GPU_PIECES = ["GPU-only tests", "throughput 350M", "throughput 1.3B", "peak 2.7B checkpointed", "6.7B fake 64",
              "deepspeed 350M"]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _start(tmp_path: Path, **env) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out"
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(["bash", str(CHECK)], stdout=stdout, stderr=stderr, start_new_session=True,
                                env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env})
    return proc, tmp_path


def _finish(started: tuple[subprocess.Popen, Path]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc, tmp_path = started
    proc.wait(timeout=700)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, (tmp_path / "stdout").read_text(),
                                       (tmp_path / "stderr").read_text())
    lines = [json.loads(line) for line in (tmp_path / "out" / "summary.jsonl").read_text().splitlines()]
    return done, lines


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """The three runs of check.sh below, started at once: each is a chain of one-threaded Python processes
    (one core), so on 2 cores they overlap instead of taking their sum; each keeps its own OUT, and its
    limits (per-piece caps of 120-150 s, a 420 s deadline; more for the cpu run) stay far from what a tiny CPU run takes."""
    started = {"deadline": _start(tmp_path_factory.mktemp("deadline"), DEADLINE_S="0")}
    shim = tmp_path_factory.mktemp("no-pydantic")
    (shim / "shim" / "pydantic").mkdir(parents=True)
    (shim / "shim" / "pydantic" / "__init__.py").write_text("raise ImportError('No module named pydantic (shim)')\n")
    started["no pydantic"] = _start(shim, PYTHONPATH=str(shim / "shim"), SITE=str(shim / "site"))
    if not torch.cuda.is_available():  # on a CUDA machine the check runs the GPU pieces (minutes): not started
        # The GPU machine's caps fit its 15 minutes; beside two busy loops the CPU correctness piece took
        # 154 s of its 150 once (20 of 20 comparisons ok), so here it gets room, the deadline with it.
        started["cpu"] = _start(tmp_path_factory.mktemp("cpu"), CORRECTNESS_CAP_S="500", DEADLINE_S="600")
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:  # a test that failed (or was deselected) before waiting for it
            os.killpg(proc.pid, signal.SIGKILL)  # the check and its pieces (a session of their own)
            proc.wait()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the check runs the GPU pieces (minutes)")
def test_check_on_a_cpu_runs_the_cpu_pieces_and_marks_the_gpu_ones(checks):
    proc, lines = _finish(checks["cpu"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_piece = {r["piece"]: r for r in lines}
    assert by_piece["environment"]["status"] == "ok" and by_piece["environment"]["zerodp"] == "imports"
    assert by_piece["environment"]["torch"] == torch.__version__
    compared = [r for r in lines if r["piece"].startswith("correctness: ")]
    assert len(compared) == 20 and all(r["status"] == "ok" for r in compared), compared
    assert by_piece["correctness"]["status"] == "ok" and by_piece["correctness"]["result"] == "20 of 20 comparisons ok"
    for name in GPU_PIECES:
        assert (by_piece[name]["status"], by_piece[name]["result"]) == ("skipped", "no CUDA device")
    table = proc.stdout[proc.stdout.index("piece "):]  # printed last
    assert all(re.search(rf"{re.escape(name)}\s+skipped\s+no CUDA device", table) for name in GPU_PIECES)
    assert f"{len(lines)} lines: {len(lines) - len(GPU_PIECES)} ok, 0 failed, {len(GPU_PIECES)} skipped" in table


def test_check_past_its_deadline_says_why_each_piece_did_not_run(checks):
    proc, lines = _finish(checks["deadline"])
    assert proc.returncode == 1 and "nothing was checked: zerodp did not import here" in proc.stdout
    assert [r["piece"] for r in lines] == ["environment", "GPU-only tests", "correctness", *GPU_PIECES[1:]]
    assert re.fullmatch(r"not run: -?\d+ s left of the 0 s deadline", lines[0]["result"]), lines[0]
    assert all(r["status"] == "skipped" and r["result"].startswith("not run: import zerodp fails") for r in lines[1:])
    assert "8 lines: 0 ok, 0 failed, 8 skipped" in proc.stdout


def test_check_without_pydantic_says_so_and_checks_nothing(checks):
    proc, lines = _finish(checks["no pydantic"])
    assert proc.returncode == 1
    assert "pydantic is missing: zerodp cannot import. Make the wheels where pip works " \
           "(bash benchmarks/gpu/wheels.sh) and carry .whl to this machine." in proc.stdout
    env = lines[0]
    assert (env["piece"], env["status"], env["pydantic"]) == ("environment", "failed", "missing")
    assert env["zerodp"].startswith("import fails: ImportError: No module named pydantic (shim)")
    assert all(r["status"] == "skipped" and r["result"].startswith("not run: import zerodp fails") for r in lines[1:])


def _gpu_only_tests() -> set[str]:
    """Every test that a CPU host skips for want of a GPU (a skipif on ON_CPU or on CUDA's absence)."""
    needs_gpu = re.compile(r"@pytest\.mark\.skipif\(\s*(ON_CPU\b|not torch\.(cuda|accelerator)\.is_available\(\)"
                           r"|accelerator_type\(\) != \"cuda\")")
    found = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        for m in needs_gpu.finditer(text):
            name = re.search(r"def (test_\w+)", text[m.end():]).group(1)
            found.add(f"tests/{path.name}::{name}")
    return found


def test_check_runs_every_gpu_only_test_by_id():
    listed = set(re.search(r"GPU_TESTS=\(\n(.*?)\n\)", CHECK.read_text(), re.S).group(1).split())
    assert _gpu_only_tests() == listed
    assert "tests/test_device.py::test_accelerator_side_stream_copy_and_timing_events" in listed


# ---- the bench pieces, with zerodp bench's launch stood in for (the worker itself: test_bench.py) ----
@pytest.fixture
def pieces():
    return _load("gpu_check_pieces", ROOT / "benchmarks" / "gpu" / "pieces.py")


def _piece_args(tmp_path: Path, command: str, **kw) -> argparse.Namespace:
    return argparse.Namespace(summary=str(tmp_path / "s.jsonl"), json=str(tmp_path / "rows.json"), budget=600,
                              bench_argv=["--model", "tiny"], kind=command if command in ("peak", "fake") else None,
                              **kw)


def test_throughput_rows_are_ratios_to_plain_and_each_a_line_as_it_ends(tmp_path, pieces, monkeypatch):
    from zerodp.bench.driver import launch  # noqa: F401 - what the piece calls, replaced below
    from zerodp.bench.rows import Result
    measured = {"plain": Result("plain", "ok", tflops=400.0, tokens_per_s=1.0, mfu=0.4, peak_allocated_gib=20.0),
                "zerodp2": Result("zerodp2", "ok", tflops=380.0, tokens_per_s=1.0, mfu=0.38),
                "zerodp3": Result("zerodp3", "failed", reason="exit 1: CUDA out of memory")}
    seen = []

    def fake_launch(mode, world, args, fake_world=0):
        seen.append((mode, world, fake_world, args.timeout > 500))
        lines = (tmp_path / "s.jsonl").read_text().splitlines() if seen[1:] else []
        assert len(lines) == len(seen) - 1  # the earlier rows are in the summary already
        return measured[mode]

    monkeypatch.setattr("zerodp.bench.driver.launch", fake_launch)
    args = _piece_args(tmp_path, "throughput")
    bench = pieces.bench_args(args.bench_argv)
    assert pieces.run_rows(args, "throughput tiny", bench, ["plain", "zerodp2", "zerodp3"]) == 1
    assert seen == [("plain", 1, 0, True), ("zerodp2", 1, 0, True), ("zerodp3", 1, 0, True)]
    lines = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(r["piece"], r["status"]) for r in lines] == [
        ("throughput tiny: plain", "ok"), ("throughput tiny: zerodp2", "ok"), ("throughput tiny: zerodp3", "FAIL")]
    assert lines[1]["result"] == "380.0 TFLOP/s, 0.95x plain, MFU 38.0%" and lines[1]["row"]["ratio_to_plain"] == 0.95
    assert lines[2]["result"] == "failed: exit 1: CUDA out of memory"
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["plain", "zerodp2", "zerodp3"]
    # DeepSpeed's piece takes plain's TFLOP/s from this one's rows instead of running plain again
    assert pieces.plain_from(str(tmp_path / "rows.json")) == 400.0


@pytest.mark.parametrize("command, options, launched", [
    ("fake", ["--modes", "zerodp2", "--fake-world", "64"], [("zerodp2", 64, 64)]),  # no whole-model mode
    ("peak", ["--modes", "zerodp2"], [("plain", 1, 0), ("zerodp2", 1, 0)]),
    ("throughput", [], [("plain", 1, 0), ("zerodp2", 1, 0), ("zerodp3", 1, 0), ("fsdp2", 1, 0)]),
])
def test_each_bench_piece_launches_its_modes(tmp_path, pieces, monkeypatch, command, options, launched):
    from zerodp.bench.rows import Result
    seen = []

    def fake_launch(mode, world, args, fake_world=0):
        seen.append((mode, world, fake_world))
        return Result(mode, "ok", world, tflops=1.0, tokens_per_s=1.0)

    monkeypatch.setattr("zerodp.bench.driver.launch", fake_launch)
    argv = [command, "--summary", str(tmp_path / "s.jsonl"), *options, "--", "--model", "tiny", "--checkpointing"]
    assert pieces.main(argv) == 0 and seen == launched


def test_a_piece_out_of_time_launches_nothing_more(tmp_path, pieces, monkeypatch):
    monkeypatch.setattr("zerodp.bench.driver.launch", lambda *a, **k: pytest.fail("launched past the deadline"))
    args = _piece_args(tmp_path, "throughput")
    args.budget = 10
    assert pieces.run_rows(args, "throughput tiny", pieces.bench_args(args.bench_argv), ["plain", "zerodp2"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["status"] for r in lines] == ["skipped", "skipped"]
    assert lines[0]["result"].startswith("deadline: ")


def test_peak_rows_are_held_against_zerodp_estimates_shipped_prediction(pieces):
    """check.sh's peak and fake pieces run the bench with exactly the settings the predictions were made
    with (benchmarks/results/gpu-check-*.json, commands in benchmarks/README.md)."""
    from zerodp.bench.rows import Result
    peak = pieces.bench_args(["--model", "2.7B", "--micro-batch", "8", "--seq", "1024", "--checkpointing"])
    fake = pieces.bench_args(["--model", "6.7B", "--micro-batch", "4", "--seq", "1024", "--checkpointing"])
    text = CHECK.read_text()
    assert "--model 2.7B --micro-batch 8 --seq 1024 --checkpointing" in text
    assert "--model 6.7B --micro-batch 4 --seq 1024 --checkpointing" in text
    for kind, mode, bench, world in (("peak", "plain", peak, 1), ("peak", "zerodp2", peak, 1),
                                     ("fake", "zerodp2", fake, 64)):
        predicted = pieces.predicted_peak(kind, mode, bench, world)
        assert predicted is not None and predicted > 10 * 2**30, (kind, mode)
    assert pieces.predicted_peak("peak", "zerodp3", peak) is None
    assert pieces.predicted_peak("fake", "zerodp2", fake, world=8) is None
    assert pieces.predicted_peak("peak", "zerodp2", pieces.bench_args(["--model", "2.7B", "--seq", "512"])) is None
    predicted = pieces.predicted_peak("peak", "zerodp2", peak)
    close = Result("zerodp2", "ok", tflops=300.0, peak_allocated_gib=1.05 * predicted / 2**30)
    far = Result("zerodp2", "ok", tflops=300.0, peak_allocated_gib=1.2 * predicted / 2**30)
    assert pieces.describe(close, predicted)[0] == "ok" and "(+5.0%, tol 10%)" in pieces.describe(close, predicted)[1]
    assert pieces.describe(far, predicted)[0] == "FAIL"


# ---- benchmarks/step_phases.py -----------------------------------------------------------------
def test_step_phases_frees_each_engine_before_building_the_next(monkeypatch):
    phases = _load("step_phases", ROOT / "benchmarks" / "step_phases.py")
    built = []

    def gpt(config):
        model = phases_gpt(config)
        built.append(weakref.ref(model))
        return model

    phases_gpt = phases.GPT
    monkeypatch.setattr(phases, "GPT", gpt)
    args = argparse.Namespace(model="tiny", seq=16, micro_batch=2, dtype="fp32", warmup=0, steps=1)
    gc.disable()  # only the collection step_phases does itself may free the engines' cycles
    try:
        phases.rounds(["plain", "zerodp2", "zerodp3"], args, torch.device("cpu"), n=1)
        alive = [ref() is not None for ref in built]
    finally:
        gc.enable()
    assert len(built) == 3 and not any(alive)


def test_a_correctness_comparison_fails_on_a_difference_past_its_tolerance(tmp_path):
    correctness = _load("gpu_correctness", ROOT / "benchmarks" / "gpu" / "correctness.py")
    report = correctness.Report(str(tmp_path / "s.jsonl"), correctness.setup_for(torch.device("cpu"), 3))
    want = ([5.0, 4.9], {"w": torch.zeros(3)})
    report.compare("same", ([5.0, 4.9], {"w": torch.full((3,), 5e-6)}), want, 1e-5)
    report.compare("weights off", ([5.0, 4.9], {"w": torch.tensor([0.0, 2e-5, 0.0])}), want, 1e-5)
    report.compare("loss off", ([5.0, 4.8], {"w": torch.zeros(3)}), want, 1e-5)
    report.compare("not finite", ([5.0, float("nan")], {"w": torch.zeros(3)}), want, 1e-5, loss_tol=1.0)
    lines = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["status"] for r in lines] == ["ok", "FAIL", "FAIL", "FAIL"] and report.failed == 3
    assert lines[1]["weight_diff"] == pytest.approx(2e-5)
