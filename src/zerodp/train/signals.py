"""Who says that a job was stopped: the launcher while its ranks are in set-up, rank 0 once its training loop
handles signals. A rank this job started tells the launcher which, by a file beside its pid."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

PID_DIR = "ZERODP_TRAIN_PID_DIR"  # where each rank the job starts leaves its pid (launch.FirstExit)
TRAINING = "{rank}.training"  # ... and this file once its loop's StopSignal handles signals (training_began)


def training_began(install: Callable[[], None]) -> None:
    """Run `install` (the loop's signal handlers) and, in a rank this job started, say so to the launcher: from
    then on rank 0 prints the stop line itself. Signals wait meanwhile, so that one arriving in between is
    neither lost to set-up's default action after the file is written nor announced twice."""
    blocked = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        install()
        if PID_DIR in os.environ:
            Path(os.environ[PID_DIR], TRAINING.format(rank=os.environ["RANK"])).touch()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
