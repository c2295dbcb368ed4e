"""A newcomer's first hour: every command's --help at once, stage 3 and offload from the command
line, a warning for slow bf16 on the CPU, and a library that needs none of the job's extras."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import zerodp
from zerodp.engine.engine import inside
from zerodp.engine.stepping import cpu_bf16

COMMANDS = (["train"], ["estimate"], ["consolidate"], ["bench"])


def test_help_answers_without_torch_and_the_library_needs_none_of_the_extras():
    # One fresh interpreter (one torch import for both checks). First every command's --help, after
    # which torch must not be imported (it costs 10-30 s on a cold disk); then `import zerodp` and a
    # step, which must not import the extras ([train], [hf]: matplotlib, rich, tqdm, transformers).
    code = f"""
import sys, time, runpy
t0 = time.perf_counter()
import zerodp.cli
for argv in {[[]] + [c for c in COMMANDS]}:
    try:
        zerodp.cli.main(argv + ["--help"])
    except SystemExit:
        pass
for module in ("zerodp.train", "zerodp.bench", "zerodp.checkpoint", "zerodp.plan.estimate"):
    sys.argv = ["x", "--help"]
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit:
        pass
print("HEAVY", sorted(m for m in ("torch", "numpy", "rich", "transformers") if m in sys.modules))
print(f"HELP SECONDS {{time.perf_counter() - t0:.2f}}")
import torch
extras = ("matplotlib", "rich", "tqdm", "transformers")
by_torch = {{m for m in extras if m in sys.modules}}  # torch itself imports tqdm when it is installed
import zerodp
model = torch.nn.Linear(4, 2)
engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()),
                           {{"train_micro_batch_size_per_gpu": 3, "zero_optimization": {{"stage": 2}}}})
engine.backward(engine(torch.randn(3, 4)).sum()); engine.step()
print("EXTRAS", sorted(m for m in extras if m in sys.modules and m not in by_torch))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
    for name in ("zerodp train", "zerodp estimate", "zerodp consolidate", "zerodp bench"):
        assert f"usage: {name}" in out.stdout
    assert "EXTRAS []" in out.stdout, out.stdout[-500:]
    print(out.stdout.splitlines()[[l.startswith("HELP SECONDS") for l in out.stdout.splitlines()].index(True)])


@pytest.mark.parametrize("flags, stage, offload", [(["--stage", "3"], 3, "none"),
                                                   (["--stage", "3", "--offload"], 3, "cpu"),
                                                   (["--stage", "1", "--offload"], 1, "cpu")])
def test_train_options_stage_3_and_offload_reach_the_engine(flags, stage, offload):
    from zerodp.models.build import build_model
    from zerodp.train.build import build_optimizer
    from zerodp.train.options import ds_config, parse_options

    opts = parse_options(["--model", "tiny", "--nproc", "1", "--steps", "2", *flags])
    config = ds_config(opts)
    assert config.zero_optimization.offload_optimizer.device == offload
    model, _ = build_model("tiny", 256, None)
    engine = zerodp.initialize(model, build_optimizer(model, opts), config)
    assert (inside(engine).spec.stage, inside(engine).training.partitioned_optimizer.offload) == (stage, offload == "cpu")
    x = torch.randint(0, 256, (2, 16))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1 and torch.isfinite(loss)


def test_offload_in_a_ds_config_is_kept_by_the_job(tmp_path):
    from zerodp.train.options import ds_config, parse_options

    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": false}}}')
    opts = parse_options(["--ds-config", str(ds), "--nproc", "1"])
    assert (opts.stage, opts.offload) == (3, True)
    offload = ds_config(opts).zero_optimization.offload_optimizer
    assert offload.model_dump(exclude_unset=True) == {"device": "cpu", "pin_memory": False}


@pytest.fixture
def fresh_bf16_check(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "_checked", False)
    return lambda ratio: monkeypatch.setattr(cpu_bf16, "bf16_slowdown", lambda: ratio)


def test_bf16_on_a_cpu_without_fast_bf16_warns_once_on_rank_0(fresh_bf16_check):
    fresh_bf16_check(18.0)
    cpu = torch.device("cpu")
    with pytest.warns(cpu_bf16.SlowBF16Warning, match="18x slower than fp32.*--dtype fp32"):
        cpu_bf16.warn_if_slow_bf16(cpu, torch.bfloat16, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu_bf16.warn_if_slow_bf16(cpu, torch.bfloat16, rank=0)  # once per process


@pytest.mark.parametrize("ratio, device, dtype, rank", [(1.2, "cpu", torch.bfloat16, 0),  # fast bf16 (AMX)
                                                        (18.0, "cpu", torch.bfloat16, 1),  # not rank 0
                                                        (18.0, "cpu", torch.float32, 0),
                                                        (18.0, "meta", torch.bfloat16, 0)])
def test_no_bf16_warning_where_it_would_not_help(fresh_bf16_check, ratio, device, dtype, rank):
    fresh_bf16_check(ratio)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu_bf16.warn_if_slow_bf16(torch.device(device), dtype, rank)


def test_bf16_slowdown_is_measured_on_this_cpu():
    ratio = cpu_bf16.bf16_slowdown()
    print(f"bf16 / fp32 matmul time on this CPU: {ratio:.1f}x")
    assert ratio > 0


# ---- the commands' edges a newcomer meets ---------------------------------------------------------
def test_a_mistyped_command_is_an_unknown_command_with_exit_code_2(capsys):
    from zerodp import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["trian"])
    assert e.value.code == 2
    assert "zerodp: unknown command 'trian'; did you mean 'train'?" in capsys.readouterr().err


def test_fit_budget_without_a_unit_is_an_error_naming_the_units():
    import argparse

    from zerodp.plan import estimate

    with pytest.raises(argparse.ArgumentTypeError, match="'80' has no unit; write e.g. 80GiB or 80GB"):
        estimate.parse_bytes("80")
    assert estimate.parse_bytes("80GiB") == 80 * 2**30 and estimate.parse_bytes("8e10") == 8 * 10**10


@pytest.mark.parametrize("where", ["missing", "not_a_checkpoint"])
def test_resume_from_a_wrong_path_is_one_line_before_any_rank_starts(tmp_path, where):
    from zerodp.train.options import parse_options
    from zerodp.train.resume import choose_resume

    path = tmp_path / "nothing-here"
    if where == "not_a_checkpoint":
        path.mkdir()
        (path / "notes.txt").write_text("hi")
    opts = parse_options(["--model", "tiny", "--nproc", "1", "--out", str(tmp_path / "run"), "--resume-from", str(path)])
    with pytest.raises(SystemExit) as e:
        choose_resume(opts, 1)
    message = str(e.value.code)
    assert message.startswith(f"zerodp train: --resume-from: no checkpoint {'at' if where == 'missing' else 'in'} "
                              f"'{path}'") and "\n" not in message


def test_exported_folders_and_files_get_the_usual_modes_not_0700_0600(hf_folders, tmp_path):
    from zerodp.checkpoint import write_consolidated
    from zerodp.models import hf_folder
    from transformers import AutoModelForCausalLM

    from zerodp.models.build import HFCausalLM, hf_description

    folder = str(hf_folders["gpt2"])
    model = HFCausalLM(AutoModelForCausalLM.from_pretrained(folder))
    hf_folder.write_folder(tmp_path / "hf", model.state_dict(), hf_description(model, folder))
    small = torch.nn.Linear(3, 2)
    engine = zerodp.initialize(small, torch.optim.SGD(small.parameters(), lr=0.1), {"train_micro_batch_size_per_gpu": 1})
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    write_consolidated(str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors"))
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "hf", *(tmp_path / "hf").iterdir(),
                                                               tmp_path / "w.safetensors"]}
    assert modes == {name: (0o777 if name == "hf" else 0o666) & ~mask for name in modes}


@pytest.mark.parametrize("nproc, after_s", [(1, 1.5), (2, 4.0)])
def test_sigterm_during_set_up_ends_the_job_with_its_one_line(tmp_path, nproc, after_s):
    """Whether the launcher, a starting rank or a rank building its engine gets it: one line, exit 143."""
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "zerodp.train", "--model", "tiny", "--steps", "100000",
                             "--nproc", str(nproc), "--out", str(tmp_path / "run")],
                            env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    stdout, stderr = proc.communicate(timeout=90)
    print(f"SIGTERM {after_s} s into a {nproc}-rank job's set-up: it exited {time.monotonic() - t0:.1f} s later")
    lines = [line for line in (stdout + stderr).splitlines() if "stopped by SIGTERM" in line]
    assert proc.returncode == 143, stderr[-3000:]
    assert len(lines) == 1, stdout + stderr[-3000:]
    assert "Traceback" not in stderr and "leaked semaphore" not in stderr, stderr[-3000:]


def test_hf_folder_of_a_byte_level_family_says_it_has_no_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from zerodp.models import hf_folder
    from zerodp.models.build import build_model, hf_description

    model, _ = build_model("hf-gpt2:tiny", 256, None)
    notes = hf_folder.write_folder(tmp_path / "hf", model.state_dict(), hf_description(model, "hf-gpt2:tiny"))
    assert not hf_folder.has_tokenizer(str(tmp_path / "hf"))
    assert len(notes) == 1 and "has no tokenizer: none is known for this model (the hf-gpt2" in notes[0]


def _ranks_of(launcher: int) -> list[int]:
    """The pids of the ranks a `zerodp train` launcher has spawned so far (multiprocessing's spawn_main)."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(launcher)], capture_output=True, text=True)
    ranks = []
    for child in children.stdout.split():
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                ranks.append(int(child))
        except OSError:
            continue
    return sorted(ranks)


def test_sigterm_while_a_rank_waits_for_a_stalled_peer_in_set_up_ends_the_job_at_once(tmp_path):
    """One rank held (SIGSTOP) as it starts: the other then waits for it inside one C++ call (the store, the
    group's connection), where a Python signal handler cannot run until comm_timeout_s. A SIGTERM to the
    launcher, the held rank let go with it, must end the job in seconds, with its one line (it hung before:
    the waiting rank outlived its peer by comm_timeout_s, and the launcher waited for it)."""
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "zerodp.train", "--model", "tiny", "--steps", "100000",
                             "--nproc", "2", "--out", str(tmp_path / "run")],
                            env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while len(ranks := _ranks_of(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGSTOP)  # either rank: the other one waits for it
    time.sleep(8)  # the other imports torch and reaches the rendezvous, where it waits for this one
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    os.kill(ranks[1], signal.SIGCONT)  # a slow peer, not a frozen one: it gets the SIGTERM too and ends
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for pid in _ranks_of(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the job did not end within 60 s of its SIGTERM:\n{stdout}\n{stderr[-3000:]}")
    print(f"SIGTERM with rank 1 stalled in set-up: the job exited {time.monotonic() - t0:.1f} s later")
    assert proc.returncode == 143, stderr[-3000:]
    lines = [line for line in (stdout + stderr).splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 1 and "during set-up" in lines[0], stdout + stderr[-3000:]
