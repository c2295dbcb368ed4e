"""The main job, run as a user runs it: `python -m zerodp.train ...` in a fresh process.

Tiny model, few steps. The two-rank runs go through the job's own launcher (no torchrun, no RANK
in the environment), exactly what a newcomer's one command does.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--micro-batch", "4", "--eval-batches", "2"]


def corpus(tmp_path: Path) -> str:
    """A small fixed text corpus (a copy of this repo's model and data code, kept in tests/data so that
    changes to the code do not change it)."""
    text = (REPO / "tests/data/corpus.txt").read_text()
    path = tmp_path / "corpus.txt"
    path.write_text(text * 4)
    return str(path)


def train(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "zerodp.train", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"zerodp train {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_hugging_face_gpt2_trains_through_the_engine_unchanged(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    train("--model", "hf-gpt2:tiny", "--micro-batch", "4", "--eval-batches", "2", "--steps", "12",
          "--eval-every", "12", "--nproc", "1", "--data", corpus(tmp_path), "--out", str(out))
    lines = metrics(out)
    val = [r["val_loss"] for r in lines if r["kind"] == "eval"]
    assert len(val) == 2 and val[-1] < val[0], val
    final = torch.load(out / "final.pt", weights_only=True)
    assert any(name.startswith("model.") for name in final)  # the HF model, held unchanged


# The main run, uninterrupted: 12 steps on 2 ranks, validated at 0, 6 and 12, a checkpoint every 3. It is also
# the reference the killed-and-resumed runs below must end equal to (evaluation changes no weight: no dropout,
# its own batches). --lr 3e-3 with a 2-step warmup: the validation loss falls by far more than 0.3 in 12 steps.
_COMMON = ["--steps", "12", "--save-every", "3", "--nproc", "2", "--dtype", "fp32", "--warmup", "2", "--lr", "3e-3"]
STEPS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, Path, subprocess.CompletedProcess]:
    """(corpus, run dir, its process) of the uninterrupted 12-step 2-rank run."""
    tmp = tmp_path_factory.mktemp("reference")
    data = corpus(tmp)
    out = tmp / "reference"
    return data, out, train(*TINY, *_COMMON, "--eval-every", "6", "--data", data, "--out", str(out))


def test_job_trains_on_two_gloo_ranks_it_starts_itself(reference):
    _, out, proc = reference
    lines = metrics(out)
    steps = [r["step"] for r in lines if r["kind"] == "train"]
    assert steps == list(range(1, STEPS + 1))
    last = [r for r in lines if r["kind"] == "train"][-1]
    assert {"loss", "lr", "tokens_per_s", "grad_norm", "loss_scale"} <= last.keys()
    val = [r["val_loss"] for r in lines if r["kind"] == "eval"]
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [0, 6, 12]
    assert val[-1] < val[0] - 0.3, f"validation loss did not drop: {val}"
    memory = [r for r in lines if r["kind"] == "memory"]
    assert len(memory[-1]["ranks"]) == 2  # one memory report per rank
    assert {"working_params", "gradients", "optimizer_states", "activations_estimate"} <= memory[-1]["ranks"][0].keys()
    assert (out / "report.png").stat().st_size > 10_000
    assert (out / "final.pt").exists()
    assert "final validation loss" in proc.stdout


def test_offload_nvme_reaches_the_same_validation_loss_bit_for_bit_in_fp32(reference, tmp_path):
    """--offload nvme: the job's AdamW masters and moments in scratch files under --nvme-path (none left)."""
    data, out, _ = reference
    scratch = tmp_path / "nvme"
    scratch.mkdir()
    train(*TINY, *_COMMON, "--eval-every", "6", "--data", data, "--out", str(tmp_path / "run"), "--offload", "nvme",
          "--nvme-path", str(scratch))
    val = [r["val_loss"] for r in metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert val == [r["val_loss"] for r in metrics(out) if r["kind"] == "eval"]
    disk = [r for r in metrics(tmp_path / "run") if r["kind"] == "memory"][-1]["ranks"][0]
    assert disk["disk_model_states"] > 0 and list(scratch.iterdir()) == []


def assert_same_weights(a_out: Path, b_out: Path, atol: float) -> None:
    a = torch.load(a_out / "final.pt", weights_only=True)
    b = torch.load(b_out / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=atol, msg=name)


# The killed run: the reference's settings without validation (--eval-every 0), a checkpoint every 2 steps
# keeping the last 2, SIGKILLed after step 11. Two copies of it are resumed: on 2 ranks from the tag global_step8
# (not the latest, step 10), and on 1 rank with --resume after its newest checkpoint (step 10) is truncated.
_KILLED = [*TINY, *_COMMON, "--save-every", "2", "--keep-last", "2", "--eval-every", "0"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, reference) -> tuple[Path, list]:
    """(run dir, its checkpoints when killed) of the 2-rank run SIGKILLed after step 11."""
    out = tmp_path_factory.mktemp("killed") / "run"
    proc = train(*_KILLED, "--data", reference[0], "--out", str(out), "--crash-after", "11", check=False)
    assert proc.returncode != 0 and f"exit code {-signal.SIGKILL}" in proc.stderr, proc.stderr[-3000:]
    assert not (out / "final.pt").exists()
    return out, sorted(os.listdir(out / "checkpoints"))


def _copy_of(killed: tuple[Path, list], tmp_path_factory, name: str) -> Path:
    out = tmp_path_factory.mktemp(name) / "run"
    shutil.copytree(killed[0], out, symlinks=True)
    return out


@pytest.fixture(scope="module")
def resumed_on_two_ranks(tmp_path_factory, reference, killed) -> tuple[Path, subprocess.CompletedProcess]:
    out = _copy_of(killed, tmp_path_factory, "two_ranks")
    return out, train(*_KILLED, "--data", reference[0], "--out", str(out), "--resume", "global_step8")


def test_two_rank_run_killed_after_step_11_and_resumed_from_a_tag_ends_with_the_same_weights(
        reference, resumed_on_two_ranks):
    # Killed after step 11; resumed from its step-8 checkpoint (the latest is step 10), it redoes steps 9-11.
    resumed, proc = resumed_on_two_ranks
    assert "resumed at step 8" in proc.stdout
    assert_same_weights(reference[1], resumed, atol=1e-6)
    train_steps = [r["step"] for r in metrics(resumed) if r["kind"] == "train"]
    assert train_steps == list(range(1, STEPS + 1))  # the killed run's lost steps are not logged twice
    assert [r["step"] for r in metrics(resumed) if r["kind"] == "resume"] == [8]  # report.png marks it


def test_eval_every_0_means_no_validation(resumed_on_two_ranks):
    out, proc = resumed_on_two_ranks
    lines = metrics(out)
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert not [r for r in lines if r["kind"] == "eval"]
    assert "no validation (--eval-every 0)" in proc.stdout
    bar = proc.stderr  # the progress bar's last state
    assert f"{STEPS}/{STEPS}" in bar and "tok/s" in bar and " val " not in bar  # the bar showed 'val nan' (issue 34)


def test_a_fresh_run_into_a_folder_holding_a_run_is_refused_and_the_tp_example_gets_its_own_folder(
        reference, tmp_path, monkeypatch):
    from zerodp.train.options import parse_options
    from zerodp.train.resume import choose_resume

    data, ref, _ = reference
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny-zero2").symlink_to(ref)  # the main job's default folder, with its work
    # The README's tp example writes beside the main job, not over it.
    assert parse_options([*TINY, "--tp", "2", "--nproc", "4"]).out == os.path.join("runs", "tiny-zero2-tp2")
    ours = run_id(ref)
    # The same job again, into its default folder or named by --out, and another job: each is a new run.
    for extra in ([], ["--out", "runs/tiny-zero2"], ["--offload"]):
        with pytest.raises(SystemExit) as e:
            choose_resume(parse_options([*TINY, "--data", data, "--nproc", "2", *extra]), 2)
        assert str(e.value).startswith(f"zerodp train: 'runs/tiny-zero2' holds the work of run {ours} (tiny, at "
                                       "step 12 of 12): checkpoints, metrics.jsonl, report.png, final.pt; a new run "
                                       "there would replace it. Choose one:"), str(e.value)
    opts = parse_options([*TINY, "--data", data, "--nproc", "2", "--resume"])
    choose_resume(opts, 2)  # --resume continues it, as the same run
    assert opts.run == ours and opts.resume_path == os.path.join("runs", "tiny-zero2", "checkpoints", "global_step12")


def run_id(out: Path) -> str:
    """The run named by the "run" records of out/metrics.jsonl (one per start; a resume's names the same)."""
    ids = {r["id"] for r in metrics(out) if r["kind"] == "run"}
    assert len(ids) == 1, ids
    return ids.pop()


def test_resume_when_steps_are_already_reached_says_so(reference, capsys):
    from zerodp.train.options import parse_options
    from zerodp.train.resume import choose_resume

    data, ref, _ = reference
    opts = parse_options([*TINY, *_COMMON, "--data", data, "--out", str(ref), "--resume"])
    with pytest.raises(SystemExit) as e:
        choose_resume(opts, 2)
    assert e.value.code == 0
    said = capsys.readouterr().err
    assert "is at step 12, and --steps is 12: nothing left to train; to train 12 steps more, resume with: " \
           f"zerodp train --model tiny --data {data} --micro-batch 4 --lr 0.003 --warmup 2 --dtype fp32 --eval-batches 2 " \
           f"--save-every 3 --nproc 2 --out {ref} --steps 24 --resume" in said, said


def test_resume_with_no_checkpoint_trains_from_scratch_with_one_warning_naming_the_directory(tmp_path, capsys):
    from zerodp.train.options import parse_options
    from zerodp.train.resume import choose_resume

    out = tmp_path / "mistyped"
    opts = parse_options([*TINY, *_COMMON, "--data", corpus(tmp_path), "--out", str(out), "--resume"])
    choose_resume(opts, 2)
    assert opts.resume_path is None  # from scratch, as the first run of a restartable job
    assert capsys.readouterr().err.splitlines() == [
        f"zerodp train: warning: --resume: no checkpoint in '{out / 'checkpoints'}': training from scratch"]


def test_resume_with_more_steps_continues_the_lr_schedule_without_a_jump(reference, capsys):
    from zerodp.models.build import build_model
    from zerodp.train.ds_sections import optimizer_and_schedule
    from zerodp.train.options import parse_options
    from zerodp.train.resume import choose_resume

    data, ref, _ = reference
    saved = {r["step"]: r["lr"] for r in metrics(ref) if r["kind"] == "train"}
    opts = parse_options([*TINY, *_COMMON, "--data", data, "--out", str(ref), "--resume", "global_step3",
                          "--steps", "20"])
    choose_resume(opts, 2)
    assert "--steps 12 -> 20: the lr schedule goes on from step 3's lr" in capsys.readouterr().err
    model, _ = build_model("tiny", 256, None)
    optimizer, factory, _ = optimizer_and_schedule(model, opts)
    scheduler = factory(optimizer)
    lrs = []
    for _ in range(20):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[:3] == pytest.approx([saved[1], saved[2], saved[3]], rel=1e-9)  # the saved run's, up to its checkpoint
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] == pytest.approx(opts.min_lr)


@pytest.fixture(scope="module")
def resumed_on_one_rank(tmp_path_factory, reference, killed) -> tuple[Path, list, subprocess.CompletedProcess]:
    """A copy of the killed run (checkpoints every 2 steps, the last 2 kept, SIGKILLed after step 11) whose
    newest checkpoint (step 10) is truncated; `--resume` then continues on 1 rank."""
    out = _copy_of(killed, tmp_path_factory, "one_rank")
    step10 = out / "checkpoints" / "global_step10" / "__0_0.distcp"
    os.truncate(step10, step10.stat().st_size // 2)
    return out, killed[1], train(*_KILLED, "--data", reference[0], "--out", str(out), "--nproc", "1", "--resume")


def test_report_title_names_the_run_and_what_a_resume_changed(reference, resumed_on_one_rank):
    from zerodp.train.report import run_title

    assert run_title(metrics(reference[1])) == "tiny, ZeRO stage 2, fp32, 2 rank(s)"
    assert run_title(metrics(resumed_on_one_rank[0])) == "tiny, ZeRO stage 2, fp32, 2 rank(s); from step 8: 1 rank(s)"


def test_keep_last_leaves_the_newest_checkpoints_and_latest(resumed_on_one_rank):
    out, kept_when_killed, _ = resumed_on_one_rank
    assert kept_when_killed == ["global_step10", "global_step8", "latest"]  # saved at 2, 4, 6, 8, 10
    assert sorted(os.listdir(out / "checkpoints")) == ["global_step10", "global_step12", "latest"]


def test_resume_falls_back_past_a_corrupt_latest_and_keeps_the_global_batch_on_fewer_ranks(
        resumed_on_one_rank, reference):
    out, _, proc = resumed_on_one_rank
    assert "warning:" in proc.stderr and "global_step10" in proc.stderr and "truncated" in proc.stderr
    assert "resuming from the newest intact checkpoint" in proc.stderr and "global_step8" in proc.stderr
    assert "--grad-accum 1 -> 2 keeps the checkpoint's global batch of 8 (2 rank(s)" in proc.stderr
    assert "resumed at step 8" in proc.stdout and "1 rank(s)" in proc.stdout
    # The same data each step (StepBatches), so the same weights as the uninterrupted 2-rank run.
    assert_same_weights(reference[1], out, atol=1e-5)


def test_resume_tag_and_a_global_batch_that_cannot_be_kept(resumed_on_one_rank, resumed_on_two_ranks, reference):
    out, _, _ = resumed_on_one_rank
    args = [*_KILLED, "--data", reference[0], "--out", str(out), "--nproc", "1"]
    from zerodp.train.options import parse_options
    from zerodp.train.resume import choose_resume

    def planned(*extra: str) -> str:  # the job's first step, before any rank starts: no process needed
        with pytest.raises(SystemExit) as stop:
            choose_resume(parse_options([*args, *extra]), 1)
        return str(stop.value)

    # The latest checkpoint (step 12) is the one-rank run's: 8 = 1 rank x 2 accumulation x 4.
    error = planned("--micro-batch", "3", "--resume")
    assert ("global batch is 8 (1 rank(s) x 2 accumulation x 4 micro-batch), which 1 rank(s) x --micro-batch 3 "
            "cannot split" in error and "--micro-batch 1, 2, 4, 8 would keep it" in error), error
    error = planned("--resume", "nope")
    assert "checkpoint tag 'nope' (given) does not exist" in error, error
    # `--resume global_step8` on the killed run, whose latest is step 10: the tag, not the latest, is resumed
    # (and ends at the reference's weights: test_two_rank_run_killed_after_step_11_and_resumed_from_a_tag_...).
    assert "resumed at step 8" in resumed_on_two_ranks[1].stdout


def test_explicit_grad_accum_on_resume_wins_with_a_warning(capsys):
    from zerodp.train.options import parse_options
    from zerodp.train.resume import keep_global_batch

    meta = {"world_size": 2, "client_state": {"options": {"micro_batch": 4, "grad_accum": 1}}}
    opts = parse_options(["--micro-batch", "4", "--grad-accum", "1", "--nproc", "1"])
    keep_global_batch(opts, meta, world=1)
    assert opts.grad_accum == 1
    assert "global batch changes from 8 (2 rank(s) x 1 accumulation x 4 micro-batch) in the checkpoint to 4 " \
           "(1 rank(s) x 1 accumulation x 4 micro-batch)" in capsys.readouterr().err


def test_step_data_is_the_same_for_any_world_size_at_a_fixed_global_batch():
    from zerodp.train.loop import StepBatches

    tokens = np.arange(10_000, dtype=np.uint16)

    def global_batch(world: int, accum: int, step: int) -> set[tuple[int, ...]]:
        rows = set()
        for rank in range(world):
            data = StepBatches(tokens, 16, 8 // (world * accum), accum, rank, world, seed=3)
            data.load_state_dict({"step": step, "seed": 3})
            rows |= {tuple(x.tolist()) for xs, _ in data.next_step() for x in xs}
        return rows

    for step in (0, 7):
        reference = global_batch(1, 1, step)
        assert len(reference) == 8
        assert global_batch(2, 1, step) == reference
        assert global_batch(1, 2, step) == reference
        assert global_batch(4, 2, step) == reference


def test_options_layer_flags_over_config_file_over_ds_config(tmp_path):
    from zerodp.train.options import parse_options

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 32, "gradient_accumulation_steps": 2,
                              "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}))
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"ds_config": str(ds), "steps": 7, "stage": 2}))
    opts = parse_options(["--config", str(options), "--steps", "9", "--nproc", "2"])
    assert (opts.steps, opts.stage, opts.dtype) == (9, 2, "bf16")
    assert (opts.micro_batch, opts.grad_accum) == (8, 2)  # 32 = 8 x 2 x 2 ranks


def test_bad_options_fail_before_any_rank_starts_with_the_key_named(tmp_path):
    from zerodp.train.options import parse_options

    options = tmp_path / "options.json"
    options.write_text(json.dumps({"stpes": 7}))
    with pytest.raises(SystemExit, match="unknown key 'stpes'.*did you mean 'steps'"):
        parse_options(["--config", str(options)])
    with pytest.raises(SystemExit, match="--model 'huge'"):
        parse_options(["--model", "huge"])
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 15}))
    with pytest.raises(SystemExit, match="not divisible"):
        parse_options(["--ds-config", str(ds), "--nproc", "2"])


# ---- run folders: a fresh run into another run's folder, and that folder mixed ----------------------------
def printed(text: str, marker: str) -> list[str]:
    """The arguments of the `zerodp train ...` command printed after `marker` (on its line or the next),
    run as printed: its words after `zerodp train`, for `python -m zerodp.train`."""
    at = text.index(marker) + len(marker)
    words = shlex.split(text[at:].lstrip("\n ").splitlines()[0])
    assert words[:2] == ["zerodp", "train"], words
    return words[2:]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder`, by its path there: the md5 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def another_runs_folder(reference: tuple, tmp: Path) -> Path:
    """The reference run's folder made the issue's: that run's global_step50/100/110 (its 6, 9 and 12, renamed
    and their zerodp.json made to say so: --steps 120, reached 110), `latest`, metrics.jsonl, report.png, final.pt."""
    out = tmp / "run"
    shutil.copytree(reference[1], out)
    ckpt = out / "checkpoints"
    for old, step in ((6, 50), (9, 100), (12, 110)):
        tag = ckpt / f"global_step{step}"
        (ckpt / f"global_step{old}").rename(tag)
        meta = json.loads((tag / "zerodp.json").read_text())
        meta["tag"], meta["counters"]["global_steps"], meta["client_state"]["data"]["step"] = tag.name, step, step
        meta["client_state"]["options"]["steps"] = 120
        (tag / "zerodp.json").write_text(json.dumps(meta))
    shutil.rmtree(ckpt / "global_step3")
    (ckpt / "latest").write_text("global_step110")
    return out


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, reference) -> dict:
    """The issue's sequence: a fresh `--steps 2` into another run's folder (refused, then its --move-aside way
    run as printed), that run's checkpoints copied back beside this run's (a folder mixed by hand or by zerodp
    before runs had names), `--resume --steps 4`, `--resume --steps 6 --keep-last 2`, the newest truncated,
    then `--resume --steps 4` (nothing left: it says how to train on) and that hint run as printed."""
    from zerodp.train.options import parse_options
    from zerodp.train.resume import choose_resume

    tmp = tmp_path_factory.mktemp("run_folder")
    out = another_runs_folder(reference, tmp)
    theirs, before = run_id(out), snapshot(out)
    common = [*TINY, "--save-every", "2", "--eval-every", "0", "--dtype", "fp32", "--warmup", "1",
              "--data", reference[0], "--out", str(out)]
    s = {"theirs": theirs, "before": before, "out": out}
    s["refused"] = train(*common, "--steps", "2", "--nproc", "2", check=False)
    s["after_refusal"] = snapshot(out)
    said = s["refused"].stderr
    s["ways"] = [printed(said, way) for way in ("continue that run (with its own settings):",
                                                  "this new run in another folder:", ".moved-<UTC time>':")]
    s["ways_planned"] = []
    for way in s["ways"][:2]:  # planned in this process: no rank needed to see that each is taken
        opts = parse_options(way)
        choose_resume(opts, 2)
        s["ways_planned"].append((opts.resume_path, opts.run, opts.out))
    s["fresh"] = train(*s["ways"][2])
    s["moved"] = [p for p in tmp.iterdir() if p.name.startswith("run.moved-")]
    for step in (50, 100, 110):
        shutil.copytree(s["moved"][0] / "checkpoints" / f"global_step{step}", out / "checkpoints" / f"global_step{step}")
    s["resume4"] = train(*common, "--nproc", "1", "--steps", "4", "--resume")
    s["resume6"] = train(*common, "--nproc", "1", "--steps", "6", "--keep-last", "2", "--resume")
    s["kept"] = sorted(os.listdir(out / "checkpoints"))
    step6 = out / "checkpoints" / "global_step6" / "__0_0.distcp"
    os.truncate(step6, step6.stat().st_size // 2)
    said = io.StringIO()
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stderr(said):
        choose_resume(parse_options([*common, "--nproc", "1", "--steps", "4", "--keep-last", "2", "--resume"]), 1)
    assert stop.value.code == 0 and "nothing left to train" in said.getvalue(), said.getvalue()
    s["resumed_as_printed"] = train(*printed(said.getvalue(), "resume with: "))
    return s


def test_a_fresh_run_into_another_runs_folder_stops_naming_it_and_three_whole_commands(run_folder):
    s, out = run_folder, run_folder["out"]
    proc = s["refused"]
    assert proc.returncode == 1 and "out:" not in proc.stdout, proc.stdout  # before any rank started
    assert proc.stderr.startswith(f"zerodp train: '{out}' holds the work of run {s['theirs']} (tiny, at step 110 of "
                                  "120): checkpoints, metrics.jsonl, report.png, final.pt; a new run there would "
                                  "replace it. Choose one:"), proc.stderr
    assert s["after_refusal"] == s["before"]  # nothing touched
    # Each way, as printed: that run continued from its latest; this one in a free folder; this one here.
    ckpt = out / "checkpoints"
    assert s["ways_planned"][0] == (str(ckpt / "global_step110"), s["theirs"], str(out))
    assert s["ways"][0][-4:] == ["--out", str(out), "--steps", "120", "--resume"][-4:]
    resume_path, run, other = s["ways_planned"][1]
    assert resume_path is None and run != s["theirs"] and other == f"{out}-2" and not Path(other).exists()
    assert s["ways"][2][-1] == "--move-aside"


def test_move_aside_keeps_the_other_runs_work_whole_in_a_dated_sibling(run_folder):
    s, out = run_folder, run_folder["out"]
    assert len(s["moved"]) == 1 and re.fullmatch(r"run\.moved-\d{8}-\d{6}", s["moved"][0].name), s["moved"]
    assert snapshot(s["moved"][0]) == s["before"]  # every file of it, byte for byte: nothing half-replaced
    assert f"--move-aside: '{out}' (the work of run {s['theirs']}" in s["fresh"].stdout
    ours = {r["id"] for r in metrics(out) if r["kind"] == "run"}
    assert len(ours) == 1 and s["theirs"] not in ours  # this run's metrics, its own run
    ours = ours.pop()
    for tag in ("global_step6", "global_step8"):  # this run's checkpoints name it (its step 2 went by --keep-last)
        assert json.loads((out / "checkpoints" / tag / "zerodp.json").read_text())["run"] == ours


def test_keep_last_and_the_fallback_take_only_the_current_runs_checkpoints(run_folder):
    s, out = run_folder, run_folder["out"]
    assert "resumed at step 2" in s["resume4"].stdout and "resumed at step 4" in s["resume6"].stdout
    # The current run's newest two kept (2 removed); the other run's 50, 100 and 110 neither removed nor taken.
    assert s["kept"] == ["global_step100", "global_step110", "global_step4", "global_step50", "global_step6", "latest"]
    ours = run_id(out)
    # Its newest (6) truncated: `--resume --steps 4` falls back to its step 4, nothing left there to train,
    # and the command it prints (--steps 8) then trains from step 4 on.
    resumed = s["resumed_as_printed"]
    assert (f"resuming from the newest intact checkpoint of run {ours}, '{out / 'checkpoints' / 'global_step4'}' "
            "(step 4)") in resumed.stderr, resumed.stderr[-3000:]
    assert "global_step6" in resumed.stderr and "truncated" in resumed.stderr
    assert "resumed at step 4" in resumed.stdout and "global_step110" not in resumed.stderr
    assert [r["step"] for r in metrics(out) if r["kind"] == "train"] == list(range(1, 9))
    kept = sorted(os.listdir(out / "checkpoints"))
    assert kept == ["global_step100", "global_step110", "global_step50", "global_step6", "global_step8", "latest"]
    for step in (50, 100, 110):  # the other run's, unchanged
        tag = f"checkpoints/global_step{step}"
        assert {k: v for k, v in snapshot(out).items() if k.startswith(tag)} == \
               {k: v for k, v in s["before"].items() if k.startswith(tag)}


def test_move_aside_is_refused_where_it_would_move_what_the_run_reads_or_with_resume(tmp_path):
    from zerodp.train.options import parse_options
    from zerodp.train.resume import choose_resume

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "run", "step": 0, "id": "20260101-000000-abcdef", "model": "tiny"}\n')
    data = corpus(out)  # the data inside the folder that would move
    with pytest.raises(SystemExit) as e:
        choose_resume(parse_options([*TINY, "--data", data, "--out", str(out), "--move-aside"]), 2)
    assert f"--move-aside would move '{out}', which holds '{data}' (--data) that this run reads" in str(e.value)
    assert sorted(os.listdir(out)) == ["corpus.txt", "metrics.jsonl"]  # nothing moved
    with pytest.raises(SystemExit) as e:  # without --move-aside: the run there, named by its metrics
        choose_resume(parse_options([*TINY, "--data", data, "--out", str(out)]), 2)
    assert "holds the work of run 20260101-000000-abcdef (tiny, no checkpoint read): metrics.jsonl" in str(e.value)
    with pytest.raises(SystemExit, match="--move-aside starts a new run .* and --resume continues"):
        parse_options([*TINY, "--out", str(out), "--move-aside", "--resume"])
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"move_aside": True}))
    with pytest.raises(SystemExit, match="it is a choice for one command"):
        parse_options(["--config", str(options)])
