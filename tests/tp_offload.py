"""Rank-side runs of tests/test_tp_offload.py, inside tests/test_tensor_parallel.py's one 4-rank launch:
ZeRO-Offload on a (dp 2, tp 2) model."""

from __future__ import annotations

from typing import Callable

from torch.distributed.device_mesh import DeviceMesh

RUNS = ["dp2 tp2 stage 2 offload", "dp2 tp2 stage 3 offload"]


def runs(mesh: DeviceMesh, train: Callable[..., dict]) -> dict:
    """The oracle's train() with the optimizer stepping on the host (stage 2), and at stage 3 with the
    parameter shards in host memory too."""
    cpu = {"device": "cpu"}
    return {RUNS[0]: train(mesh, 2, offload_optimizer=cpu),
            RUNS[1]: train(mesh, 3, offload_optimizer=cpu, offload_param=cpu)}
