"""`deepspeed.utils`: the logger DeepSpeed scripts log through (`logger`, `log_dist`) and `zero_to_fp32`.

  timer.py         ThroughputTimer (engine.tput_timer).
  zero_to_fp32.py  a ZeRO checkpoint as one full fp32 state dict, in one process.
"""

from __future__ import annotations

import logging
import sys
from typing import Iterable

import torch.distributed as dist

from zerodp.deepspeed.utils import zero_to_fp32

__all__ = ["logger", "log_dist", "zero_to_fp32"]


def _make_logger() -> logging.Logger:
    """A logger that prints at INFO to stdout, as DeepSpeed's (scripts expect to see logger.info)."""
    log = logging.getLogger("zerodp.deepspeed")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:"
                                               "%(funcName)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the given ranks (all of them for None or a list holding -1), prefixed with the rank."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    ranks = list(ranks) if ranks is not None else [-1]
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
