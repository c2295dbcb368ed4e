"""`deepspeed.utils.timer.ThroughputTimer`: samples per second over the steps after a warm-up, as
DeepSpeed's engine keeps it in `engine.tput_timer`.

Each interval runs from start() (the engine's forward) to stop() (its step); the first `start_step`
optimizer steps are not timed (start-up, first allocations). avg_samples_per_sec() is
batch_size / (timed seconds per timed step), batch_size being the global train_batch_size.
DeepSpeed-Chat's scripts call update_epoch_count() at each epoch's end.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from zerodp.deepspeed.accelerator import get_accelerator
from zerodp.deepspeed.utils import logger


class ThroughputTimer:
    """DeepSpeed's names and arguments. `config`: DeepSpeed's `timers.throughput` settings (an object
    with `enabled` and `synchronized`), or None: enabled, not synchronised (the engine waits for the
    device once per step already). With steps_per_output, every that many steps a line is logged
    (default: zerodp.deepspeed.utils.logger.info); monitor_memory adds the host's memory use."""

    def __init__(self, config: Any = None, batch_size: int | None = None, start_step: int = 2,
                 steps_per_output: int | None = None, monitor_memory: bool = False,
                 logging_fn: Callable[[str], Any] | None = None):
        self.enabled = getattr(config, "enabled", True)
        self.synchronized = getattr(config, "synchronized", False)
        self.batch_size = 1 if batch_size is None else batch_size   # samples per optimizer step
        self.start_step = start_step                # optimizer steps not timed
        self.steps_per_output = steps_per_output    # log every this many steps (None: never)
        self.monitor_memory = monitor_memory        # add the host's memory use to each line
        if monitor_memory:
            import psutil  # noqa: F401 - as DeepSpeed: without it, an ImportError here, not at the first line
        self.logging = logging_fn or logger.info
        self.epoch_count = 0          # update_epoch_count() calls
        self.micro_step_count = 0     # stop() calls in this epoch
        self.global_step_count = 0    # stop(global_step=True) calls
        self.total_elapsed_time = 0.0  # timed seconds since start_step
        self.step_elapsed_time = 0.0   # timed seconds of the current optimizer step
        self.start_time = 0.0          # of the running interval (0: not timed)
        self.started = False

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            self._sync()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the interval; global_step: it ended an optimizer step (an accumulation boundary)."""
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += int(global_step)
        if self.start_time > 0:
            self._sync()
            duration = time.time() - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            self.start_time = 0.0
            if global_step:
                if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
                    self.logging(self._line())
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed steps; -inf before any step was timed, as DeepSpeed's."""
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)

    def _sync(self) -> None:
        if self.synchronized:
            get_accelerator().synchronize()

    def _line(self) -> str:
        accel = get_accelerator()
        line = (f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}, "
                f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                f"CurrSamplesPerSec={self.batch_size / max(self.step_elapsed_time, 1e-12)}, "
                f"MemAllocated={round(accel.memory_allocated() / 1024**3, 2)}GB, "
                f"MaxMemAllocated={round(accel.max_memory_allocated() / 1024**3, 2)}GB")
        if self.monitor_memory:
            import psutil
            line += f", vm %: {psutil.virtual_memory().percent}, swap %: {psutil.swap_memory().percent}"
        return line
