"""ZeRO over the data-parallel dimension of a tensor-parallel model: what zerodp checks at set-up, and
what it refuses.

The user parallelizes the model first, with torch's own `parallelize_module(model, mesh["tp"], plan)`,
and gives zerodp the whole mesh (`device_mesh=`, its dimensions named "dp" and "tp"). Each rank then
partitions its *local* tensor-parallel shard of every parameter over its dp group (flat.local /
flat.set_local: the module keeps its DTensor parameters); stage 3 gathers over dp only; the step's
norm, skip decision, loss scale and used bits are agreed over every rank of the world
(Comm.everyone), each tp shard's gradient summed over the tp group and each parameter that the tp
ranks hold alike counted once (flat.tp_duplicate, PartitionedOptimizer.tp_counted). ZeRO-Offload needs
nothing of its own: its host masters are those dp shards, and the norm is taken on the device. A model
built on meta (meta DTensors) gets each rank's local shard, read out of whole values (weights= files of
the whole model, or the modules' initialisers): engine/setup/tp_shards.py.

A Megatron-style model, split by hand into plain local shards, comes with an `mpu` instead (Comm's
mpu_groups): the same engine, its parameters marked `tensor_model_parallel` / `model_parallel` where
they are tp shards (flat.tp_duplicate), and no mesh. Its plain shards do not say where they lie in the
whole tensor: weights= and meta are refused there.

The exports (engine/sharding/weights.py) join each tp shard into the whole tensor along `shard_dim`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import tp_duplicate


class TensorParallelUnsupported(NotImplementedError):
    """A zerodp feature that does not yet work on a tensor-parallel model: refused, never silently wrong."""


def check(module: nn.Module, comm: Comm, from_source: bool) -> None:
    """Local checks (no collective): the model's DTensor parameters live on the mesh's "tp" dimension, and
    the set-up uses nothing that tensor parallelism does not support yet. Raises naming what is wrong."""
    dtensors = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if dtensors and comm.tp_mesh is None:
        name, p = dtensors[0]
        raise ValueError(f"parameter '{name}' is a DTensor (tensor parallel, on mesh {_ranks(p.device_mesh)}), but "
                         "zerodp.initialize was given no device_mesh with a 'tp' dimension: pass the mesh whose "
                         "'tp' dimension the model was parallelized over, e.g. init_device_mesh(device, (dp, tp), "
                         "mesh_dim_names=('dp', 'tp')) and parallelize_module(model, mesh['tp'], plan)")
    for name, p in dtensors:
        if _ranks(p.device_mesh) != _ranks(comm.tp_mesh) or p.device_mesh.device_type != comm.tp_mesh.device_type:
            raise ValueError(f"parameter '{name}' is a DTensor on mesh {_ranks(p.device_mesh)} "
                             f"({p.device_mesh.device_type}), but this rank's 'tp' dimension of the device_mesh "
                             f"given to zerodp is {_ranks(comm.tp_mesh)} ({comm.tp_mesh.device_type}): "
                             "parallelize the model over mesh['tp'] of the mesh zerodp is given (a Hugging Face model "
                             "loaded with a distributed_config or tp_plan is split over a mesh of transformers' own: "
                             "load it whole and apply its plan on mesh['tp'], docs/CONFIG.md 'Tensor parallelism')")
        # _StridedShard: each part of a fused Linear (q | k | v side by side) split over tp, as Megatron does.
        if not all(pl.is_shard() or pl.is_replicate() or isinstance(pl, _StridedShard) for pl in p.placements):
            raise ValueError(f"parameter '{name}' has placements {tuple(p.placements)}; a tensor-parallel "
                             "parameter must be Shard (or _StridedShard) or Replicate over the 'tp' dimension")
    _check_something_is_split(module, comm)
    building = from_source or any(p.is_meta for p in module.parameters())
    strided = [n for n, p in dtensors if any(isinstance(pl, _StridedShard) for pl in p.placements)]
    if building and strided:  # its shard is `parts` blocks of the whole tensor, not the one box tp_shards reads
        raise TensorParallelUnsupported(
            f"parameter '{strided[0]}' is split part by part over tp (_StridedShard: a fused q | k | v), which "
            "weights= and models built on the 'meta' device do not support yet: build the model with its values, "
            "parallelize it, then call zerodp.initialize")
    if comm.tp is not None and comm.tp_mesh is None and building:
        raise TensorParallelUnsupported(
            "weights= and models built on the 'meta' device are not supported with an mpu (tensor parallelism by "
            "plain local shards): zerodp cannot tell which part of the whole tensor each rank's shard is. Build the "
            "model with its values, or parallelize it with torch's parallelize_module and pass device_mesh= instead")


def _check_something_is_split(module: nn.Module, comm: Comm) -> None:
    """A tp group of several ranks over a model none of whose parameters is split over it would train
    correctly but tp-fold redundantly: every tp rank the same whole model on the same batch."""
    if comm.tp is None or comm.tp.world_size == 1 or not all(tp_duplicate(p) for p in module.parameters()):
        return
    given = ("the device_mesh's 'tp' dimension" if comm.tp_mesh is not None else "the mpu's tensor-parallel group")
    raise ValueError(f"{given} has {comm.tp.world_size} ranks, but no parameter of the model is split over it (no "
                     "DTensor parameter with a Shard placement, none marked tensor_model_parallel / model_parallel): "
                     "each tp rank would train the same whole model. Parallelize the model first "
                     "(parallelize_module(model, mesh['tp'], plan), or mark Megatron's shards), or give a mesh "
                     "without a 'tp' dimension")


def _ranks(mesh) -> list:
    return mesh.mesh.tolist()


def shard_dim(name: str, p: torch.Tensor, ndim: int) -> int | None:
    """The dimension along which the tp ranks' shards of `p` (state_dict entry `name`, `ndim` dimensions:
    a stage-3 parameter's own tensor is empty between uses) join into the whole tensor; None when every tp
    rank holds it whole (flat.tp_duplicate). A DTensor's placement says it (Shard(d)); a Megatron-marked
    plain shard its `partition_dim`. Raises for a marked shard that does not say, or that is split with a
    stride (its shards interleave: no single join restores it)."""
    if tp_duplicate(p):
        return None
    if isinstance(p, DTensor):
        return p.placements[0].dim % ndim
    marking = "tensor_model_parallel" if getattr(p, "tensor_model_parallel", False) else "model_parallel"
    dim = getattr(p, "partition_dim", None)
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"cannot join parameter '{name}' into the whole tensor: it is marked as this rank's "
                         f"tensor-parallel shard ({marking}=True) but its partition_dim is {dim!r}, so the "
                         "dimension its tp shards join along is unknown. Set p.partition_dim (Megatron's "
                         "attribute: 0 for a column-parallel weight and bias, 1 for a row-parallel weight), "
                         "or read each rank's shard inside `with engine.gathered_parameters():`")
    if getattr(p, "partition_stride", 1) != 1:
        raise ValueError(f"cannot join parameter '{name}' into the whole tensor: its partition_stride is "
                         f"{p.partition_stride}, a strided split whose tp shards interleave; only "
                         "partition_stride=1 is supported")
    return dim % ndim
