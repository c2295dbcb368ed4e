"""Waits that speak: a zerodp collective that keeps this rank waiting longer than `wait_notice_s` says so.

A peer that is slow, stalled or somewhere else leaves the others blocked inside a collective, silent until
comm_timeout_s (ten minutes by default) or for ever. `WaitNotice` marks the host's time blocked in one of
Comm's collectives (a synchronous call, or an async one's wait()): an attribute write and a clock read on
either side, nothing else on the hot path. A daemon thread looks at the mark; once a wait has lasted
`wait_notice_s` it prints one line on this rank (the collective, where the engine is: the call, the step,
stage 3's phase and unit) and where the other ranks are, read from the store, where each rank that speaks
writes its place (and clears it when its wait ends); then again at doubling intervals while the wait
lasts. It ends nothing: a slow rank is waited for, comm_timeout_s alone ends a wait.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable

import torch.distributed as dist

_IDLE = ""  # a rank's store entry when it speaks of no wait


class WaitNotice:
    """The blocked-in-a-collective mark of one engine's Comms (shared with its shard, replica and tp groups)."""

    def __init__(self, notice_s: float, rank: int, ranks: list[int], key: str):
        self.notice_s = notice_s  # seconds of waiting before the first line; then doubling
        self.rank, self.ranks = rank, ranks  # this process's global rank, and the group's (global ranks)
        self.key = key  # the store's keys for the group: key/<global rank> holds where that rank waits
        self.where = ""  # what the engine is doing (Comm.names_peer_failure sets it): "in engine.step() at step 3"
        self.describe: Callable[[], str] | None = None  # stage 3's gathers: their phase, unit and step
        self.blocked: tuple[str, float] | None = None  # (collective, since) while the host waits in one
        self.spoke = False  # this wait has been said: its store entry is cleared when it ends
        threading.Thread(target=self._watch, name="zerodp-wait-notice", daemon=True).start()

    @contextmanager
    def waiting(self, op: str):
        self.blocked = (op, time.monotonic())
        try:
            yield
        finally:
            self.blocked = None
            if self.spoke:
                self.spoke = False
                self._store_set(_IDLE)

    def _watch(self) -> None:
        poll = min(max(self.notice_s / 5, 0.05), 2.0)
        seen, next_at = None, self.notice_s
        while True:
            time.sleep(poll)
            blocked = self.blocked
            if blocked is not seen:
                seen, next_at = blocked, self.notice_s
            if blocked is None:
                continue
            waited = time.monotonic() - blocked[1]
            if waited >= next_at:
                self._speak(blocked[0], waited)
                next_at *= 2

    def _speak(self, op: str, waited: float) -> None:
        gather = self.describe is not None and op == "all_gather"  # stage 3's: its phase, unit and step
        here = f"{op} {self.where}" + (f" ({self.describe()})" if gather else "")
        self.spoke = True
        self._store_set(here)
        others = []
        for r in self.ranks:
            if r != self.rank:
                there = self._store_get(r)
                others.append(f"rank {r} waits in {there}" if there else
                              f"rank {r} is in no zerodp collective (slower, or running code of its own)")
        seconds = f"{waited:.1f}" if waited < 10 else f"{waited:.0f}"
        print(f"[zerodp] rank {self.rank}: waiting {seconds} s in {here}; {'; '.join(others)}; still waiting "
              "(wait_notice_s sets when this is said, comm_timeout_s ends the wait)", file=sys.stderr, flush=True)

    def _store_set(self, text: str) -> None:
        try:
            dist.distributed_c10d._get_default_store().set(f"{self.key}/{self.rank}", text)
        except Exception:  # noqa: BLE001 - no store (the group is gone): the line says what this rank knows
            pass

    def _store_get(self, rank: int) -> str:
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"{self.key}/{rank}"
            return store.get(key).decode() if store.check([key]) else _IDLE
        except Exception:  # noqa: BLE001
            return _IDLE
