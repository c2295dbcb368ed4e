"""The config sections of what training reports: DeepSpeed's `tensorboard`, `csv_monitor`, `wandb`,
`comet`, `comms_logger` and `flops_profiler` keys, with DeepSpeed's names and defaults.

`steps_per_print` and `wall_clock_breakdown` are top-level keys of zerodp.config.Config; what they
and these sections do is zerodp.monitor (docs/monitoring.md).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from zerodp.config.base import _Section


class TensorBoardConfig(_Section):
    """Events written with torch.utils.tensorboard to output_path/job_name (needs `tensorboard`)."""

    enabled: bool = False
    output_path: str = ""  # "" : the current directory, as DeepSpeed
    job_name: str = "DeepSpeedJobName"


class CSVConfig(_Section):
    """One CSV file per event name in output_path/job_name (DeepSpeed's csv_monitor layout)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(_Section):
    """A Weights & Biases run (needs `wandb`; enabled without it is an error at initialize)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(_Section):
    """Accepted only disabled: zerodp has no Comet monitor."""

    enabled: bool = False
    samples_log_interval: int = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None

    @field_validator("enabled")
    @classmethod
    def _refused(cls, enabled: bool) -> bool:
        if enabled:
            raise ValueError("zerodp has no Comet monitor; use 'tensorboard', 'csv_monitor' or 'wandb', "
                             "or send engine.monitor.last_events (each step's (name, value, step) "
                             "events) to Comet yourself")
        return enabled


_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


class CommsLoggerConfig(_Section):
    """Calls, bytes and time of each collective zerodp issues (zerodp.monitor.comms).

    prof_all records every collective; otherwise only those named in prof_ops. verbose logs each
    collective as it completes; debug adds the calling function to each record's name."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = Field(default_factory=list)

    @field_validator("prof_ops")
    @classmethod
    def _known_ops(cls, ops: list[str]) -> list[str]:
        unknown = [op for op in ops if op not in _COLLECTIVES]
        if unknown:
            raise ValueError(f"unknown collective(s) {unknown}; zerodp issues {', '.join(_COLLECTIVES)}")
        return ops


class FlopsProfilerConfig(_Section):
    """Accepted only disabled: see the message below."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None

    @field_validator("enabled")
    @classmethod
    def _refused(cls, enabled: Any) -> Any:
        # DeepSpeed's profiler patches torch.nn.functional and every module to print a per-module
        # table once; PyTorch's own FlopCounterMode does the counting without patching, around any
        # code the user chooses, so zerodp points there instead of keeping a second copy.
        if enabled:
            raise ValueError("zerodp has no flops profiler; count a step's FLOPs with PyTorch's own "
                             "`with torch.utils.flop_counter.FlopCounterMode(): engine(batch)` "
                             "(per-module table included), or profile with torch.profiler")
        return enabled
