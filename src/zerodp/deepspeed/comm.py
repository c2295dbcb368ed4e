"""`deepspeed.comm`: the collectives DeepSpeed scripts call (`from deepspeed import comm as dist`).

DeepSpeed's names over torch.distributed, with DeepSpeed's signatures: its collectives take
`prof=`, `log_name=` and `debug=` for its comms logger, which are accepted here and do nothing
(zerodp's own comms_logger counts the engine's collectives, not the script's). The group is the one
zerodp.deepspeed.init_distributed or initialize created (torchrun's environment, or a world of one).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zerodp.deepspeed.launch import init_distributed

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size",
           "get_local_rank", "get_global_rank", "get_world_group", "new_group", "barrier", "all_reduce",
           "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "gather",
           "scatter", "send", "recv", "monitored_barrier", "destroy_process_group", "get_backend"]

is_initialized = dist.is_initialized
is_available = dist.is_available
get_global_rank = dist.get_global_rank
new_group = dist.new_group
destroy_process_group = dist.destroy_process_group
get_backend = dist.get_backend
monitored_barrier = dist.monitored_barrier


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's index on its machine: torchrun's LOCAL_RANK (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_group() -> Any:
    return dist.group.WORLD


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, prof: bool = False,
            log_name: str = "barrier", debug: Any = None) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug: Any = None) -> Any:
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather", debug: Any = None) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor",
                           debug: Any = None) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: Any = None) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           prof: bool = False, log_name: str = "reduce", debug: Any = None) -> Any:
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: str = "gather", debug: Any = None) -> Any:
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, prof: bool = False, log_name: str = "scatter", debug: Any = None) -> Any:
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> None:
    dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug: Any = None) -> int:
    return dist.recv(tensor, src=src, group=group, tag=tag)
