"""The documentation's code runs as written: every ```python block of docs/USAGE.md on 2 gloo ranks, as
`torchrun --nproc-per-node 2 train.py` runs it; docs/ACCELERATE.md's script under its own `accelerate launch`
line on 2 CPU processes, equal to one process."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from spawn import run_ranks

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(name: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / name).read_text(), flags=re.S | re.M)


def _run_usage(rank: int, world: int, workdir: str) -> str:
    os.chdir(workdir)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in python_blocks("USAGE.md"):
            exec(compile(block, "docs/USAGE.md", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_usage_script_runs_as_written_on_two_ranks(tmp_path):
    assert python_blocks("USAGE.md"), "docs/USAGE.md has no python block"
    outputs = run_ranks(_run_usage, 2, str(tmp_path))
    assert outputs[1] == ""  # only rank 0 prints
    assert re.findall(r"epoch (\d): loss [\d.]+, (\d+) steps on 2 rank\(s\)", outputs[0]) == [("0", "32"), ("1", "64")]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step64"


def bash_lines(name: str) -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", (DOCS / name).read_text(), flags=re.S | re.M)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def _one_process(workdir: Path, script: str, monkeypatch) -> str:
    """The script run as __main__ in this process, in workdir, with no launcher's environment; what it printed.
    The world of one it made and accelerate's state are undone after (later tests fork ranks from here)."""
    from accelerate.state import AcceleratorState

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(workdir)
    printed = io.StringIO()  # one torch thread (conftest.py), as the launch's processes run with OMP_NUM_THREADS=1
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, "docs/ACCELERATE.md", "exec"), {"__name__": "__main__"})
    finally:
        AcceleratorState._reset_state(True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return printed.getvalue()


def test_accelerate_script_runs_as_written_on_two_cpu_processes_and_equals_one(tmp_path, monkeypatch):
    """docs/ACCELERATE.md's script under its own `accelerate launch` line for 2 CPU processes, and as one
    process (as `python train.py` runs it, in this one), at once: the same losses printed and the same final
    weights."""
    pytest.importorskip("accelerate")
    blocks = python_blocks("ACCELERATE.md")
    assert len(blocks) == 1, "docs/ACCELERATE.md holds one script"
    launch = [line for line in bash_lines("ACCELERATE.md") if "ACCELERATE_USE_CPU=true" in line]
    assert launch == ["ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 train.py"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for name in ("two", "one"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.py").write_text(blocks[0])
    launched = subprocess.Popen(["bash", "-c", launch[0]], cwd=tmp_path / "two", env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    # The one process is this one, while the launch runs (as `python train.py` runs it: no launcher, so zerodp
    # makes a world of one): a fourth interpreter importing torch and accelerate cost ~10 s of CPU.
    out = {"one": (_one_process(tmp_path / "one", blocks[0], monkeypatch), "")}
    out["two"] = launched.communicate(timeout=600)
    assert launched.returncode == 0, f"two: {out['two'][1][-3000:]}"
    epochs = {name: re.findall(r"epoch (\d): loss ([\d.]+), (\d+) steps on (\d) process", out[name][0]) for name in out}
    assert [e[:3] for e in epochs["two"]] == [e[:3] for e in epochs["one"]] and len(epochs["one"]) == 2, epochs
    assert {e[3] for e in epochs["two"]} == {"2"} and {e[3] for e in epochs["one"]} == {"1"}
    two, one = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("two", "one"))
    assert two.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-6, msg=key)
    assert (tmp_path / "two" / "checkpoints" / "latest").read_text() == "global_step32"


def test_accelerate_launch_on_cpus_without_accelerate_use_cpu_is_refused_naming_both_counts(tmp_path):
    """docs/ACCELERATE.md's GPU line on a machine without GPUs (none visible): Accelerate counts 1 process,
    torch.distributed 2. zerodp.initialize refuses it before training, so no process writes model.pt."""
    pytest.importorskip("accelerate")
    launch = [line for line in bash_lines("ACCELERATE.md") if line.startswith("accelerate launch")]
    assert launch == ["accelerate launch --multi_gpu --num_processes 2 train.py"]
    (tmp_path / "train.py").write_text(python_blocks("ACCELERATE.md")[0])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "ACCELERATE_USE_CPU")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(["bash", "-c", launch[0]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0
    said = "zerodp.initialize: Accelerate sees 1 process(es) but torch.distributed's world has 2 ranks"
    fix = "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2"
    assert said in done.stderr and fix in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "model.pt").exists() and not (tmp_path / "checkpoints").exists()


def _initialize_beside_an_accelerate_of_one(rank: int, world: int) -> str:
    """A rank of a gloo world of 2 whose Accelerate state counts 1 process (made without a launcher's
    environment); zerodp.initialize's error, if any."""
    from accelerate.state import AcceleratorState, PartialState

    import zerodp
    PartialState(cpu=True)
    model = torch.nn.Linear(2, 2)
    try:
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"train_micro_batch_size_per_gpu": 1})
    except ValueError as e:
        return str(e)
    finally:
        AcceleratorState._reset_state(True)
    return ""


def test_every_rank_refuses_an_accelerate_that_counts_other_processes():
    pytest.importorskip("accelerate")
    for message in run_ranks(_initialize_beside_an_accelerate_of_one, 2):
        assert "Accelerate sees 1 process(es) but torch.distributed's world has 2 ranks" in message, message
