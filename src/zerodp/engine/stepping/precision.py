"""The fp16 loss scaler.

Parameters, activations and gradients are in the working dtype (bf16, fp16 or fp32: inputs are cast to it by
the sharded module's forward, sharding/module.py); the fp32 master shard in optimizer.py is the only
full-precision copy. fp16 needs a loss scale so small
gradients do not flush to zero; the dynamic scaler follows DeepSpeed's rule (halve after
`hysteresis` overflows, double after `loss_scale_window` clean steps) so configs behave the same.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from zerodp.config import Config


@dataclass
class LossScaler:
    """Static or dynamic loss scale. `scale` is 1 and never changes outside fp16."""

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    cur_hysteresis: int = 2
    cur_iter: int = 0
    last_overflow_iter: int = -1

    @classmethod
    def from_config(cls, config: Config) -> "LossScaler":
        fp16 = config.fp16
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale))
        return cls(
            scale=float(2 ** fp16.initial_scale_power), dynamic=True, window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=float(fp16.min_loss_scale), cur_hysteresis=fp16.hysteresis,
        )

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step with the agreed-on overflow flag of all ranks."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            # DeepSpeed's count (0.19): the scale grows after `window` clean steps since the last
            # overflow (or since the start), not one step earlier.
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
