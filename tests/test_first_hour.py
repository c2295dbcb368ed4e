"""A newcomer's first hour: every command's --help at once, stage 3 and offload from the command
line, a warning for slow bf16 on the CPU, and a library that needs none of the job's extras."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import zerodp
from zerodp.engine import cpu_bf16

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
    assert config["zero_optimization"]["offload_optimizer"]["device"] == offload
    model, _ = build_model("tiny", 256, None)
    engine = zerodp.initialize(model, build_optimizer(model, opts), config)
    assert (engine.stage, engine.partitioned_optimizer.offload) == (stage, offload == "cpu")
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
    assert ds_config(opts)["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}


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
