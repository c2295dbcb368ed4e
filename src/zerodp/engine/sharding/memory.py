"""Per-rank memory, measured: `memory_report(sharded, trained, ...)` (engine.memory_report(), and a sharded
module's own) counts the bytes of the tensors the model and its training part own, by category. What DESIGN.md's table predicts is plan/formulas.py (`formula`);
`zerodp estimate` puts the two side by side for any world size.

Facts of the engine that the table leaves out, reported rather than hidden:
  * gradients are kept in the working dtype only with gradient_accumulation_steps == 1; with more
    micro-steps they accumulate in fp32 (stage 1: 4Ψ, stage 2: 4Ψ/N instead of 2Ψ and 2Ψ/N);
  * in mixed precision the optimizer step makes an fp32 copy of the gradient shard, sub_group_size
    elements at a time (at most 4 x sub_group_size bytes), freed after each part of the step:
    `step_transient`, not part of model_states; with offload the casts run on the host, through a
    staging shard in the working dtype (2 bytes per element in bf16, host memory: offload_staging);
  * pinned host memory is rounded up to a power of two by torch's host allocator; offload pins one
    block (masters, gradients, staging), whose rounding is `offload_pinned_rounding`;
  * gradients exist from the first one of an accumulation window to the end of its step (like
    zero_grad(set_to_none=True)), and stage 2's reduce buffers only during backward: both are
    counted in full here, as what the rank holds while they exist;
  * where the collective plan (distributed/plan.py) does the gradient reduce-scatter as an all-reduce, the
    whole reduce bucket is summed, not one shard of it: `reduce_whole_bucket` is what that holds beyond the
    shard for the largest such bucket (N-1 shards of it). It lies in the reduce bucket the reducer holds
    anyway (reduce_buckets), so it is stated, not added; the all-gather as all-reduce sums in place in the
    gathered bucket and holds nothing more.
"""

from __future__ import annotations

import torch

from zerodp.activations import attached
from zerodp.distributed.device import is_accelerator, max_memory_allocated, max_memory_reserved, memory_allocated
from zerodp.engine.layout.formats import quant_state_tensors

MODEL_STATES = ("working_params", "frozen_params", "frozen_params_and_buffers", "quant_state", "gradients",
                "fp32_master", "master_remainders", "optimizer_states")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_report(sharded, trained: dict[str, int] | None = None, optimizer_on_host: bool = False
                  ) -> dict[str, int]:
    """Bytes this rank holds, by category, counted from the tensors a sharded module owns (its layout and,
    at stage 3, the gathered copies) and `trained`: what its training part holds (Training.bytes: gradients,
    reduce buckets, fp32 master, optimizer states, the step's transient copy; none for a frozen model), in
    host memory when `optimizer_on_host` (ZeRO-Offload).

    model_states = working params (flat buffers, padding included) + frozen params (stage 3's shards) + frozen
    params kept whole and buffers + quant_state (bitsandbytes' quantisation state, its per-block part 1/N at
    stage 3) + gradients + fp32 master + optimizer states, wherever they live; with ZeRO-Offload the host part is
    also given as host_model_states (it includes the host gradient copy, offload_gradients, and in
    mixed precision the working-dtype staging shards, offload_staging) and the rest as
    device_model_states; offload_pinned_rounding is what the host allocator adds to the pinned block. With
    offload_optimizer "nvme" the masters and states are disk_model_states instead (nvme_file: the file's bytes,
    slots rounded to 4096), and host_model_states holds the buffers they stream through (nvme_host_buffers).
    With offload_param "nvme" (on_disk.py) the parameter shards (working_params, frozen_params) are counted as
    params_on_disk (in disk_model_states) and params_in_cpu (the max_in_cpu shards kept in host memory), beside
    the file's bytes (nvme_param_file) and the host buffers they pass through (nvme_param_buffers, in
    host_model_states).
    Reduce buckets, the step's transient fp32 gradient copy and checkpointed activations are listed beside it;
    CUDA allocator figures when on CUDA. Stage 3's gathered copies: gathered_params (the buckets gathered now)
    and gather_pool_idle (host memory the gather pool keeps for the next gathers, sharding/pool.py; 0 on an
    accelerator, whose caching allocator keeps it).
    """
    layout, module, spec = sharded.layout, sharded.module, sharded.spec
    flat = {**layout.by_param(), **layout.by_frozen_param()}
    untrained = {id(t): t for t in list(module.parameters()) + list(module.buffers()) if id(t) not in flat}
    sharded_state, whole_state = _quant_state(sharded, flat)  # (stage 3's shard of the per-block part, the rest)
    report = {
        "working_params": sum(_shards_bytes(g) for g in layout.groups),
        # stage 3: this rank's shards of the frozen parameters (padding included); whole ones are below
        "frozen_params": sum(_shards_bytes(g) for g in layout.frozen) - sharded_state,
        "frozen_params_and_buffers": sum(_nbytes(t) for t in untrained.values()),
        "quant_state": sharded_state + whole_state,
        "gradients": 0, "fp32_master": 0, "master_remainders": 0, "optimizer_states": 0, "reduce_buckets": 0,
        **(trained or {}),
    }
    # Stage 3: the gathered copies held right now (persistent buckets between steps), and the memory kept
    # for gathers that none uses now (host memory: the pool's idle slots, sharding/pool.py)
    report["gathered_params"], report["gather_pool_idle"] = sharded.gathered_bytes()
    report.setdefault("step_transient", 0)
    report.setdefault("reduce_whole_bucket", 0)  # a frozen model reduces nothing
    report["model_states"] = sum(report[k] for k in MODEL_STATES)
    if sharded.on_disk is not None:
        report.update(sharded.on_disk.bytes())
    _placed(report, spec.offload_param, optimizer_on_host)
    checkpointer = attached(module)
    if checkpointer is not None:
        report.update(checkpointer.bytes())
    if is_accelerator(spec.device):  # the keys keep their first accelerator's name on every one
        report["cuda_allocated"] = memory_allocated(spec.device)
        report["cuda_peak_allocated"] = max_memory_allocated(spec.device)
        report["cuda_peak_reserved"] = max_memory_reserved(spec.device)
    return report


def _shards_bytes(g) -> int:
    """A flat group's bytes of this rank's shards: its flat buffer, or (offload_param "nvme", which has none)
    its buckets' shards."""
    if g.data is not None:
        return _nbytes(g.data)
    return sum(b.shard_numel * b.owned.element_size() for b in g.buckets if b.owned is not None)


def _placed(report: dict[str, int], offload_param: bool, optimizer_on_host: bool) -> None:
    """host_model_states, disk_model_states and device_model_states where anything is offloaded (see memory_report)."""
    on_disk = "nvme_file" in report  # offload_optimizer "nvme": the masters and states are in the rank's file
    params_on_disk = "nvme_param_file" in report  # offload_param "nvme": the parameter shards are in a file
    in_host = offload_param and not params_on_disk  # stage 3's offload_param "cpu"
    host = {"fp32_master": optimizer_on_host and not on_disk, "master_remainders": False,
            "optimizer_states": optimizer_on_host and not on_disk, "working_params": in_host, "frozen_params": in_host}
    if not (any(host.values()) or on_disk or params_on_disk):
        return
    # ZeRO-Offload: these live in host memory (with a host gradient copy), or on disk through host buffers
    report["host_model_states"] = (sum(report[k] for k, on in host.items() if on)
                                   + report.get("offload_gradients", 0) + report.get("offload_staging", 0)
                                   + report.get("nvme_host_buffers", 0) + report.get("params_in_cpu", 0)
                                   + report.get("nvme_param_buffers", 0))
    off_device = sum(report[k] for k, on in host.items() if on) + report.get("params_in_cpu", 0)
    if on_disk or params_on_disk:
        report["disk_model_states"] = ((report["fp32_master"] + report["optimizer_states"] if on_disk else 0)
                                       + report.get("params_on_disk", 0))
        off_device += report["disk_model_states"]
    report["device_model_states"] = report["model_states"] - off_device


def _quant_state(sharded, flat: dict[int, object]) -> tuple[int, int]:
    """Bytes of bitsandbytes' quantisation state on this rank: (stage 3's shards of its per-block part,
    formats.block_state, which lie in the frozen groups' shards, padding not counted; the rest, whole on every
    rank beside the words: the codes, and at stages 0-2 everything). `flat`: ids of the tensors the layout holds."""
    layout, state = sharded.layout, {id(t) for ts in sharded.block_state.values() for t in ts}
    shards = sum((hi - lo) * b.owned.element_size() for b in layout.frozen_buckets
                 for _, s, lo, hi in layout.owned_slots(b) if id(s.param) in state)
    return shards, sum(_nbytes(t) for t in quant_state_tensors(sharded.module) if id(t) not in flat)


def whole_parameter_shares(owned: list[int], rank: int, state_bytes: int) -> dict[str, int]:
    """Where parameters are stepped whole (optimizer_view.py), each rank's share of the masters and optimizer
    states is whole parameters, so the shares differ: `owned` is each rank's parameter elements. Returns this
    rank's state bytes, 1/N of all ranks' (at this rank's bytes per element), and how far the worst rank's
    share is above 1/N."""
    per_element = state_bytes / owned[rank] if owned[rank] else 0.0
    fair = sum(owned) / len(owned)
    return {"state_bytes_this_rank": state_bytes, "state_bytes_one_nth": round(fair * per_element),
            "state_bytes_worst_rank_excess": round((max(owned) - fair) * per_element)}
