"""A peer's failure, named: what a rank raises when another rank failed, stalled, died or went elsewhere.

`Comm.agree` turns each rank's error into a `Failure` (plain strings) that every rank raises as the same
class; `Comm.peer_failure` turns a collective's timeout or lost connection into a `PeerFailure` naming
where each rank waits (`DIVERGENCE`: what a divergence looks like, unless the caller knows better).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


class PeerFailure(RuntimeError):
    """A collective that could not complete because another rank stopped responding, died, or ran other
    code (the ranks diverged)."""


# What any timeout says a divergence looks like, unless the caller knows better (stage 3's forwards do).
DIVERGENCE = ("if the ranks' code diverged (a forward, backward, step or save run on some ranks only), every "
              "rank must make the same zerodp calls in the same order")
PEER_GRACE_S = 2.0          # how long a rank that timed out waits for the others' whereabouts in the store


@dataclass(frozen=True)
class Failure:
    """One rank's error as `Comm.agree` reports it: plain strings, so no rank unpickles an object."""

    rank: int
    kind: str      # the exception class, "module:qualname"
    message: str

    def exception(self, what: str) -> Exception:
        """The error a rank raises for a peer's failure: the same class where it can be rebuilt."""
        text = f"{what} failed on rank {self.rank}: {self.message}"
        module, _, name = self.kind.partition(":")
        cls = sys.modules.get(module)
        for part in name.split("."):
            cls = getattr(cls, part, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                err = cls(text)
                if str(err) == text:  # a class whose constructor takes one message
                    return err
            except Exception:  # noqa: BLE001 - any other signature: fall back to RuntimeError
                pass
        return RuntimeError(f"{text} ({name})")


def ranks_text(ranks: list[int]) -> str:
    """"rank 3", or "ranks 1-4, 7" for many."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return "ranks " + ", ".join(runs)


def message(e: BaseException) -> str:
    """The exception's text, never failing (an agreement must not break on a bad __str__)."""
    try:
        return str(e) or type(e).__name__
    except Exception:  # noqa: BLE001
        return type(e).__name__
