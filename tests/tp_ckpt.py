"""Rank-side code of the tensor-parallel checkpoint tests (test_tp_ckpt.py).

`saves` joins test_tensor_parallel's one 4-rank launch: it trains the oracle's model for SAVE_AT steps at
(dp 2, tp 2) and saves it (DTensor at stages 2 and 3, Megatron-style mpu with partition_dim, an mpu without
it), records which ranks wrote the manifest, and fails a save on one tp rank. `resumes` is the one 2-rank
launch at (dp 1, tp 2): each checkpoint resumed with gradient accumulation 2 and trained to the end, and
resumes on another tp size in both directions.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from test_tensor_parallel import (
    BATCH,
    CLIP,
    STEPS,
    ParallelState,
    SplitLinear,
    build,
    config,
    data,
    error_text,
    optimizer,
    plan,
    split_by_hand,
)

import zerodp
from zerodp.checkpoint import files

SAVE_AT = 2  # steps trained before the save; the resumed run trains the rest, to STEPS


def reference_upto(steps: int) -> dict[str, torch.Tensor]:
    """test_tensor_parallel.reference's whole weights after `steps` steps."""
    model = build()
    opt = optimizer(model)
    for step in range(steps):
        model(*data(step)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _dtensor_engine(mesh, stage: int, gas: int = 1):
    model = build()
    parallelize_module(model, mesh["tp"], plan())
    return model, zerodp.initialize(model, optimizer(model), _config(stage, mesh, gas), device_mesh=mesh)


def _mpu_engine(mesh, marking: str, partition_dim: bool, gas: int = 1):
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    model = split_by_hand(build(), tp_group, marking)
    if partition_dim:  # Megatron's attributes: the axis its shards join along
        for m in model.modules():
            if isinstance(m, SplitLinear):
                for p in m.parameters():
                    if getattr(p, marking, False):
                        p.partition_dim, p.partition_stride = (0 if m.column else 1), 1
    return model, zerodp.initialize(model, optimizer(model), _config(2, mesh, gas),
                                    mpu=ParallelState(dp_group, tp_group))


def _config(stage: int, mesh, gas: int) -> dict:
    dp = mesh["dp"].size()
    return {**config(stage, dp), "train_micro_batch_size_per_gpu": BATCH // dp // gas,
            "gradient_accumulation_steps": gas}


def _train(engine, mesh, steps: range, gas: int = 1) -> None:
    """Steps `steps` of the oracle's run: this dp rank's part of each batch, in `gas` micro-batches."""
    if mesh is None:  # no tp: the world is the dp group
        dp, dp_rank = dist.get_world_size(), dist.get_rank()
    else:
        dp, dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")
    micro = BATCH // dp // gas
    for step in steps:
        x, y = data(step)
        for m in range(gas):
            at = slice(dp_rank * (BATCH // dp) + m * micro, dp_rank * (BATCH // dp) + (m + 1) * micro)
            engine.backward(engine(x[at], y[at]))
            engine.step()


def _whole(model) -> dict[str, torch.Tensor]:
    with_mpu = any(isinstance(m, SplitLinear) for m in model.modules())
    out = {}
    if with_mpu:
        for name, m in model.named_modules():
            if isinstance(m, SplitLinear):
                out.update({f"{name}.{k}": v for k, v in m.whole().items()})
    out.update({n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                for n, p in model.named_parameters() if n not in out})
    return out


def _shared_dir() -> str:
    box = [tempfile.mkdtemp(prefix="zerodp-tp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


def saves(mesh) -> dict:
    """At (dp 2, tp 2): the checkpoints that `resumes` reads, and who wrote each manifest."""
    root, rank = _shared_dir(), dist.get_rank()
    calls = {"prepare": 0, "finish": 0}
    real = {k: getattr(files, k) for k in calls}

    def counting(kind):
        def call(*args, **kw):
            calls[kind] += 1
            return real[kind](*args, **kw)
        return call
    out = {"dir": root}
    try:
        for k in calls:
            setattr(files, k, counting(k))
        for stage in (2, 3):
            model, engine = _dtensor_engine(mesh, stage)
            _train(engine, mesh, range(SAVE_AT))
            engine.save_checkpoint(os.path.join(root, f"dtensor{stage}"))
        out["writes"] = dict(calls)
        # One tp rank's bad client_state: every rank of the world raises, nothing is written.
        bad = {"x": object()} if rank == 3 else {}
        out["one rank fails"] = error_text(lambda: engine.save_checkpoint(os.path.join(root, "failed"),
                                                                           client_state=bad))
        out["failed dir"] = sorted(os.listdir(os.path.join(root, "failed"))) if os.path.isdir(
            os.path.join(root, "failed")) else []
    finally:
        for k, f in real.items():
            setattr(files, k, f)
    model, engine = _mpu_engine(mesh, "tensor_model_parallel", partition_dim=True)
    _train(engine, mesh, range(SAVE_AT))
    engine.save_checkpoint(os.path.join(root, "mpu"))
    model, engine = _mpu_engine(mesh, "model_parallel", partition_dim=False)
    engine.save_checkpoint(os.path.join(root, "mpu_no_dim"))
    return out


def _frozen_shard(mesh, root: str) -> dict[str, bool]:
    """A frozen tp shard (no master: saved whole per tp rank, `model/{name}@tp{r}`) saved at tp 2 and loaded
    into models whose value of it differs, at tp 2 and without tp."""
    def frozen(tp: bool, shift: float):
        model = build()
        model.blocks[0].fc1.weight.requires_grad_(False)
        model.blocks[0].fc1.weight.data.add_(shift)
        if tp:
            parallelize_module(model, mesh["tp"], plan())
        return model, zerodp.initialize(model, optimizer(model), config(2, 2 if not tp else 1),
                                        device_mesh=mesh if tp else None)
    want = build().blocks[0].fc1.weight.detach()
    _, engine = frozen(True, 0.0)
    engine.save_checkpoint(os.path.join(root, "frozen"))
    out = {}
    for tp in (True, False):
        model, engine = frozen(tp, 1.0)
        engine.load_checkpoint(os.path.join(root, "frozen"))
        w = model.blocks[0].fc1.weight
        out[f"tp {2 if tp else 1}"] = torch.equal(w.full_tensor() if isinstance(w, DTensor) else w.detach(), want)
    return out


def resumes(rank: int, world: int, root: str) -> dict:
    """At (dp 1, tp 2) with gradient accumulation 2: each checkpoint resumed and trained to STEPS; and
    on another tp size, both ways."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for stage in (2, 3):
        model, engine = _dtensor_engine(mesh, stage, gas=2)
        engine.load_checkpoint(os.path.join(root, f"dtensor{stage}"))
        out[f"steps dtensor{stage}"] = engine.global_steps
        _train(engine, mesh, range(SAVE_AT, STEPS), gas=2)
        with engine.gathered_parameters():
            out[f"dtensor{stage}"] = _whole(model)
    model, engine = _mpu_engine(mesh, "tensor_model_parallel", partition_dim=True, gas=2)
    engine.load_checkpoint(os.path.join(root, "mpu"))
    _train(engine, mesh, range(SAVE_AT, STEPS), gas=2)
    with engine.gathered_parameters():
        out["mpu"] = _whole(model)
    # Another tp size: the (dp 2, tp 2) checkpoint resumed without tp (dp 2), saved again there (at step
    # SAVE_AT still) and that resumed with tp 2: both trained to the end.
    plain = build()
    plain_engine = zerodp.initialize(plain, optimizer(plain), config(2, 2))
    plain_engine.load_checkpoint(os.path.join(root, "dtensor2"))
    plain_engine.save_checkpoint(os.path.join(root, "plain"))
    _train(plain_engine, None, range(SAVE_AT, STEPS))
    out["tp 2 into tp 1"] = _whole(plain)
    model, engine = _dtensor_engine(mesh, 2, gas=2)
    engine.load_checkpoint(os.path.join(root, "plain"))
    _train(engine, mesh, range(SAVE_AT, STEPS), gas=2)
    with engine.gathered_parameters():
        out["tp 1 into tp 2"] = _whole(model)
    out["no axis into tp 1"] = error_text(lambda: plain_engine.load_checkpoint(os.path.join(root, "mpu_no_dim")))
    out["frozen shard"] = _frozen_shard(mesh, root)
    deepspeed = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed", "stage2_fp32")
    out["deepspeed into tp"] = error_text(lambda: engine.load_checkpoint(deepspeed))
    import tp_titan

    out["titan"] = tp_titan.resume(root)  # torchtitan's plan: saved at (dp 2, tp 2), resumed at (dp 1, tp 2)
    out["titan muon"] = tp_titan.resume_muon(root)  # Muon's whole-matrix states: (dp 2, tp 2) into (dp 2, no tp)
    return out
