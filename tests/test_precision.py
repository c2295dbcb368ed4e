"""Specification of the fp16 dynamic loss scale: DeepSpeed's rule, key by key.

The scale sequences below are what DeepSpeed's own DynamicLossScaler (deepspeed.runtime.fp16.loss_scaler,
DeepSpeed 0.19.8) gives for the same overflow pattern and settings, one update_scale(overflow) per step
(init_scale = 2 ** initial_scale_power, delayed_shift = hysteresis, scale_window = loss_scale_window).
"""

import pytest

from zerodp.config import load_config
from zerodp.engine.stepping.precision import LossScaler

PATTERN = [1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0]  # 1: the step overflowed


@pytest.mark.parametrize("fp16, deepspeed_scales", [
    ({"initial_scale_power": 4, "loss_scale_window": 3, "min_loss_scale": 2, "hysteresis": 2},
     [16, 16, 8, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2]),
    ({"initial_scale_power": 5, "loss_scale_window": 2, "min_loss_scale": 1, "hysteresis": 3,
      "consecutive_hysteresis": True},
     [32, 32, 32, 32, 32, 32, 64, 64, 64, 32, 32, 32, 64, 64, 128, 128, 128, 128, 128, 64, 32, 16, 16, 16]),
])
def test_dynamic_loss_scale_follows_deepspeeds_scaler(fp16, deepspeed_scales):
    scaler = LossScaler.from_config(load_config({"fp16": {"enabled": True, **fp16}}))
    seen = []
    for overflow in PATTERN:
        scaler.update(bool(overflow))
        seen.append(scaler.scale)
    assert seen == deepspeed_scales

