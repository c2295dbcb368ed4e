"""Specification of the scheduler section: DeepSpeed's five lr schedules, step for step.

tests/data/deepspeed_schedules.json holds the lr (and Adam betas) that DeepSpeed's own scheduler classes
give the optimizer at each step, read before each optimizer step with scheduler.step() after it, as
DeepSpeed's engine does (made by tests/data/make_deepspeed_schedules.py; DeepSpeed is not needed here).
zerodp's optimizer step t must run at exactly that lr: DeepSpeed's get_lr(t - 1).
"""

import json
from pathlib import Path

import pytest
import torch

from zerodp.config import ConfigError, SchedulerConfig, load_config

REFERENCE = json.loads((Path(__file__).parent / "data" / "deepspeed_schedules.json").read_text())
CASES = REFERENCE["cases"]


def run(case: dict) -> tuple[list[float], list[list[float]]]:
    p = torch.nn.Parameter(torch.zeros(2))
    make = torch.optim.SGD if case["optimizer"] == "SGD" else torch.optim.AdamW
    optimizer = make([p], lr=case["optimizer_lr"])
    scheduler = SchedulerConfig.model_validate({"type": case["type"], "params": case["params"]}).build(optimizer)
    lrs, betas = [], []
    for _ in range(len(case["lrs"])):
        lrs.append(optimizer.param_groups[0]["lr"])
        betas.append(list(optimizer.param_groups[0].get("betas", ())))
        p.grad = torch.zeros(2)
        optimizer.step()
        scheduler.step()
    return lrs, betas


@pytest.mark.parametrize("case", CASES, ids=[f"{c['type']}-{i}" for i, c in enumerate(CASES)])
def test_lr_at_every_step_is_deepspeeds(case):
    lrs, betas = run(case)
    assert lrs == pytest.approx(case["lrs"], rel=1e-12, abs=1e-15)
    if case["betas"] is not None:  # OneCycle's momentum cycling: the first beta, the second set to 0.99
        assert sum(betas, []) == pytest.approx(sum(case["betas"], []), rel=1e-12)


def test_every_schedule_type_is_in_the_reference():
    assert {c["type"] for c in CASES} == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest", "OneCycle"}


def test_one_cycle_momentum_needs_an_optimizer_with_betas():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    config = SchedulerConfig(type="OneCycle", params={"cycle_min_lr": 0.001, "cycle_max_lr": 0.01})
    with pytest.raises(ConfigError, match=r"'scheduler.params.cycle_momentum' = true .* set cycle_momentum to false"):
        config.build(optimizer)


def test_one_cycle_needs_max_at_least_min():
    with pytest.raises(ConfigError, match=r"'scheduler.params.cycle_max_lr' = 0.001: expected at least cycle_min_lr"):
        load_config({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.001}}})


def test_schedule_state_is_plain_data_and_resumes_the_sequence():
    case = next(c for c in CASES if c["type"] == "OneCycle" and c["betas"])
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([p], lr=0.2)
    config = SchedulerConfig.model_validate({"type": case["type"], "params": case["params"]})
    scheduler = config.build(optimizer)
    p.grad = torch.zeros(2)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    state = json.loads(json.dumps(scheduler.state_dict()))  # no function in it (checkpoints hold JSON)
    resumed = config.build(torch.optim.AdamW([p], lr=0.2))
    resumed.load_state_dict(state)
    resumed.optimizer.step()
    resumed.step()
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(case["lrs"][6], rel=1e-12)
    assert list(resumed.optimizer.param_groups[0]["betas"]) == pytest.approx(case["betas"][6], rel=1e-12)
