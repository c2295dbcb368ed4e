"""What zerodp's collectives report as they run: the bytes each moves (`Traffic`, counted as a ring moves
them), the host time blocked in them (`BlockedClock`, wall_clock_breakdown's exposed communication) and
comms_logger's watchers (`Watcher`), told when a collective starts and when it has completed.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Traffic:
    """Bytes each rank sends per collective kind, counted as a ring algorithm moves them."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    # (group, op) -> bytes: "world", or the "shard" / "replica" groups of hierarchical sharding.
    by_group: Counter = field(default_factory=Counter)
    # Host time blocked in the collectives (wall_clock_breakdown turns it on); None: not clocked.
    blocked: BlockedClock | None = None

    def clocked(self, call: Callable):
        """call (a collective), clocked while `blocked` is set: a blocking collective's whole call, an async
        one's wait() (its launch only enqueues it; the wait is where the host stops for communication)."""
        clock = self.blocked
        if clock is None:
            return call

        def timed():
            start = time.perf_counter()
            work = call()
            if work is None:
                clock.seconds += time.perf_counter() - start
                return None
            return ClockedWork(work, clock)
        return timed

    def add(self, op: str, nbytes: float, group: str = "world") -> None:
        self.bytes[op] += int(nbytes)
        self.calls[op] += 1
        self.by_group[group, op] += int(nbytes)

    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.by_group.clear()


class BlockedClock:
    """Seconds the host has been blocked in zerodp's collectives since the last `take`: on gloo, where a
    collective runs on the host, the communication a step did not hide behind its computation (exposed
    communication). With NCCL a wait makes the device's stream wait, not the host: this then sees little."""

    def __init__(self):
        self.seconds = 0.0

    def take(self) -> float:
        """The seconds since the last take; the clock starts again from 0."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class ClockedWork:
    """An async collective's handle whose wait() adds the time it blocks to a BlockedClock."""

    def __init__(self, work, clock: BlockedClock):
        self.work, self.clock = work, clock

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.clock.seconds += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.work, name)


# comms_logger's hook: watch(op, nbytes) is called as a collective starts and returns what to call
# when it has completed.
Watcher = Callable[[str, int], Callable[[], None]]


class WatchedWork:
    """An async collective's handle whose wait() tells the watchers it has completed."""

    def __init__(self, work, dones: list[Callable[[], None]]):
        self.work, self.dones = work, dones

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        for done in self.dones:
            done()
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


class NoticedWork:
    """An async collective's handle whose wait() is marked as time blocked for the wait notice (waits.py)."""

    def __init__(self, work, notice, op: str):
        self.work, self.notice, self.op = work, notice, op

    def wait(self, *args, **kwargs):
        with self.notice.waiting(self.op):
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


class Done:
    """The work handle of a collective that had nothing to do (a world of one)."""

    def wait(self) -> bool:
        return True
