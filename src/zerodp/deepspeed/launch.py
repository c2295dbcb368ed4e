"""`deepspeed.init_distributed` (also `deepspeed.comm.init_distributed`): how a script's ranks join.

zerodp reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR) or runs as a world of one;
DeepSpeed's MPI discovery and explicit rank / world_size / init_method are refused with the reason.
"""

from __future__ import annotations

import os
from typing import Any

from zerodp.distributed.comm import init_distributed as _init_distributed


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int | None = None, verbose: bool = True, timeout: Any = None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """torch.distributed from torchrun's environment (or a world of one), unless already initialised."""
    if init_method is not None or rank != -1 or world_size != -1:
        raise ValueError("init_distributed(init_method=/rank=/world_size=) is not supported: zerodp reads "
                         "torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR); initialise "
                         "torch.distributed yourself for anything else")
    if timeout is not None:
        _init_distributed(dist_backend, timeout_s=timeout.total_seconds())
    else:
        _init_distributed(dist_backend)


def local_rank_from_launcher(from_args: int | None) -> int:
    """This process's local rank as DeepSpeed's engine takes it: LOCAL_RANK (0 in a world of one);
    a script's --local_rank other than -1 must agree with it (DeepSpeed's check, and its words)."""
    env = int(os.environ.get("LOCAL_RANK", "0"))
    if isinstance(from_args, int) and not isinstance(from_args, bool) and from_args >= 0 and from_args != env:
        raise ValueError(f"Mismatch in local rank setting, args.local_rank={from_args} but "
                         f"env['LOCAL_RANK']={env}: pass the launcher's --local_rank unchanged, or none "
                         "(torchrun sets LOCAL_RANK)")
    return env
