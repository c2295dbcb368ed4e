"""`deepspeed.init_distributed` (also `deepspeed.comm.init_distributed`): how a script's ranks join.

zerodp reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR) or runs as a world of one;
DeepSpeed's MPI discovery and explicit rank / world_size / init_method are refused with the reason.
"""

from __future__ import annotations

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
