"""The process groups zerodp's collectives run on: each group's timeout and its bounded twin, hierarchical
sharding's subgroups, the data-parallel and tensor-parallel groups of a named device mesh or of an mpu.
`Comm` (comm.py) builds on them; nothing here runs a zerodp collective.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from zerodp.distributed import teardown
from zerodp.distributed.failures import message


def group_timeout_s(group: dist.ProcessGroup) -> float | None:
    """The timeout a group's collectives wait (its backend's option); None where torch does not say."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - private API, absent for this device or backend
            continue
    return None


def bounded_group(group: dist.ProcessGroup, timeout_s: float) -> tuple[dist.ProcessGroup, str | None]:
    """(the group zerodp's collectives run on so that each waits at most timeout_s, None) or, where torch
    cannot bound them, (group, the reason in one sentence). Collective over the group's ranks only.

    A group zerodp created (init_distributed) gets the timeout itself; a group of the script's
    keeps its own and gets a twin: one per set of ranks in this process, destroyed at exit (teardown)."""
    if group_timeout_s(group) == timeout_s:
        return group, None
    timeout = timedelta(seconds=timeout_s)
    ranks = tuple(dist.get_process_group_ranks(group))
    owned = group if teardown.owns(group) else teardown.group_of(ranks)
    try:
        if owned is not None:
            dist.distributed_c10d._set_pg_timeout(timeout, owned)
            return owned, None
        # Local synchronization: only these ranks take part (a data-parallel group of a mesh is one of many).
        twin = dist.new_group(list(ranks), timeout=timeout, backend=dist.get_backend(group),
                              use_local_synchronization=True, group_desc=f"zerodp (comm_timeout_s={timeout_s:g})")
    except Exception as e:  # noqa: BLE001 - a backend that takes no timeout: say so, keep the group
        return group, f"{type(e).__name__}: {message(e).splitlines()[0]}"
    teardown.register_group(ranks, twin)
    return twin, None


# The dimension names a device mesh may have, and what each is for.
MESH_ROLES = {"dp": "data parallel: ZeRO partitions over it",
              "dp_shard": "data parallel: ZeRO partitions over it (hierarchical sharding's shard groups)",
              "dp_replicate": "data parallel: each shard is replicated over it (hierarchical sharding)",
              "tp": "tensor parallel: the model was parallelize_module'd over it beforehand"}


def names_roles(mesh) -> bool:
    """Whether the mesh's dimension names give zerodp roles; a mesh without them (no names, or names of
    the user's own such as ("replicate", "shard")) is (replicate, shard) over the data-parallel ranks."""
    return mesh is not None and bool(set(mesh.mesh_dim_names or ()) & set(MESH_ROLES))


def named_mesh_dp_group(mesh, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The data-parallel group of a mesh with named dimensions, after checking the names and that the mesh
    covers the world (the same on every rank, before any collective)."""
    names, world = mesh.mesh_dim_names, dist.get_world_size()
    dp = [n for n in names if n in ("dp", "dp_shard")]
    if (set(names) - set(MESH_ROLES) or len(set(names)) != len(names) or len(dp) != 1
            or ("dp" in names and "dp_replicate" in names)):
        roles = "; ".join(f"{k!r}: {v}" for k, v in MESH_ROLES.items())
        raise ValueError(f"the device mesh's dimension names {names} do not name the roles zerodp knows: give "
                         f"one 'dp' (or 'dp_shard', with an optional 'dp_replicate') and an optional 'tp' "
                         f"({roles}); a 2-D mesh without any of these names is (replicate, shard) over the "
                         "data-parallel ranks")
    if mesh.size() != world:
        raise ValueError(f"the device mesh {dict(zip(names, mesh.shape))} has {mesh.size()} ranks, but the world "
                         f"has {world}: its sizes must multiply to the world size")
    if group is not None:
        raise ValueError("give either process_group or a device_mesh with named dimensions, not both: the "
                         "mesh's data-parallel dimension is the data-parallel group")
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
    return mesh.get_group(dp[0])


# An mpu's methods, in Megatron's parallel_state spelling first, then DeepSpeed's older one.
_MPU_TP_GROUP = ("get_tensor_model_parallel_group", "get_model_parallel_group")


def mpu_groups(mpu, group: dist.ProcessGroup | None, mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(data-parallel group, tensor-parallel group) of a Megatron-style mpu (Megatron's parallel_state or
    DeepSpeed's duck type: get_data_parallel_group() and get_tensor_model_parallel_group() or
    get_model_parallel_group()), after checking, with no collective, that dp x tp ranks are the world."""
    if mesh is not None or group is not None:
        raise ValueError("give either mpu or a device_mesh / process_group, not both: the mpu's data-parallel "
                         "and tensor-parallel groups are the groups zerodp uses")
    get_dp = getattr(mpu, "get_data_parallel_group", None)
    get_tp = next((getattr(mpu, m) for m in _MPU_TP_GROUP if callable(getattr(mpu, m, None))), None)
    if not callable(get_dp) or get_tp is None:
        raise TypeError(f"mpu {type(mpu).__name__} lacks get_data_parallel_group() and one of "
                        f"{' / '.join(m + '()' for m in _MPU_TP_GROUP)}: give Megatron's parallel_state or an "
                        "object with those methods returning process groups")
    dp, tp = get_dp(), get_tp()
    dp_size, tp_size, world = dist.get_world_size(dp), dist.get_world_size(tp), dist.get_world_size()
    if dp_size * tp_size != world:
        raise ValueError(f"the mpu's data-parallel group has {dp_size} ranks and its tensor-parallel group "
                         f"{tp_size}, but the world has {world}: dp x tp must be the world (pipeline "
                         "parallelism is not supported)")
    return dp, tp


def subgroup(ranks: list[list[int]], timeout: timedelta) -> dist.ProcessGroup:
    """This rank's group among `ranks` (every rank creates every group, as torch requires)."""
    mine, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
    return mine
