"""The engine's view of each step for people: the `steps_per_print` line, `wall_clock_breakdown`
timings, monitor events (TensorBoard, CSV, W&B) and the comms logger's totals.

Costs nothing it does not need: no collective, and no host sync of its own. On the CPU values are
read as they come. On a GPU a step's values (loss, grad norm) are copied into pinned host memory
without blocking, with an event recorded behind the copy (device.HostCopy), and read during the next
step after waiting for that event alone, long complete by then (the step itself has no host sync to
lean on); CUDA timing events are read the same way. Lines and events therefore trail by one step
there, and `flush()` (engine.timings(), or the end of training) reads the last one.

What each field is:
  loss       this rank's (rank 0's) mean loss over the step's micro-batches, as passed to backward;
  samples/s  size of dim 0 of the first tensor given to engine(...) in training mode, summed over the
             step's micro-batches, x data-parallel world size (every rank is assumed to see the same
             shapes: no collective counts them; a dp rank's tensor-parallel ranks share its batch),
             per second of host wall time since the last printed step;
  tokens/s   the same with the first tensor's element count, when it holds integers (token ids);
  memory     the device's peak allocated bytes (max_memory_allocated) on an accelerator, the
             process's peak resident set size on the CPU.
"""

from __future__ import annotations

import atexit
import logging
import resource
import sys
import time
from typing import Callable

import torch

from zerodp.distributed.device import HostCopy, is_accelerator, max_memory_allocated
from zerodp.distributed.traffic import BlockedClock
from zerodp.monitor.comms import CommsLogger
from zerodp.monitor.timers import PhaseTimers, resolve
from zerodp.monitor.writers import build_monitors

log = logging.getLogger("zerodp")


class StepMonitor:
    def __init__(self, config, comm, device: torch.device):
        self.every = config.steps_per_print
        # Rank 0 of the whole world reports: with tensor parallelism each tp rank is rank 0 of its own
        # data-parallel group. The batch counts the data-parallel ranks: a dp rank's tp ranks share its batch.
        self.rank, self.world = comm.everyone.rank, comm.world_size
        self.device, self.on_accelerator = device, is_accelerator(device)
        self.defer = self.on_accelerator  # read a step's values one step later (see the module docstring)
        if self.defer:
            atexit.register(self.flush)  # the last step's line and events, at the end of the script
        self.timers = PhaseTimers(config.wall_clock_breakdown, device)
        # wall_clock_breakdown's exposed_comm: host time blocked in the collectives of comm's groups (a world of
        # one has none: its collectives are local copies)
        self.blocked = BlockedClock() if self.timers.enabled and comm.everyone.world_size > 1 else None
        if self.blocked is not None:
            comm.traffic.blocked = self.blocked
        self.monitors = build_monitors(config, self.rank)
        self.comms = None
        if config.comms_logger.enabled:
            self.comms = CommsLogger(config.comms_logger, self.rank)
            self.comms.attach(comm)
        self.samples = self.tokens = 0       # this rank's, since the last printed step
        self.window_samples = 0              # this rank's, in the current step
        self.total_samples = 0               # global, for monitor events (DeepSpeed's x axis)
        self.since, self.steps_since = time.perf_counter(), 0
        self.pending: dict | None = None
        self.last_timings: dict[str, float] = {}
        self.last_events: list[tuple[str, float, int]] = []
        if self.every and self.rank == 0 and not log.hasHandlers():
            # A script that configured no logging still sees the lines (DeepSpeed prints them too);
            # a plain stream handler writes whole lines, terminal or not.
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)

    # ---- during the step (hot path: cheap, no sync) ---------------------------------------------
    def span(self, name: str):
        return self.timers.span(name)

    def instrument_gathers(self, partitioned, gatherer) -> None:
        """Time parameter all-gathers as the 'gather' phase (only with wall_clock_breakdown)."""
        if not self.timers.enabled:
            return
        for obj in (partitioned, gatherer):
            if obj is not None:
                obj.time_gathers(lambda: self.timers.span("gather"))

    def saw_inputs(self, args: tuple) -> None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.dim() > 0:
            self.window_samples += first.shape[0]
            if not first.is_floating_point():
                self.tokens += first.numel()

    # ---- after the step -------------------------------------------------------------------------
    def after_step(self, step: int, window_loss: torch.Tensor | None, micro: int, grad_norm,
                   lr: Callable[[], float], loss_scale: float, skipped: Callable[[], int]) -> None:
        """lr and skipped are read when the step is reported (a step later on a GPU), when a step
        decided on the device (non_finite.read_back) has been settled."""
        spans = self.timers.close_step()
        exposed_s = self.blocked.take() if self.blocked is not None else 0.0
        self.samples += self.window_samples
        self.total_samples += self.window_samples * self.world
        self.window_samples = 0
        self.steps_since += 1
        printing = self.every is not None and step % self.every == 0
        wanted = self.rank == 0 and (printing or self.monitors)
        if not wanted and not self.timers.enabled:
            return
        values = None
        if wanted and window_loss is not None:
            loss = window_loss.detach().float().reshape(())
            norm = (grad_norm.detach().float().reshape(()) if grad_norm is not None
                    else torch.full_like(loss, float("nan")))  # made on the device: no copy from the host
            values = torch.stack([loss / max(1, micro), norm])
            values = HostCopy(values)  # on a GPU: to pinned memory, read a step later behind an event
        record = dict(step=step, values=values, spans=spans, exposed_s=exposed_s, lr=lr, loss_scale=loss_scale,
                      skipped=skipped, printing=printing and self.rank == 0, samples=self.total_samples)
        if printing and self.rank == 0:
            now = time.perf_counter()
            dt, self.since = now - self.since, now
            record.update(samples_s=self.samples * self.world / dt, tokens_s=self.tokens * self.world / dt,
                          memory=_peak_memory(self.device), steps=self.steps_since)
            self.samples = self.tokens = self.steps_since = 0
        previous, self.pending = self.pending, record
        if previous is not None:
            self._emit(previous)
        if not self.defer:
            self.flush()

    def flush(self) -> None:
        """Report the step still waiting to be read (GPU), if any."""
        if self.pending is not None:
            record, self.pending = self.pending, None
            self._emit(record)

    def _emit(self, r: dict) -> None:
        if r["spans"]:
            self.last_timings = {**resolve(r["spans"]), "exposed_comm": 1e3 * r["exposed_s"]}
        loss = norm = float("nan")
        if r["values"] is not None:
            loss, norm = r["values"].tolist()
        r["lr"], r["skipped"] = r["lr"](), r["skipped"]()
        if self.monitors:
            events = [("Train/Samples/train_loss", loss, r["samples"]), ("Train/Samples/lr", r["lr"], r["samples"]),
                      ("Train/Samples/loss_scale", r["loss_scale"], r["samples"]),
                      ("Train/Samples/grad_norm", norm, r["samples"])]
            events += [(f"Train/Samples/elapsed_time_ms_{k}", v, r["samples"]) for k, v in
                       (self.last_timings.items() if r["spans"] else ())]
            self.last_events = events
            for m in self.monitors:
                m.write_events(events)
        if r["printing"]:
            log.info(_line(r, loss, norm, self.last_timings if r["spans"] else None,
                           self.comms.text() if self.comms else None))
            if self.comms:
                self.comms.reset()

    def timings(self) -> dict[str, float]:
        """Milliseconds per phase of the last step read (wall_clock_breakdown); {} when it is off."""
        self.flush()
        return dict(self.last_timings)

    def close(self) -> None:
        self.flush()
        for m in self.monitors:
            m.close()


def _peak_memory(device: torch.device) -> str:
    if is_accelerator(device):
        return f"{max_memory_allocated(device) / 2**30:.2f} GiB peak allocated"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB peak RSS"  # KiB on Linux


def _line(r: dict, loss: float, norm: float, timings: dict | None, comms: str | None) -> str:
    text = (f"zerodp step {r['step']}: loss {loss:.4f} lr {r['lr']:.3e} grad_norm {norm:.4g} "
            f"loss_scale {r['loss_scale']:g} skipped {r['skipped']} samples/s {r['samples_s']:.1f}")
    if r["tokens_s"]:
        text += f" tokens/s {r['tokens_s']:.0f}"
    text += f" memory {r['memory']}"
    if timings:
        text += " | ms: " + " ".join(f"{k} {v:.2f}" for k, v in timings.items())
    if comms:
        text += " | comms: " + comms
    return text
