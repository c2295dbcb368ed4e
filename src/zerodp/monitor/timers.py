"""wall_clock_breakdown: how long each phase of a training step takes.

Phases are spans opened by the engine (forward, backward, reduce_wait, step) and by the parameter
gathers (gather). Spans nest; each phase gets its own time, with the spans inside it taken out: a
stage-3 gather during forward counts as gather, not forward, and the phases of a step add up to
the time covered. Measured with the device's events on an accelerator (read later, when they are
already complete, so timing adds no host sync) and with the host clock on the CPU.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable

import torch

from zerodp.distributed.device import event

PHASES = ("forward", "backward", "reduce_wait", "step", "gather")
_OFF = nullcontext()


class PhaseTimers:
    """Spans of the current step: (name, start, end, parent index); `close_step` turns them into
    {phase: ms} for the step (`resolve`)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.device = device
        self.spans: list[list] = []
        self.stack: list[int] = []

    def span(self, name: str):
        return self._span(name) if self.enabled else _OFF

    @contextmanager
    def _span(self, name: str):
        # A span inside one of the same name (a gather that waits through another gather) is one span.
        if self.stack and self.spans[self.stack[-1]][0] == name:
            yield
            return
        record = [name, self._now(), None, self.stack[-1] if self.stack else None]
        self.spans.append(record)
        self.stack.append(len(self.spans) - 1)
        try:
            yield
        finally:
            self.stack.pop()
            record[2] = self._now()

    def _now(self):
        mark = event(self.device, timing=True)  # on the device's stream: the time its work reaches here
        mark.record()
        return mark

    def close_step(self) -> list[list]:
        """This step's spans (to `resolve` once complete); the next step starts empty. A span still
        open (a step() inside a forward is not a thing, but be safe) stays with the next step."""
        done, self.spans = self.spans, []
        self.stack = []
        return done


class TimedGathers:
    """The gather-timing protocol, for a class whose parameter gathers are methods marked
    `@gather_phase` (the partitioned optimizer's, stage 3's gatherer's): they run inside
    `gather_span()`, free (nullcontext) until the step monitor calls `time_gathers` with its timer's
    span because wall_clock_breakdown is on; then they are timed as the 'gather' phase."""

    gather_span: Callable[[], AbstractContextManager] = nullcontext

    def time_gathers(self, span: Callable[[], AbstractContextManager]) -> None:
        """Run the parameter gathers inside span() (wall_clock_breakdown's 'gather' phase)."""
        self.gather_span = span


def gather_phase(method):
    """The method of a `TimedGathers` runs inside its object's `gather_span()`."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.gather_span():
            return method(self, *args, **kwargs)
    return run


def resolve(spans: list[list]) -> dict[str, float]:
    """{phase: milliseconds} of one step's spans, each phase without the spans nested in it."""
    own = dict.fromkeys(PHASES, 0.0)
    elapsed = [_ms(s[1], s[2]) for s in spans]
    for s, ms in zip(spans, elapsed):
        own[s[0]] = own.get(s[0], 0.0) + ms
    for s, ms in zip(spans, elapsed):
        if s[3] is not None:
            parent = spans[s[3]][0]
            own[parent] -= ms
    return {k: max(0.0, v) for k, v in own.items()}


def _ms(start, end) -> float:
    if end is None:
        return 0.0
    end.synchronize()  # already complete when resolve runs a step later: no wait
    return start.elapsed_time(end)
