"""zerodp beside Accelerate (docs/ACCELERATE.md): a script that made its Accelerator before zerodp.initialize
has two views of the job, Accelerate's process count and torch.distributed's world, which must agree.

They part where Accelerate does not recognise the launch: `accelerate launch --multi_gpu --num_processes 2` on
a machine without GPUs and without ACCELERATE_USE_CPU starts 2 processes whose torch.distributed world is 2
(Accelerate itself initialised it) while Accelerate's state says 1 process, DistributedType.NO. Every process
is then Accelerate's main one (each writes the files meant to be written once) and its data loader shards
nothing, while zerodp averages 2 ranks' gradients. Each process sees the same two counts, so each refuses
alone, before zerodp's first collective.
"""

from __future__ import annotations

import os
import sys


def torch_world() -> int:
    """The world zerodp.initialize will join: the existing group's, else the launcher's, else one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else 1


def check_same_world() -> None:
    """ValueError naming both counts and the fix, when Accelerate's state exists and sees another number of
    processes than torch.distributed. Nothing is imported or created when the script made no Accelerator."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.PartialState._shared_state:
        return
    theirs, ours = state.PartialState().num_processes, torch_world()
    if theirs != ours:
        raise ValueError(
            f"zerodp.initialize: Accelerate sees {theirs} process(es) but torch.distributed's world has {ours} "
            f"ranks, so every process would act as Accelerate's main one (each writing the files meant to be "
            f"written once) and its data loader would not split the batches; Accelerate did not recognise the "
            f"launch. On a machine without GPUs, set ACCELERATE_USE_CPU=true for the launch "
            f"(`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes {ours} train.py`; "
            f"Accelerate's --cpu flag cannot go with --multi_gpu, and alone starts one process without MPI); "
            f"docs/ACCELERATE.md")
