"""What training reports (zerodp.monitor): the steps_per_print line, wall_clock_breakdown, the
monitors (CSV, TensorBoard, W&B) and the comms logger, and that none of it changes training or
adds a collective. World of one in-process, plus one spawn at world 2."""

from __future__ import annotations

import csv
import importlib.util
import logging
import re

import pytest
import torch

import zerodp
from zerodp.engine.engine import inside
from oracle import Toy, one_group

CFG = {"train_micro_batch_size_per_gpu": 3}


def train(config: dict, steps: int = 4, stage: int = 2, seed: int = 0, gas: int = 1):
    torch.manual_seed(seed)
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), {**CFG, **config, "gradient_accumulation_steps": gas,
                                                         "zero_optimization": {"stage": stage}})
    losses = []
    for _ in range(steps):
        for _ in range(gas):
            loss = engine(torch.randn(3, 13), torch.randn(3, 5))
            engine.backward(loss)
            losses.append(loss.item())
            engine.step()
    return engine, losses


def step_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zerodp" and r.getMessage().startswith("zerodp step")]


def test_steps_per_print_logs_one_line_every_n_steps_with_the_steps_numbers(caplog):
    caplog.set_level(logging.INFO, logger="zerodp")
    engine, losses = train({"steps_per_print": 2}, steps=4, gas=2)
    lines = step_lines(caplog)
    assert [int(re.match(r"zerodp step (\d+):", x).group(1)) for x in lines] == [2, 4]
    last = lines[-1]
    # loss: rank 0's mean over the step's micro-batches, as given to backward
    assert float(re.search(r"loss (\S+)", last).group(1)) == pytest.approx(sum(losses[-2:]) / 2, abs=1e-4)
    assert float(re.search(r"grad_norm (\S+)", last).group(1)) == pytest.approx(engine.grad_norm, rel=1e-3)
    assert float(re.search(r" lr (\S+)", last).group(1)) == pytest.approx(engine.get_lr()[0])
    assert "loss_scale 1 skipped 0" in last
    assert float(re.search(r"samples/s (\S+)", last).group(1)) > 0
    assert "tokens/s" not in last  # float inputs are not token ids
    assert re.search(r"memory \S+ GiB peak RSS", last)
    assert "| ms:" not in last  # no wall_clock_breakdown asked for


def test_no_step_lines_by_default_as_deepspeed(caplog):
    caplog.set_level(logging.INFO, logger="zerodp")
    train({}, steps=2)
    assert step_lines(caplog) == []


def test_tokens_per_second_counts_integer_first_inputs():
    from zerodp.config import load_config
    from zerodp.monitor.step import StepMonitor

    class Comm:
        rank, world_size = 0, 2
    Comm.everyone = Comm  # no tensor parallelism: the world is this group
    mon = StepMonitor(load_config(CFG), Comm(), torch.device("cpu"))
    mon.saw_inputs((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16)))
    mon.saw_inputs((torch.zeros(4, 16, dtype=torch.long),))
    assert (mon.window_samples, mon.tokens) == (8, 128)


@pytest.mark.parametrize("stage", [1, 3])
def test_wall_clock_breakdown_times_every_phase_of_the_last_step(stage, caplog):
    caplog.set_level(logging.INFO, logger="zerodp")
    engine, _ = train({"wall_clock_breakdown": True, "steps_per_print": 1}, steps=2, stage=stage)
    t = zerodp.step_timings(engine)
    assert set(t) == {"forward", "backward", "reduce_wait", "step", "gather", "exposed_comm"}
    assert t["forward"] > 0 and t["backward"] > 0 and t["step"] > 0 and t["gather"] > 0
    assert all(v >= 0 for v in t.values())
    assert re.search(r"\| ms: forward \S+ backward \S+ reduce_wait \S+ step \S+ gather \S+ exposed_comm \S+",
                     step_lines(caplog)[-1])
    assert t["exposed_comm"] == 0  # a world of one: no collective has anything to wait for


def _late_peer(rank: int, world: int, late_s: float) -> list[float]:
    """Stage 2, two steps; in the second, rank 1 starts its backward `late_s` after rank 0."""
    import time
    engine, _ = train({"wall_clock_breakdown": True}, steps=0)
    exposed = []
    for i in range(2):
        loss = engine(torch.randn(3, 13), torch.randn(3, 5))
        if rank == 1 and i == 1:
            time.sleep(late_s)
        engine.backward(loss)
        engine.step()
        exposed.append(zerodp.step_timings(engine)["exposed_comm"])
    return exposed


def test_exposed_comm_is_the_time_a_rank_waits_in_collectives_for_a_late_peer():
    """Rank 1 starts its backward a second late: rank 0's step holds most of that second as exposed communication,
    waiting in the gradient reduction (a bound from below, with room for rank 0 itself being descheduled up to
    half a second on a loaded machine before it reaches the reduction)."""
    from spawn import run_ranks

    (first, waited), _ = run_ranks(_late_peer, 2, 1.0)
    assert waited >= 500, (first, waited)


def test_the_optimizer_and_stage3_gatherer_share_one_gather_timing_protocol():
    from zerodp.engine.stepping.optimizer import PartitionedOptimizer
    from zerodp.engine.sharding.gather import Gatherer
    from zerodp.monitor.timers import TimedGathers

    for cls in (PartitionedOptimizer, Gatherer):
        assert issubclass(cls, TimedGathers) and "time_gathers" not in vars(cls), cls


def test_timings_are_empty_without_wall_clock_breakdown():
    engine, _ = train({}, steps=1)
    assert zerodp.step_timings(engine) == {}


def test_monitoring_changes_no_result_and_adds_no_collective(tmp_path):
    plain, plain_losses = train({}, steps=3)
    watched, watched_losses = train({"steps_per_print": 1, "wall_clock_breakdown": True,
                                     "csv_monitor": {"enabled": True, "output_path": str(tmp_path)},
                                     "comms_logger": {"enabled": True}}, steps=3)
    assert watched_losses == plain_losses
    assert inside(watched).comm.traffic.calls == inside(plain).comm.traffic.calls


def test_csv_monitor_writes_one_file_per_event_in_deepspeeds_layout(tmp_path):
    engine, losses = train({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
                            "wall_clock_breakdown": True}, steps=3)
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"Train_Samples_train_loss.csv", "Train_Samples_lr.csv", "Train_Samples_loss_scale.csv",
            "Train_Samples_grad_norm.csv", "Train_Samples_elapsed_time_ms_forward.csv"} <= files
    rows = list(csv.reader(open(tmp_path / "run" / "Train_Samples_train_loss.csv")))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [3, 6, 9]  # samples seen, DeepSpeed's x axis
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, abs=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_monitor_writes_scalars_tensorboard_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, losses = train({"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}, steps=2)
    inside(engine).training.monitor.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = acc.Scalars("Train/Samples/train_loss")
    assert [s.step for s in scalars] == [3, 6]
    assert [s.value for s in scalars] == pytest.approx(losses, abs=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_enabled_without_the_package_is_refused_at_initialize():
    with pytest.raises(ImportError, match=r"'wandb.enabled' = true needs the wandb package: pip install wandb"):
        train({"wandb": {"enabled": True}}, steps=0)


@pytest.mark.parametrize("section, words", [
    ("comet", "no Comet monitor; use 'tensorboard', 'csv_monitor' or 'wandb'"),
    ("flops_profiler", "no flops profiler; count a step's FLOPs with PyTorch's own"),
])
def test_sections_zerodp_does_not_implement_are_refused_when_enabled(section, words):
    message = f"config key '{section}.enabled' = true: zerodp has {words}"
    with pytest.raises(zerodp.ConfigError, match=re.escape(message)):
        train({section: {"enabled": True}}, steps=0)
    train({section: {"enabled": False}}, steps=0)  # accepted when off, as in DeepSpeed configs


def test_comms_logger_prof_ops_records_only_the_named_collectives(caplog):
    caplog.set_level(logging.INFO, logger="zerodp")
    engine, _ = train({"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_gather"],
                                        "verbose": True, "debug": True}, "steps_per_print": 2}, steps=2)
    lines = [r.getMessage() for r in caplog.records]
    assert any(x.startswith("zerodp comm: all_gather | all_gather") for x in lines)  # verbose, with caller
    assert not any("reduce_scatter" in x for x in lines)
    assert "| comms: all_gather | all_gather 2 calls" in step_lines(caplog)[-1]


def test_comms_logger_rejects_a_collective_zerodp_does_not_issue():
    with pytest.raises(zerodp.ConfigError, match=r"comms_logger.prof_ops.*unknown collective\(s\) \['alltoall'\]"):
        train({"comms_logger": {"enabled": True, "prof_ops": ["alltoall"]}}, steps=0)


def test_only_rank_0_writes_monitors_and_lines(tmp_path, caplog):
    from zerodp.config import load_config
    from zerodp.monitor.step import StepMonitor

    class Rank1:
        rank, world_size = 1, 2
    Rank1.everyone = Rank1
    caplog.set_level(logging.INFO, logger="zerodp")
    config = load_config({**CFG, "steps_per_print": 1, "csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    mon = StepMonitor(config, Rank1(), torch.device("cpu"))
    mon.after_step(1, torch.tensor(1.0), 1, torch.tensor(2.0), 1e-3, 1.0, 0)
    assert mon.monitors == [] and step_lines(caplog) == [] and not any(tmp_path.iterdir())


def test_comms_logger_counts_every_collective_with_its_message_size(caplog):
    caplog.set_level(logging.INFO, logger="zerodp")
    engine, _ = train({"comms_logger": {"enabled": True}, "steps_per_print": 1000}, steps=1, stage=2)
    stats = {k: (v.calls, v.bytes) for k, v in inside(engine).training.monitor.comms.summary().items()}
    # one step of stage 2: the gradient bucket's reduce_scatter, the norm's all_reduce (with the two
    # non-finite flags and one used bit per parameter tensor: fp64 values), the parameters' all_gather;
    # sizes are the whole fp32 bucket
    full = sum(b.numel * 4 for g in inside(engine).layout.groups for b in g.buckets)
    tensors = sum(len(b.slots) for g in inside(engine).layout.groups for b in g.buckets)
    assert stats == {"all_gather": (1, full), "all_reduce": (1, 24 + 8 * tensors), "reduce_scatter": (1, full)}
    assert {k: c for k, (c, _) in stats.items()} == dict(inside(engine).comm.traffic.calls)


def test_deferred_reading_as_on_gpus_reports_each_step_once_one_step_late(caplog):
    """On a GPU a step's values are read after the next step's own sync; forced here on the CPU."""
    caplog.set_level(logging.INFO, logger="zerodp")
    engine, losses = train({"steps_per_print": 1, "wall_clock_breakdown": True}, steps=0)
    inside(engine).training.monitor.defer = True
    for i in range(3):
        loss = engine(torch.randn(3, 13), torch.randn(3, 5))
        engine.backward(loss)
        engine.step()
        assert len(step_lines(caplog)) == i  # step i+1's line waits for step i+2
    assert zerodp.step_timings(engine)["forward"] > 0  # timings() reads the last step
    assert [int(re.match(r"zerodp step (\d+):", x).group(1)) for x in step_lines(caplog)] == [1, 2, 3]


def test_wandb_monitor_starts_a_run_with_the_configs_names_and_logs_each_event(monkeypatch):
    import importlib.machinery
    import sys
    import types
    calls = []
    stub = types.ModuleType("wandb")
    stub.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    stub.init = lambda **kw: calls.append(("init", kw))
    stub.log = lambda values, step: calls.append(("log", values, step))
    monkeypatch.setitem(sys.modules, "wandb", stub)
    engine, losses = train({"wandb": {"enabled": True, "project": "p", "group": "g", "team": "t"}}, steps=1)
    assert calls[0] == ("init", {"project": "p", "group": "g", "entity": "t"})
    assert ("log", {"Train/Samples/train_loss": pytest.approx(losses[0])}, 3) in calls
