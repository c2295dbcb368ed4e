"""DeepSpeed's `scheduler` section: its five learning-rate schedules, with DeepSpeed's formulas.

Each `*_lr(p, i)` below is DeepSpeed's `get_lr()` at `last_batch_iteration = i`
(deepspeed/runtime/lr_schedules.py), i = -1 being the value its constructor writes into the optimizer.
DeepSpeed's engine steps the scheduler after each optimizer step that is not skipped, so its optimizer
step t (t steps already taken) runs at get_lr(t - 1). zerodp does the same: its optimizer step t runs
at `*_lr(p, t - 1)`, so a DeepSpeed config gives the same lr at every step, hence the same training.
(For WarmupLR/WarmupDecayLR the warmup's first value is therefore used twice: get_lr(-1) = get_lr(0).)
tests/test_schedules.py holds lrs produced by DeepSpeed's own classes for several parameter sets.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Callable, Literal

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

from zerodp.config.base import (
    ConfigError,
    NonNegativeInt,
    PositiveInt,
    _format_errors,
    _Section,
)

Rate = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class WarmupLRParams(_Section):
    warmup_min_lr: Rate = 0.0
    warmup_max_lr: Annotated[float, Field(gt=0)] | None = None  # None: each param group's own lr
    warmup_num_steps: PositiveInt = 1000
    warmup_type: Literal["log", "linear"] = "log"


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: PositiveInt
    warmup_max_lr: Annotated[float, Field(gt=0)] | None = 0.001


class WarmupCosineLRParams(_Section):
    total_num_steps: PositiveInt
    warmup_min_ratio: Rate = 0.0
    warmup_num_steps: PositiveInt = 1000
    cos_min_ratio: Rate = 0.0001
    warmup_type: Literal["log", "linear"] = "log"


class LRRangeTestParams(_Section):
    lr_range_test_min_lr: Annotated[float, Field(gt=0)] = 0.001
    lr_range_test_step_size: PositiveInt = 2000
    lr_range_test_step_rate: Rate = 1.0
    lr_range_test_staircase: bool = False


class OneCycleParams(_Section):
    cycle_min_lr: Rate
    cycle_max_lr: Annotated[float, Field(gt=0)]
    decay_lr_rate: Rate = 0.0
    cycle_first_step_size: PositiveInt = 2000
    cycle_second_step_size: NonNegativeInt | None = None  # None: the first's
    cycle_first_stair_count: NonNegativeInt = 0
    cycle_second_stair_count: NonNegativeInt | None = None  # None: the first's
    decay_step_size: NonNegativeInt = 0
    # Momentum cycling sets Adam's first beta (group "betas"), and, as DeepSpeed, its second to 0.99.
    cycle_momentum: bool = True
    cycle_min_mom: Annotated[float, Field(ge=0, lt=1)] = 0.8
    cycle_max_mom: Annotated[float, Field(ge=0, lt=1)] = 0.9
    decay_mom_rate: Rate = 0.0


PARAMS: dict[str, type[_Section]] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams, "WarmupCosineLR": WarmupCosineLRParams,
    "LRRangeTest": LRRangeTestParams, "OneCycle": OneCycleParams}


# ---- DeepSpeed's formulas, at last_batch_iteration i ----------------------------------------------
def _warmup_gamma(i: int, warmup: int, kind: str) -> float:
    """Fraction of the warmup done (1.0 after it); `warmup` already floored at 2 as DeepSpeed does."""
    if i >= warmup:
        return 1.0
    return math.log(i + 1) / math.log(warmup) if kind == "log" else i / warmup


def warmup_lr(p: WarmupLRParams, i: int, max_lr: float) -> float:
    if i < 0:
        return p.warmup_min_lr
    warmup = max(2, p.warmup_num_steps)
    gamma = _warmup_gamma(i, warmup, p.warmup_type)
    total = getattr(p, "total_num_steps", None)  # WarmupDecayLR: linear decay to 0 at total_num_steps
    if total is not None and i >= warmup:
        gamma = max(0.0, (total - i) / max(1, total - warmup))
    return p.warmup_min_lr + (max_lr - p.warmup_min_lr) * gamma


def warmup_cosine_ratio(p: WarmupCosineLRParams, i: int) -> float:
    """A fraction of each param group's own lr."""
    if i < 0:
        return 0.0
    warmup = max(2, p.warmup_num_steps)
    if i < warmup:
        return p.warmup_min_ratio + (1.0 - p.warmup_min_ratio) * _warmup_gamma(i, warmup, p.warmup_type)
    progress = min(1.0, (i - warmup + 1) / max(1, p.total_num_steps - warmup))  # held at the end
    return max(0.0, p.cos_min_ratio + (1.0 - p.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def lr_range_test_lr(p: LRRangeTestParams, i: int) -> float:
    interval = (i + 1) / p.lr_range_test_step_size
    if p.lr_range_test_staircase:
        interval = math.floor(interval)
    return p.lr_range_test_min_lr * (1 + p.lr_range_test_step_rate * interval)


def _one_cycle_scale(p: OneCycleParams, i: int) -> float:
    """Where in the cycle batch i + 1 is: 0 at the cycle's ends, 1 at its peak (DeepSpeed's stairs too)."""
    first = float(p.cycle_first_step_size)
    second = first if p.cycle_second_step_size is None else float(p.cycle_second_step_size)
    total, batch = first + second, i + 1
    ratio = first / total
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    if x <= ratio:
        scale, stairs = x / ratio, p.cycle_first_stair_count
    else:
        scale = (x - 1) / (ratio - 1)
        stairs = p.cycle_first_stair_count if p.cycle_second_stair_count is None else p.cycle_second_stair_count
    if stairs > 0:
        at = batch % total
        position = at * stairs / first if at <= first else (total - at) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def _one_cycle_total(p: OneCycleParams) -> float:
    first = float(p.cycle_first_step_size)
    return first + (first if p.cycle_second_step_size is None else float(p.cycle_second_step_size))


def one_cycle_lr(p: OneCycleParams, i: int) -> float:
    total = _one_cycle_total(p)
    if i < total:
        return p.cycle_min_lr + (p.cycle_max_lr - p.cycle_min_lr) * _one_cycle_scale(p, i)
    if p.decay_step_size == 0 or p.decay_lr_rate == 0:
        return p.cycle_min_lr
    return p.cycle_min_lr / (1 + p.decay_lr_rate * (i - total + 1) / p.decay_step_size)


def one_cycle_momentum(p: OneCycleParams, i: int) -> float:
    """The first Adam beta; DeepSpeed's constructor starts it at cycle_min_mom."""
    if i < 0:
        return p.cycle_min_mom
    total = _one_cycle_total(p)
    if i < total:
        return p.cycle_max_mom - (p.cycle_max_mom - p.cycle_min_mom) * _one_cycle_scale(p, i)
    if p.decay_step_size == 0 or p.decay_mom_rate == 0:
        return p.cycle_max_mom
    return p.cycle_max_mom * (1 + p.decay_mom_rate * (i - total + 1) / p.decay_step_size)


# ---- the scheduler ---------------------------------------------------------------------------------
class DeepSpeedSchedule(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR (its usual state dict) that can also set each group's Adam betas (OneCycle)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambdas: list[Callable[[int], float]],
                 betas_at: Callable[[int], tuple[float, float]] | None = None):
        self.betas_at = betas_at  # before LambdaLR's constructor, which takes the first step
        super().__init__(optimizer, lr_lambdas)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.betas_at is not None:
            for group in self.optimizer.param_groups:
                group["betas"] = self.betas_at(self.last_epoch)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("betas_at", None)  # a function, rebuilt from the config
        return state


class SchedulerConfig(_Section):
    """DeepSpeed's `scheduler` section; see the module docstring for how steps line up."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        by_lower = {k.lower(): k for k in PARAMS}
        if name.lower() not in by_lower:
            raise ValueError(f"supported schedulers are {', '.join(PARAMS)}")
        return by_lower[name.lower()]

    @model_validator(mode="after")
    def _params_fit(self) -> SchedulerConfig:
        self._parsed_params()
        return self

    def _parsed_params(self) -> Any:
        try:
            p = PARAMS[self.type].model_validate(self.params)
        except ValidationError as e:
            raise ConfigError(_format_errors(e, PARAMS[self.type], "scheduler.params")) from None
        total = getattr(p, "total_num_steps", None)  # WarmupLR has no end
        if total is not None and total <= p.warmup_num_steps:
            raise ConfigError(f"config key 'scheduler.params.total_num_steps' = {total}: "
                              f"expected more than warmup_num_steps = {p.warmup_num_steps}")
        if isinstance(p, OneCycleParams) and p.cycle_max_lr < p.cycle_min_lr:
            raise ConfigError(f"config key 'scheduler.params.cycle_max_lr' = {p.cycle_max_lr}: expected at "
                              f"least cycle_min_lr = {p.cycle_min_lr}")
        return p

    def build(self, optimizer: torch.optim.Optimizer) -> DeepSpeedSchedule:
        """The schedule on `optimizer`: its step t runs at DeepSpeed's get_lr(t - 1)."""
        p = self._parsed_params()
        groups = optimizer.param_groups
        if isinstance(p, WarmupCosineLRParams):  # a ratio of each group's own lr
            return DeepSpeedSchedule(optimizer, [lambda t: warmup_cosine_ratio(p, t - 1)] * len(groups))
        if isinstance(p, WarmupLRParams):
            peaks = [p.warmup_max_lr if p.warmup_max_lr is not None else g["lr"] for g in groups]
            absolute = [lambda i, peak=peak: warmup_lr(p, i, peak) for peak in peaks]
        elif isinstance(p, LRRangeTestParams):
            peaks, absolute = [p.lr_range_test_min_lr] * len(groups), [lambda i: lr_range_test_lr(p, i)] * len(groups)
        else:
            peaks, absolute = [p.cycle_max_lr] * len(groups), [lambda i: one_cycle_lr(p, i)] * len(groups)
        betas_at = None
        if isinstance(p, OneCycleParams) and p.cycle_momentum:
            if any("betas" not in g for g in groups):
                raise ConfigError(f"config key 'scheduler.params.cycle_momentum' = true cycles Adam's betas, and "
                                  f"{type(optimizer).__name__} has none; set cycle_momentum to false")
            betas_at = lambda t: (one_cycle_momentum(p, t - 1), 0.99)  # noqa: E731 - DeepSpeed's 0.99
        # Absolute lrs: each group's base lr is pinned to a reference (the peak) and the schedule is a
        # ratio of it, so the state dict stays LambdaLR's usual one.
        lambdas = []
        for group, peak, f in zip(groups, peaks, absolute):
            base = peak if peak > 0 else 1.0
            group["lr"] = group["initial_lr"] = base
            lambdas.append(lambda t, f=f, base=base: f(t - 1) / base)
        return DeepSpeedSchedule(optimizer, lambdas, betas_at)
