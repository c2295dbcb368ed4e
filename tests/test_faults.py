"""Faults injected on one rank reach every rank as one clear error; nothing hangs, nothing is lost.

Set-up errors (a config error, a model on 'meta' that cannot be initialised) on one rank only, a
checkpoint save that runs out of disk on one rank only, and the process-group timeout. The failing rank stays alive after its error, as
in a notebook: the other rank must raise anyway, promptly, rather than wait in a collective.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import zerodp
from oracle import D_IN, D_OUT, Toy, one_group
from spawn import run_ranks
from test_train import REPO, TINY, corpus

CFG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
PROMPT_S = 5.0  # "promptly": far below the spawned group's 30 s timeout, which is what main waits for


def _initialize_on_every_rank(rank: int, fault: str) -> tuple[str, str, float]:
    """zerodp.initialize with `fault` on rank 1 only; (error class, message, seconds until it raised)."""
    torch.manual_seed(0)
    model, cfg = Toy(), dict(CFG)
    if rank == 1 and fault == "config":
        cfg["zero_optimization"] = {"stge": 2}
    if rank == 1 and fault == "meta":  # on meta, with a parameter that nothing can initialise
        with torch.device("meta"):
            model = Toy(tied=True)
    t0 = time.monotonic()
    try:
        zerodp.initialize(model, one_group(model), cfg)
        result = ("no error", "", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the test records what each rank raised
        result = (type(e).__name__, str(e), time.monotonic() - t0)
    if rank == 1:
        time.sleep(1.0)  # the failing rank stays alive after its error and takes no part in anything
    return result


def _save_runs_out_of_disk_on_rank1(rank: int, world: int, d: str) -> dict:
    """Save at step 1; at step 2 rank 1's file writes fail with ENOSPC; then load what is there."""
    import torch.distributed.checkpoint.filesystem as fs
    torch.manual_seed(0)
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), {**CFG, "optimizer": {"type": "AdamW", "params": {}}})
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        x, y = torch.randn(4, D_IN, generator=g), torch.randn(4, D_OUT, generator=g)
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()

    step()
    engine.save_checkpoint(d)
    saved = {k: v.clone() for k, v in engine.full_state_dict().items()}
    step()
    write_item = fs._write_item
    if rank == 1:
        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fs._write_item = full_disk
    try:
        engine.save_checkpoint(d)
        error = "no error"
    except zerodp.checkpoint.CheckpointError as e:
        error = str(e)
    finally:
        fs._write_item = write_item
    dist.barrier()  # rank 0 has cleaned up before anyone lists the directory
    listing = sorted(os.listdir(d))
    engine.load_checkpoint(d)
    same = all(torch.equal(v, saved[k]) for k, v in engine.full_state_dict().items())
    return {"error": error, "listing": listing, "steps": engine.global_steps, "restored": same}


def _faults(rank: int, world: int, d: str) -> dict:
    zerodp.initialize(Toy(), None, {**CFG, "optimizer": {"type": "AdamW"}})  # warm: imports, connections
    out = {fault: _initialize_on_every_rank(rank, fault) for fault in ("config", "meta")}
    out["enospc"] = _save_runs_out_of_disk_on_rank1(rank, world, d)
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """One pair of spawned ranks runs every fault in turn (one spawn: each costs seconds)."""
    d = str(tmp_path_factory.mktemp("faults") / "ckpt")
    return run_ranks(_faults, 2, d, timeout_s=30)


def test_config_error_on_one_rank_raises_on_every_rank_while_the_failing_rank_stays_alive(faults):
    (kind0, msg0, seconds0), (kind1, msg1, _) = faults[0]["config"], faults[1]["config"]
    assert kind1 == "ConfigError" and "zero_optimization.stge" in msg1  # its own error, unchanged
    assert kind0 == "ConfigError", msg0  # the same class on the rank that had nothing wrong
    assert "failed on rank 1" in msg0 and "zero_optimization.stge" in msg0
    assert seconds0 < PROMPT_S


def test_model_on_meta_on_one_rank_raises_on_every_rank(faults):
    (kind0, msg0, seconds0), (kind1, msg1, _) = faults[0]["meta"], faults[1]["meta"]
    assert kind1 == "ValueError" and "'meta' device" in msg1
    assert kind0 == "ValueError" and "failed on rank 1" in msg0 and "'meta' device" in msg0
    assert seconds0 < PROMPT_S


def test_enospc_on_one_rank_is_the_same_checkpoint_error_everywhere_and_loses_nothing(faults):
    r0, r1 = faults[0]["enospc"], faults[1]["enospc"]
    assert r0["error"] == r1["error"], (r0["error"], r1["error"])
    assert "no space left on device" in r0["error"] and "bytes needed at" in r0["error"]
    assert ".tmp.global_step2" in r0["error"]
    assert r0["listing"] == ["global_step1", "latest"]  # the temp dir is gone, `latest` unchanged
    assert r0["steps"] == r1["steps"] == 1 and r0["restored"] and r1["restored"]


def test_comm_timeout_is_a_strict_positive_number():
    assert zerodp.load_config({}).comm_timeout_s == 600
    assert zerodp.load_config({"comm_timeout_s": 10}).comm_timeout_s == 10
    for bad in ("10", True, 0, -1.5):
        with pytest.raises(zerodp.ConfigError, match="comm_timeout_s"):
            zerodp.load_config({"comm_timeout_s": bad})



def test_comm_timeout_is_the_timeout_of_the_group_initialize_creates():
    script = ("import torch, zerodp; from torch import nn; m = nn.Linear(2, 2); "
              "zerodp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), "
              "{'train_micro_batch_size_per_gpu': 1, 'comm_timeout_s': 7}); "
              "print(zerodp.Comm().group._get_backend(torch.device('cpu')).options._timeout.total_seconds())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "7.0", proc.stderr[-2000:]


# ---- the train job: a stalled rank, a killed rank, a preemption ------------------------------------
def _job(out: Path, data: str, *extra: str, session: bool = False, args: list[str] | None = None) -> subprocess.Popen:
    """`python -m zerodp.train` on 2 ranks it starts itself: a tiny model, no evaluation or saves (or `args`)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    args = args or [*TINY, "--steps", "40", "--eval-every", "1000", "--save-every", "1000", "--data", data,
                    "--nproc", "2", "--out", str(out), "--dtype", "fp32", "--warmup", "2", *extra]
    return subprocess.Popen([sys.executable, "-m", "zerodp.train", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=session)


class Ended(NamedTuple):
    seconds: float  # from the signal (or from reaching the step) to the job's exit
    stdout: str
    stderr: str
    started_s: float  # from the launch to the step: how fast this machine runs a job start right now


def _seconds_after_step(proc: subprocess.Popen, out: Path, step: int, send=None) -> Ended:
    """Wait until this job has logged `step`, optionally send it a signal, then time its exit.

    Only the records this job wrote count: a resumed job keeps the lines of the run before it until its
    set-up rewrites the file, and a signal sent on those would land in its set-up. A job that never gets
    there fails here, naming the wait, rather than being signalled somewhere else."""
    launched = time.monotonic()
    deadline = launched + 600  # a loaded 2-core machine starts a job in tens of seconds, not minutes
    metrics, resume = out / "metrics.jsonl", '"kind": "resume"'
    # Imports alone take this job seconds, so the file still holds only the earlier runs' records here.
    earlier = metrics.read_text().count(resume) if metrics.exists() else None
    while proc.poll() is None:
        text = metrics.read_text() if metrics.exists() else ""
        if earlier is not None:  # this job's records follow its own "resume" record
            parts = text.split(resume)
            text = parts[-1] if len(parts) > earlier + 1 else ""
        if f'"kind": "train", "step": {step},' in text:
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the job did not log step {step} within 600 s:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    t0 = time.monotonic()
    if callable(send):
        send(proc)
    elif send is not None:
        proc.send_signal(send)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the job did not end within 300 s:\n{stderr[-3000:]}")
    return Ended(time.monotonic() - t0, stdout, stderr, t0 - launched)


TIMEOUT_S = 4


# Where rank 1 stalls (SIGSTOP at step 3: after it, or just before its evaluation or its checkpoint
# save) -> what rank 0's one line names: the collective and where.
STALLS = {"step": (r"\w+ in engine\.\w+\(\) .* at step 4", ()),
          "eval": (r"all_reduce of the validation loss at step 3", ("--eval-every", "3")),
          "save": (r"all_gather_object in engine\.save_checkpoint\(\) after step 3", ("--save-every", "3"))}


@pytest.mark.parametrize("where", list(STALLS))
def test_stalled_rank_ends_the_job_within_the_timeout_naming_the_collective(tmp_path, where):
    out = tmp_path / "run"
    named, extra = STALLS[where]
    proc = _job(out, corpus(tmp_path), "--timeout", str(TIMEOUT_S), "--crash-after", "3", "--crash-rank", "1",
                "--crash-signal", "SIGSTOP", "--crash-where", where, *extra)
    seconds, _, stderr, started_s = _seconds_after_step(proc, out, 3)
    print(f"SIGSTOP of rank 1 at step 3 ({where}): the job exited {seconds:.1f} s later "
          f"(it took {started_s:.1f} s to reach step 3)")
    assert proc.returncode != 0
    assert re.search(rf"rank 0: {named} timed out after {TIMEOUT_S} s: a peer rank stopped responding",
                     stderr), stderr[-3000:]
    # The launcher blames the rank that stalled, not the one that gave up waiting for it.
    assert ("zerodp train: rank 1 stopped responding (stalled or died): rank 0 gave up waiting for it"
            in stderr), stderr[-3000:]
    assert "rank 0 failed" not in stderr
    # The timeout, plus the launcher's shutdown and teardown: 15 s on an idle machine; a loaded one stretches
    # every process's exit as it stretches its start, so the start to step 3 bounds the teardown there.
    assert seconds < TIMEOUT_S + max(15.0, started_s), (seconds, started_s)


def test_launcher_names_the_rank_killed_first_not_the_rank_that_failed_after_it(tmp_path):
    out = tmp_path / "run"
    proc = _job(out, corpus(tmp_path), "--crash-after", "3", "--crash-rank", "1")
    seconds, _, stderr, _ = _seconds_after_step(proc, out, 3)
    print(f"SIGKILL of rank 1 after step 3: the job exited {seconds:.1f} s later")
    assert proc.returncode != 0
    assert "zerodp train: rank 1 was killed by SIGKILL (exit code -9)" in stderr, stderr[-3000:]
    assert "rank 0 failed" not in stderr


@pytest.fixture(scope="module")
def sigterm_then_ctrl_c(tmp_path_factory) -> dict:
    """A 2-rank job sent SIGTERM after step 3, then resumed by the command its stop printed, run as printed,
    and stopped by Ctrl-C after its first step: two launches for two signals (a launch costs seconds), the
    resume trained on between them."""
    tmp = tmp_path_factory.mktemp("signals")
    out, data = tmp / "run", corpus(tmp)
    proc = _job(out, data, "--timeout", "30")
    seconds, stdout, stderr, _ = _seconds_after_step(proc, out, 3, send=signal.SIGTERM)
    print(f"SIGTERM to the launcher after step 3: the job exited {seconds:.1f} s later")
    sigterm = {"code": proc.returncode, "stdout": stdout, "stderr": stderr,
               "latest": (out / "checkpoints" / "latest").read_text()}
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", stdout)
    step = int(stopped.group(1)) if stopped else None
    if step is None:
        return {"sigterm": sigterm, "step": None}
    # Ctrl-C in a terminal sends SIGINT to every process of the foreground group: launcher and ranks.
    hint = shlex.split(stdout.split("resume with: ", 1)[1].splitlines()[0])
    assert hint[:2] == ["zerodp", "train"] and hint[-5:] == ["--out", str(out), "--steps", "40", "--resume"], hint
    resumed = _job(out, data, session=True, args=hint[2:])
    seconds, stdout, stderr, _ = _seconds_after_step(resumed, out, step + 1,
                                                  send=lambda p: os.killpg(p.pid, signal.SIGINT))
    print(f"SIGINT to the resumed job's process group after step {step + 1}: it exited {seconds:.1f} s later")
    trained = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"]
    ctrl_c = {"code": resumed.returncode, "stdout": stdout, "stderr": stderr, "trained": trained,
              "latest": (out / "checkpoints" / "latest").read_text()}
    return {"sigterm": sigterm, "step": step, "ctrl_c": ctrl_c}


def test_sigterm_checkpoints_the_step_reached_and_exits_143_in_one_line_then_resumes(sigterm_then_ctrl_c):
    sigterm, step = sigterm_then_ctrl_c["sigterm"], sigterm_then_ctrl_c["step"]
    stdout, stderr = sigterm["stdout"], sigterm["stderr"]
    assert sigterm["code"] == 143, stderr[-3000:]
    lines = [line for line in stdout.splitlines() if "stopped by" in line]
    assert len(lines) == 1 and "stopped by SIGTERM after step" in lines[0], stdout
    assert "Traceback" not in stderr, stderr[-3000:]
    assert step >= 3 and sigterm["latest"] == f"global_step{step}"
    # The resumed job (stopped by Ctrl-C below, after training on) started from that checkpoint.
    resumed = sigterm_then_ctrl_c["ctrl_c"]
    assert f"resumed at step {step}" in resumed["stdout"], resumed["stderr"][-3000:]
    assert resumed["trained"][-1] > step and sorted(set(resumed["trained"])) == resumed["trained"]


def test_sigterm_to_a_one_rank_job_with_no_save_on_signal_stops_without_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _job(out, corpus(tmp_path), "--nproc", "1", "--no-save-on-signal")
    seconds, stdout, stderr, _ = _seconds_after_step(proc, out, 2, send=signal.SIGTERM)
    print(f"SIGTERM to a one-rank job after step 2: it exited {seconds:.1f} s later")
    assert proc.returncode == 143, stderr[-3000:]
    assert "no checkpoint written (--no-save-on-signal)" in stdout and "Traceback" not in stderr
    assert not (out / "checkpoints").exists()


def test_ctrl_c_to_the_whole_job_checkpoints_and_exits_130_in_one_line(sigterm_then_ctrl_c):
    """Ctrl-C in a terminal sends SIGINT to every process of the foreground group: launcher and ranks."""
    assert sigterm_then_ctrl_c["step"] is not None, sigterm_then_ctrl_c["sigterm"]["stdout"]
    ctrl_c = sigterm_then_ctrl_c["ctrl_c"]
    stdout, stderr = ctrl_c["stdout"], ctrl_c["stderr"]
    assert ctrl_c["code"] == 130, stderr[-3000:]
    lines = [line for line in stdout.splitlines() if "stopped by" in line]
    assert len(lines) == 1 and "stopped by SIGINT after step" in lines[0], stdout
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "leaked semaphore" not in stderr, stderr[-3000:]  # tqdm's lock in a rank that ends with os._exit
    step = int(re.search(r"after step (\d+)", lines[0]).group(1))
    assert step > sigterm_then_ctrl_c["step"] and ctrl_c["latest"] == f"global_step{step}"
