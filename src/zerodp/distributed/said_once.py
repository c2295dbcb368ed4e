"""An error every rank raises alike, said once: by rank 0, in one `zerodp:` line at the top.

Under torchrun a user error that zerodp raises on every rank (a config whose batch sizes do not divide,
found by every rank's set-up and agreed on by Comm.agree) reached the terminal as every rank's traceback
plus torchrun's table: 78 to 133 lines for one sentence, the sentence nowhere near the top. Comm.agree,
the one place where such an error is raised on every rank, marks it here; if it then ends the process
(uncaught: the script did not handle it), this module's sys.excepthook says it:
  rank 0      `zerodp: <the error>` first; then, for zerodp's own error classes (ConfigError,
              CheckpointError, ...: a sentence about the user's input), one line naming the script's
              line that called zerodp, and no traceback; for any other class its traceback as usual.
  other ranks nothing, when their error is rank 0's (rank 0 failed with the same message) or a copy of
              a peer's; a rank whose own error differs prints its traceback as usual.
The exception itself is unchanged: a script that catches it sees what it always saw. A world of one is
left alone (its traceback is its only output anyway).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from types import TracebackType

_ROLE = "_zerodp_said_once"  # set on the exception object: "speak" (rank 0) or "quiet"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/zerodp
_state: dict = {"previous": None}
QUIET_EXIT_DELAY_S = 1.0


def mark(error: BaseException, rank: int, world_size: int, quiet: bool) -> None:
    """`error` is raised on every rank of a group of `world_size`: rank 0 will say it if it ends the
    process; another rank stays quiet when `quiet` (its error is rank 0's, or a copy of a peer's)."""
    if world_size < 2 or (rank != 0 and not quiet):
        return
    try:
        setattr(error, _ROLE, "speak" if rank == 0 else "quiet")
    except AttributeError:  # an exception class with __slots__: it keeps its usual traceback
        return
    if _state["previous"] is None:
        _state["previous"] = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    role = getattr(value, _ROLE, None)
    if role is None:
        _state["previous"](kind, value, tb)
        return
    if role == "quiet":
        # torchrun ends the whole job when the first rank exits, and names that rank as the root cause:
        # give rank 0, which says the error for this one too, a moment to be first.
        time.sleep(QUIET_EXIT_DELAY_S)
        return
    sys.stderr.write(f"zerodp: {value}\n")
    if kind.__module__.split(".")[0] == "zerodp":
        where = _callers_line(tb)
        sys.stderr.write(f"  ({kind.__name__} on every rank{where}; rank 0 says it for all)\n")
        sys.stderr.flush()
    else:
        sys.stderr.flush()
        _state["previous"](kind, value, tb)


def _callers_line(tb: TracebackType | None) -> str:
    """', raised by FILE:LINE' for the innermost frame of the traceback outside the zerodp package."""
    outside = [f for f in traceback.extract_tb(tb) if not os.path.abspath(f.filename).startswith(_PACKAGE + os.sep)]
    return f", raised by {outside[-1].filename}:{outside[-1].lineno}" if outside else ""
