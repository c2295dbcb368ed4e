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
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from zerodp.distributed.comm import Comm


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
                             "parallelize the model over mesh['tp'] of the mesh zerodp is given")
        if not all(pl.is_shard() or pl.is_replicate() for pl in p.placements):
            raise ValueError(f"parameter '{name}' has placements {tuple(p.placements)}; a tensor-parallel "
                             "parameter must be Shard or Replicate over the 'tp' dimension")
    if comm.tp is not None and comm.tp_mesh is None and (from_source or any(p.is_meta for p in module.parameters())):
        raise TensorParallelUnsupported(
            "weights= and models built on the 'meta' device are not supported with an mpu (tensor parallelism by "
            "plain local shards): zerodp cannot tell which part of the whole tensor each rank's shard is. Build the "
            "model with its values, or parallelize it with torch's parallelize_module and pass device_mesh= instead")


def refuse(comm: Comm, what: str) -> None:
    """Raise, on every rank alike, that `what` does not support tensor parallelism yet."""
    if comm.tp is not None:
        raise TensorParallelUnsupported(
            f"{what} is not supported with tensor parallelism (a device_mesh with a 'tp' dimension, or an mpu) yet: it "
            "would write or return each rank's local tensor-parallel shard under the whole parameter's name. "
            "Read the weights inside `with engine.gathered_parameters():` (a DTensor's p.full_tensor(), on every rank)")


def _ranks(mesh) -> list:
    return mesh.mesh.tolist()

