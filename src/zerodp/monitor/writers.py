"""Monitors: where the engine's per-step events go. One interface, DeepSpeed's: `write_events` takes
(name, value, step) tuples, named like DeepSpeed's ("Train/Samples/train_loss", step = samples seen).

Built on rank 0 only (`build_monitors`); every other rank gets none and writes nothing.
"""

from __future__ import annotations

import csv
import os
from typing import Protocol, Sequence

Event = tuple[str, float, int]


class Monitor(Protocol):
    def write_events(self, events: Sequence[Event]) -> None: ...
    def close(self) -> None: ...


def _log_dir(output_path: str, job_name: str) -> str:
    path = os.path.join(output_path or os.getcwd(), job_name)
    os.makedirs(path, exist_ok=True)
    return path


class CSVMonitor:
    """One file per event name, `name.csv` with '/' and ' ' as '_', rows `step,value` under a
    `step,<last part of the name>` header (DeepSpeed's csv_monitor layout)."""

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = _log_dir(output_path, job_name)
        self._started: set[str] = set()

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a", newline="") as f:
                writer = csv.writer(f)
                if filename not in self._started:
                    self._started.add(filename)
                    if f.tell() == 0:  # a resumed job appends to the file it left
                        writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardMonitor:
    """Scalars written by torch.utils.tensorboard's SummaryWriter to output_path/job_name."""

    def __init__(self, output_path: str, job_name: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("config key 'tensorboard.enabled' = true needs the tensorboard package: "
                              "pip install tensorboard (or zerodp[monitor])") from None
        self.writer = SummaryWriter(log_dir=_log_dir(output_path, job_name))

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbMonitor:
    """A Weights & Biases run: wandb.init(project, group, entity=team), then wandb.log per event."""

    def __init__(self, project: str, group: str | None, team: str | None):
        try:
            import wandb
        except ImportError:
            raise ImportError("config key 'wandb.enabled' = true needs the wandb package: pip install "
                              "wandb (or set 'wandb.enabled' to false)") from None
        self.wandb = wandb
        wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        self.wandb.finish()


def check_available(config) -> None:
    """Raise now, on every rank, if an enabled monitor's package is missing (before any collective)."""
    import importlib.util
    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(config, key).enabled and importlib.util.find_spec(package) is None:
            raise ImportError(f"config key '{key}.enabled' = true needs the {package} package: "
                              f"pip install {package} (or zerodp[monitor]), or set '{key}.enabled' to false")


def build_monitors(config, rank: int) -> list[Monitor]:
    """The monitors the config enables, on rank 0; none elsewhere."""
    if rank != 0:
        return []
    out: list[Monitor] = []
    if config.tensorboard.enabled:
        out.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
    if config.csv_monitor.enabled:
        out.append(CSVMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.wandb.enabled:
        out.append(WandbMonitor(config.wandb.project, config.wandb.group, config.wandb.team))
    return out
