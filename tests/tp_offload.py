"""Rank-side runs of tests/test_tp_offload.py, inside tests/test_tensor_parallel.py's one 4-rank launch, on
a (dp 2, tp 2) model: ZeRO-Offload, and the large-model set-up, where the model is built on `meta`,
parallelized, and its values come from a safetensors file of the whole model (each rank reading only its
local shard) or from its modules' initialisers (drawing the whole model's values)."""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import zerodp
from zerodp.checkpoint.weights import open_weights

RUNS = ["dp2 tp2 stage 2 offload", "deepspeed mpu dp2 tp2 stage 2 offload", "dp2 tp2 stage 2 weights",
        "dp2 tp2 stage 3 offload weights", "dp2 tp2 stage 3 meta"]


def runs(mesh: DeviceMesh) -> dict:
    """The oracle's train(): the optimizer stepping on the host (a mesh, and an mpu through
    zerodp.deepspeed); on meta with weights= a file of the whole model (build()'s values), at stage 3
    with both offloads (the large-model recipe); on meta with the modules' own initialisers (the same
    seed as build())."""
    import test_tensor_parallel as tp  # the oracle's module, which imports this one: imported when it runs

    train, build, plan = tp.train, tp.build, tp.plan
    cpu = {"device": "cpu"}
    out = {RUNS[0]: train(mesh, 2, offload_optimizer=cpu),
           RUNS[1]: tp.train_mpu(mesh, deepspeed=True, offload_optimizer=cpu)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "whole.safetensors")
        save_file({n: p.detach().contiguous() for n, p in build().named_parameters()}, path)
        for run, stage, zero in ((RUNS[2], 2, {}), (RUNS[3], 3, {"offload_optimizer": cpu, "offload_param": cpu})):
            spy = Spy(path)
            out[run] = train(mesh, stage, make=lambda sometimes: on_meta(build), weights=spy.open, **zero)
            out[run].update(read=spy.read, sizes=spy.sizes)
        out["frozen tp shards from weights"] = frozen_from_weights(mesh, build, plan, path)
    out[RUNS[4]] = train(mesh, 3, make=lambda sometimes: on_meta(build, own_seed=True))
    model = on_meta(build)
    model.blocks[0].fc1.weight.tensor_model_parallel = True  # a Megatron shard: the meta refusal, not "nothing split"
    out["mpu on meta"] = tp.error_text(lambda: zerodp.initialize(model, torch.optim.AdamW(model.parameters()), CONFIG,
                                                                 mpu=Mpu(mesh)))
    return out


CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}


def frozen_from_weights(mesh: DeviceMesh, build: Callable[..., nn.Module], plan: Callable[[], dict], path: str) -> dict:
    """Frozen tp shards (outside the flat buffers, Shard(0) and Shard(1)) of a meta model given weights=:
    {name: (still a DTensor, its whole value equals the file's)}."""
    model = on_meta(build)
    parallelize_module(model, mesh["tp"], plan())
    frozen = ["blocks.0.fc1.weight", "blocks.0.fc2.weight"]
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    zerodp.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), CONFIG,
                      device_mesh=mesh, weights=path)
    whole, params = dict(build().named_parameters()), dict(model.named_parameters())
    return {n: (isinstance(params[n], DTensor), torch.equal(params[n].full_tensor(), whole[n].detach()))
            for n in frozen}


def on_meta(build: Callable[..., nn.Module], own_seed: bool = False) -> nn.Module:
    """build() on meta, seeded as the reference's build: the initialisers draw from that state. With
    `own_seed` every rank but 0 is then in another random state: the values must still be rank 0's, on
    every tp rank (a dp group's rank 0 is not the world's)."""
    with torch.device("meta"):
        model = build()
    if own_seed:
        torch.manual_seed(dist.get_rank())
    return model


class Spy:
    """open_weights' source for the file at `path`, counting the elements each parameter's reads return
    (`read`), beside each parameter's (local, whole) numel (`sizes`)."""

    def __init__(self, path: str):
        self.path = path
        self.read: dict[str, int] = {}
        self.sizes: dict[str, tuple[int, int]] = {}

    def open(self, model: nn.Module):
        self.sizes = {n: ((p.to_local() if isinstance(p, DTensor) else p).numel(), p.numel())
                      for n, p in model.named_parameters()}
        source = open_weights(self.path, model)
        for method in ("read", "read_box"):
            setattr(source, method, self._counted(getattr(source, method)))
        return source

    def _counted(self, call):
        def read(name, *where):
            out = call(name, *where)
            self.read[name] = self.read.get(name, 0) + out.numel()
            return out
        return read


class Mpu:
    def __init__(self, mesh: DeviceMesh):
        self.dp, self.tp = mesh.get_group("dp"), mesh.get_group("tp")

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.tp


