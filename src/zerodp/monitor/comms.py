"""comms_logger: calls, bytes and time of each collective the engine issues.

Every collective zerodp makes goes through its one `Comm`; when the comms logger is enabled it is one
of that Comm's watchers, told of each of the four collectives as it starts and as it completes (with
no watcher a collective pays nothing). Time is host time from the call to its completion: for a
blocking call the call itself, for an async one until the `wait()` that needed it returned, so an
overlapped collective's time includes the work it hid behind (an upper bound of its latency). On GPUs, where wait() does not block the
host, time stops when the wait is enqueued. Message size is the tensor's bytes (the larger side).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

log = logging.getLogger("zerodp")

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    ms: float = 0.0


class CommsLogger:
    def __init__(self, config, rank: int):
        self.config, self.rank = config, rank
        self.ops = {op for op in OPS if config.prof_all or op in config.prof_ops}
        self.stats: dict[str, OpStats] = defaultdict(OpStats)

    def attach(self, comm) -> None:
        """Watch comm's collectives (and its shard and replica groups', which share its watchers)."""
        comm.watchers.append(self.watch)

    def watch(self, op: str, nbytes: int):
        """Comm's watcher: called as a collective starts; returns what records it when complete."""
        if op not in self.ops:
            return _nothing
        name = f"{op} | {_caller()}" if self.config.debug else op
        return functools.partial(self._record, name, nbytes, time.perf_counter())

    def _record(self, name: str, nbytes: int, start: float) -> None:
        ms = (time.perf_counter() - start) * 1e3
        s = self.stats[name]
        s.calls += 1
        s.bytes += nbytes
        s.ms += ms
        if self.config.verbose and self.rank == 0:
            log.info("zerodp comm: %s %d B %.3f ms", name, nbytes, ms)

    def summary(self) -> dict[str, OpStats]:
        """Totals per collective since the last `reset` (the last printed step)."""
        return dict(self.stats)

    def text(self) -> str:
        return "; ".join(f"{name} {s.calls} calls {s.bytes / 2**20:.2f} MiB {s.ms:.1f} ms"
                         for name, s in sorted(self.stats.items()))

    def reset(self) -> None:
        self.stats.clear()


def _nothing() -> None:
    pass


def _caller() -> str:
    """The function that asked for the collective: the first frame outside this file and comm.py
    (Comm.shard_gather / shard_reduce pass collectives on to their groups)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.endswith(("comm.py", "comms.py")):
        frame = frame.f_back
    return frame.f_code.co_name
