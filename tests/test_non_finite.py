"""A nan/inf loss on one rank: the step is skipped on every rank, said once, and the policy decides
when to stop; checkpoints never hold non-finite weights.

Every engine run of one world size happens in one set of spawned gloo ranks (spawning is the slow
part). The bad value goes into rank world-1's first micro-batch of step BAD (0-based): "nan" into its
input (a nan loss), "inf" as a factor on its loss (an inf loss, inf/nan gradients), "detached" as a
term added to its loss (an inf loss whose gradients are all finite).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile

import pytest
import torch

import logs
import oracle
import zerodp
from zerodp.engine.engine import inside
from spawn import run_ranks
from zerodp.checkpoint import CheckpointError
from zerodp.config import load_config

WORLDS = [1, 2]
STAGES = [0, 1, 2, 3]
DTYPES = ["fp32", "bf16", "fp16"]
KINDS = ["nan", "inf"]
BAD = 2  # the step whose batch is poisoned; its global step number is BAD + 1
OFFLOAD_STAGES = [1, 2, 3]

BAD_JOBS = [("bad", stage, dtype, kind, False) for stage in STAGES for dtype in DTYPES for kind in KINDS]
OFFLOAD_JOBS = [("bad", stage, "fp32", "nan", True) for stage in OFFLOAD_STAGES]
DETACHED_JOBS = [("bad", stage, "fp32", "detached", False) for stage in STAGES]
CLEAN_JOBS = [("clean", stage, dtype) for stage in STAGES for dtype in ("bf16", "fp16")]
POLICY_JOBS = ([("raise", stage) for stage in STAGES]
               + [("skip_policy",), ("reset",), ("fp16_min_scale",), ("fp16_static",), ("guard",)])


def lr_schedule(optimizer):
    """An lr that changes every step: a scheduler stepped on a skipped step shows in the weights."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1 / (1 + t))

def snapshot(engine, model) -> dict:
    with engine.gathered_parameters():
        working = [p.detach().clone() for p in model.parameters()]
    return {"master": [m.detach().clone() for m in inside(engine).training.partitioned_optimizer.masters], "working": working,
            "state": [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()],
            "lr": engine.get_lr(), "skipped": engine.skipped_steps, "steps": engine.global_steps,
            "grads_freed": all(a is None for a in inside(engine).training.reducer.grads)}


def train_with_bad_step(rank: int, world: int, stage: int, dtype: str, kind: str | None,
                        offload: bool = False) -> dict:
    """oracle's "plain" case (2 micro-steps per step, clipping) with step BAD poisoned on the last
    rank; kind None leaves step BAD's batch out altogether (the run the bad one must equal)."""
    case = oracle.CASES["plain"]
    model = oracle.build(case)
    engine = zerodp.initialize(model, case.optimizer(model), oracle.config_for(case, stage, world, dtype, offload),
                               lr_scheduler=lr_schedule)
    sl = slice(rank * oracle.MICRO, (rank + 1) * oracle.MICRO)
    snaps = {}
    with logs.captured("zerodp") as lines:
        for step, micro in enumerate(oracle.batches(world, case.gas)):
            if kind is None and step == BAD:
                continue
            for j, (x, y) in enumerate(micro):
                x = x[sl].clone()
                poison = kind is not None and step == BAD and rank == world - 1 and j == 0
                if poison and kind == "nan":
                    x[0, 0] = float("nan")
                loss = engine(x, y[sl])
                if poison and kind == "inf":
                    loss = loss * float("inf")
                if poison and kind == "detached":  # no gradient flows through the inf term
                    loss = loss + torch.tensor(float("inf"))
                engine.backward(loss)
                engine.step()
            if step in (BAD - 1, BAD):
                snaps[step] = snapshot(engine, model)
    return {"before": snaps.get(BAD - 1), "after": snaps.get(BAD), "state": engine.full_state_dict(),
            "skipped": engine.skipped_steps, "steps": engine.global_steps, "log": lines}


def reference_without_bad_step(world: int) -> dict:
    """Plain PyTorch on the whole batch of every step but BAD, with the same lr schedule."""
    case = oracle.CASES["plain"]
    model = oracle.build(case)
    opt = case.optimizer(model)
    sched = lr_schedule(opt)
    for step, micro in enumerate(oracle.batches(world, case.gas)):
        if step == BAD:
            continue
        model(torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.float() for k, v in model.state_dict().items()}


def policy_run(rank: int, world: int, stage: int, bad_steps: set[int], cfg_extra: dict,
               dtype: str = "fp32", steps: int = oracle.STEPS) -> dict:
    """gas 1, stage `stage`; the last rank's input is nan at `bad_steps`. Records a NonFiniteError."""
    case = oracle.CASES["plain"]
    model = oracle.build(case)
    cfg = oracle.config_for(oracle.Case(gas=1), stage, world, dtype)
    for key, value in cfg_extra.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    engine = zerodp.initialize(model, case.optimizer(model), cfg)
    sl = slice(rank * oracle.MICRO, (rank + 1) * oracle.MICRO)
    error, raised_at = None, None
    with logs.captured("zerodp") as lines:
        for step in range(steps):
            x, y = oracle.batches(world, 1, seed=step)[0][0]
            x = x[sl].clone()
            if step in bad_steps and rank == world - 1:
                x[0, 0] = float("nan")
            engine.backward(engine(x, y[sl]))
            try:
                engine.step()
            except zerodp.NonFiniteError as e:
                error, raised_at = str(e), engine.global_steps
                break
    return {"error": error, "raised_at": raised_at, "skipped": engine.skipped_steps, "log": lines,
            "masters_finite": all(bool(torch.isfinite(m).all()) for m in inside(engine).training.partitioned_optimizer.masters)}


def checkpoint_guard(rank: int, world: int) -> dict:
    """One step, then a nan written into the last rank's master: save_checkpoint must refuse."""
    case = oracle.CASES["plain"]
    model = oracle.build(case)
    engine = zerodp.initialize(model, case.optimizer(model), oracle.config_for(oracle.Case(gas=1), 2, world))
    x, y = oracle.batches(world, 1)[0][0]
    engine.backward(engine(x[:oracle.MICRO], y[:oracle.MICRO]))
    engine.step()
    from zerodp.checkpoint.pieces import owned_pieces
    if rank == world - 1:
        piece = owned_pieces(engine)[0]
        inside(engine).training.partitioned_optimizer.masters[piece.master][piece.offset] = float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            engine.save_checkpoint(tmp)
            error = None
        except CheckpointError as e:
            error = str(e)
        written = os.listdir(tmp)
    expected = f"'{piece.name}' element {piece.start}" if rank == world - 1 else None
    return {"error": error, "written": written, "expected": expected}


def _run_job(rank: int, world: int, job: tuple):
    kind = job[0]
    if kind == "bad":
        return train_with_bad_step(rank, world, *job[1:])
    if kind == "clean":
        return train_with_bad_step(rank, world, job[1], job[2], None)
    if kind == "raise":  # the last rank's loss is nan at steps 1 and 2: raise at global step 3
        return policy_run(rank, world, job[1], {1, 2}, {"non_finite": {"max_consecutive_skips": 2}})
    if kind == "skip_policy":
        return policy_run(rank, world, 2, set(range(oracle.STEPS)),
                          {"non_finite": {"policy": "skip", "max_consecutive_skips": 1}})
    if kind == "reset":
        return policy_run(rank, world, 2, {0, 2, 4}, {"non_finite": {"max_consecutive_skips": 2}})
    if kind == "fp16_min_scale":  # every step overflows: 2^24 and 2^23 are routine, 2^22 is the floor
        return policy_run(rank, world, 2, set(), {"fp16": {"initial_scale_power": 24, "hysteresis": 1,
                                                           "min_loss_scale": 2.0 ** 22},
                                                  "non_finite": {"max_consecutive_skips": 2}}, "fp16", steps=8)
    if kind == "fp16_static":
        return policy_run(rank, world, 2, set(), {"fp16": {"loss_scale": 2.0 ** 24},
                                                  "non_finite": {"max_consecutive_skips": 2}}, "fp16")
    return checkpoint_guard(rank, world)


def _run_jobs(rank: int, world: int, jobs: list[tuple]) -> dict:
    return {job: _run_job(rank, world, job) for job in jobs}


@functools.cache
def all_ranks(world: int) -> list[dict]:
    """Every run of one world size, in one set of spawned ranks."""
    return run_ranks(_run_jobs, world, BAD_JOBS + OFFLOAD_JOBS + DETACHED_JOBS + CLEAN_JOBS + POLICY_JOBS)


@functools.cache
def reference(world: int) -> dict:
    return reference_without_bad_step(world)


def _assert_same(a: list, b: list, what: str) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"{what} changed across the skipped step"


def _expected_rank(stage: int, world: int) -> str:
    return f"rank {world - 1}"


world_param = pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world={w}")
stage_param = pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage={s}")


@world_param
@stage_param
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_or_inf_loss_on_one_rank_skips_the_step_everywhere_and_says_so_once(kind, dtype, stage, world):
    _assert_skipped_everywhere_and_said_once(all_ranks(world), ("bad", stage, dtype, kind, False), stage, world)


@world_param
@stage_param
def test_inf_loss_with_finite_gradients_on_one_rank_is_skipped_everywhere_and_said(stage, world):
    # A non-finite term that carries no gradient (loss + a detached inf): the norm is finite, the
    # step must still be skipped on every rank, and training equals the oracle without that step.
    job = ("bad", stage, "fp32", "detached", False)
    _assert_skipped_everywhere_and_said_once(all_ranks(world), job, stage, world)
    run = all_ranks(world)[0][job]
    for name, ref in reference(world).items():
        torch.testing.assert_close(run["state"][name], ref, rtol=1e-6, atol=1e-6, msg=name)


def _assert_skipped_everywhere_and_said_once(ranks_runs: list[dict], job: tuple, stage: int, world: int) -> None:
    for rank, ranks in enumerate(ranks_runs):
        run = ranks[job]
        before, after = run["before"], run["after"]
        assert (before["skipped"], after["skipped"], run["skipped"]) == (0, 1, 1)
        assert after["steps"] == BAD + 1, "a skipped step still counts as a global step"
        _assert_same(before["master"], after["master"], "an fp32 master")
        _assert_same(before["working"], after["working"], "a working parameter")
        for sa, sb in zip(before["state"], after["state"]):
            _assert_same(list(sa.values()), list(sb.values()), "optimizer state")
        assert before["lr"] == after["lr"], "the lr scheduler must not step on a skipped step"
        assert after["grads_freed"], "the skipped step's gradients must be freed"
        if rank > 0:
            assert run["log"] == [], "only rank 0 logs"
            continue
        assert len(run["log"]) == 1, run["log"]
        level, line = run["log"][0]
        assert line.startswith(f"step {BAD + 1} skipped")
        assert f"loss non-finite on {_expected_rank(stage, world)}" in line
        assert level == "WARNING", "a non-finite loss is no routine fp16 overflow"


@world_param
@stage_param
@pytest.mark.parametrize("kind", KINDS)
def test_fp32_training_after_a_skipped_step_matches_the_oracle_without_that_step(kind, stage, world):
    run = all_ranks(world)[0][("bad", stage, "fp32", kind, False)]
    assert run["steps"] == oracle.STEPS
    for name, ref in reference(world).items():
        torch.testing.assert_close(run["state"][name], ref, rtol=1e-6, atol=1e-6, msg=name)


@world_param
@pytest.mark.parametrize("stage", OFFLOAD_STAGES, ids=lambda s: f"stage={s}")
def test_offload_skips_the_step_and_matches_the_oracle_without_it(stage, world):
    run = all_ranks(world)[0][("bad", stage, "fp32", "nan", True)]
    assert run["skipped"] == 1
    _assert_same(run["before"]["master"], run["after"]["master"], "an offloaded master")
    for name, ref in reference(world).items():
        torch.testing.assert_close(run["state"][name], ref, rtol=1e-6, atol=1e-6, msg=name)


@world_param
@stage_param
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_after_a_skipped_step_equals_the_run_that_never_saw_that_batch(kind, dtype, stage, world):
    runs = all_ranks(world)[0]
    bad, clean = runs[("bad", stage, dtype, kind, False)], runs[("clean", stage, dtype)]
    assert bad["steps"] == clean["steps"] + 1
    # A skipped step changes nothing the later steps read (fp16: the scale stays 2^8, as hysteresis
    # 2 only spends one of its two overflows), so the two runs do the same arithmetic: bit-equal,
    # well inside test_engine's bf16/fp16 tolerances.
    for name, value in clean["state"].items():
        assert torch.equal(bad["state"][name], value), name


@world_param
@stage_param
def test_raise_policy_raises_on_every_rank_after_k_consecutive_skips(stage, world):
    for rank, ranks in enumerate(all_ranks(world)):
        run = ranks[("raise", stage)]
        assert run["raised_at"] == 3 and run["skipped"] == 2, "raised at the 2nd skip in a row, not before"
        assert run["masters_finite"]
        msg = run["error"]
        assert "2 steps in a row (the last: step 3)" in msg and "max_consecutive_skips = 2" in msg
        assert f"the loss was non-finite on {_expected_rank(stage, world)}" in msg
        assert "learning rate" in msg and "bf16" in msg and "gradient_clipping" in msg


@world_param
def test_skip_policy_never_raises(world):
    for ranks in all_ranks(world):
        run = ranks[("skip_policy",)]
        assert run["error"] is None and run["skipped"] == oracle.STEPS and run["masters_finite"]


@world_param
def test_a_finite_step_resets_the_consecutive_count(world):
    for ranks in all_ranks(world):
        run = ranks[("reset",)]  # bad, good, bad, good, bad with max 2 in a row
        assert run["error"] is None and run["skipped"] == 3
    counts = [m.split("(")[-1] for level, m in all_ranks(world)[0][("reset",)]["log"]]
    assert all(c.startswith("1 in a row") for c in counts), counts


@world_param
def test_fp16_overflows_count_only_once_the_loss_scale_is_at_its_minimum(world):
    for rank, ranks in enumerate(all_ranks(world)):
        run = ranks[("fp16_min_scale",)]
        # 2^24 and 2^23 overflow routinely (halved each time); at 2^22 = min_loss_scale they count.
        assert run["raised_at"] == 4 and run["skipped"] == 4, run
        assert "the loss was non-finite on no rank" in run["error"]
        if rank == 0:
            assert [level for level, _ in run["log"]] == ["INFO", "INFO", "WARNING", "WARNING"]
            assert "not counted" in run["log"][0][1] and "loss scale 16777216 -> 8388608" in run["log"][0][1]


@world_param
def test_fp16_static_loss_scale_overflows_count(world):
    for ranks in all_ranks(world):
        run = ranks[("fp16_static",)]
        assert run["raised_at"] == 2 and run["skipped"] == 2


@world_param
def test_checkpoint_with_a_non_finite_master_is_refused_on_every_rank(world):
    results = [ranks[("guard",)] for ranks in all_ranks(world)]
    expected = results[-1]["expected"]
    for r in results:
        assert r["error"] is not None and "non-finite" in r["error"]
        assert expected in r["error"] and f"rank {world - 1}'s" in r["error"], r["error"]
        assert r["written"] == [], "nothing may be written"


def test_non_finite_config_keys_are_strict():
    assert load_config({}).non_finite.policy == "raise"
    assert load_config({}).non_finite.max_consecutive_skips == 3
    cfg = load_config({"non_finite": {"policy": "skip", "max_consecutive_skips": 5}})
    assert (cfg.non_finite.policy, cfg.non_finite.max_consecutive_skips) == ("skip", 5)
    for bad, key in [({"max_consecutive_skips": "3"}, "max_consecutive_skips"),
                     ({"max_consecutive_skips": True}, "max_consecutive_skips"),
                     ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
                     ({"policy": "Skip"}, "policy"), ({"polcy": "skip"}, "polcy")]:
        with pytest.raises(zerodp.ConfigError, match=f"non_finite.{key}"):
            load_config({"non_finite": bad})


def test_train_job_stops_with_one_line_and_writes_no_non_finite_checkpoint(tmp_path):
    """lr 1e30: step 1 blows the weights up to ~1e30, every later loss is nan; 3 skips in a row end it."""
    from test_train import TINY, corpus, train

    out = tmp_path / "run"
    proc = train(*TINY, "--steps", "6", "--save-every", "1", "--eval-every", "100", "--nproc", "2",
                 "--warmup", "0", "--lr", "1e30", "--dtype", "fp32", "--data", corpus(tmp_path),
                 "--out", str(out), check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    stopped = [line for line in proc.stderr.splitlines() if "zerodp train: stopped" in line]
    assert len(stopped) == 1 and "3 steps in a row (the last: step 4)" in stopped[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "failed (exit code" not in proc.stderr
    assert not (out / "final.pt").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step3"
    meta = json.loads((out / "checkpoints" / "global_step3" / "zerodp.json").read_text())
    assert meta["counters"]["skipped_steps"] == 2  # steps 2 and 3: skipped, saved, weights unchanged
