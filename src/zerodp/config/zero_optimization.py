"""DeepSpeed's `zero_optimization` section: the ZeRO stage, bucket sizes, stage 3's units and
thresholds, offload, hierarchical sharding (MiCS), and DeepSpeed's other keys of the section, each
implemented, without effect here, or refused (keys.py says which and why)."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from zerodp.config.base import ConfigError, NonNegativeInt, PositiveInt, _Section
from zerodp.sizes import REDUCE_BUCKET_SIZE  # ZeroConfig.reduce_bucket_size's default (why: there)


class _OffloadConfig(_Section):
    """What offload_optimizer and offload_param share: where, and pinned host buffers."""

    device: Literal["none", "cpu", "nvme"] = "none"
    pin_memory: bool = True


class OffloadOptimizerConfig(_OffloadConfig):
    """ZeRO-Offload ("cpu": host memory) or ZeRO-Infinity's disk tier ("nvme": this rank's fp32 masters and
    optimizer states in a scratch file under nvme_path, streamed through buffer_count host buffers, one
    sub_group_size sub-group at a time; engine/stepping/disk.py). nvme_path is read only with "nvme", as in
    DeepSpeed."""

    nvme_path: str | None = None
    # "nvme": the most sub-group-sized fp32 buffers the host pool holds (a sub-group in flight takes 2 + S:
    # master, gradient and the optimizer's S per-element states; DeepSpeed's 4 is Adam's one sub-group)
    buffer_count: PositiveInt = 4
    pipeline_read: bool = False  # "nvme": read the next sub-group(s) while one steps
    pipeline_write: bool = False  # "nvme": write a stepped sub-group back while the next one steps
    fast_init: bool = False  # "nvme": reserve the file's blocks only (fallocate), not write the states' zeros
    ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    super_offload: bool = False
    cpuadam_cores_perc: Annotated[float, Field(ge=0, le=1)] = 0.8


class OffloadParamConfig(_OffloadConfig):
    """Stage 3's parameter shards in host memory ("cpu", DeepSpeed's offload_param: each gather copies the
    rank's shard to the device first), or on disk ("nvme": in a scratch file of the rank's under nvme_path,
    read ahead of each gather through buffer_count host buffers; engine/sharding/on_disk.py). nvme_path,
    buffer_count, buffer_size and max_in_cpu are read only with "nvme", as in DeepSpeed."""

    nvme_path: str | None = None
    # "nvme": host buffers of one bucket's shard each: one in use, the others read ahead or being written
    buffer_count: NonNegativeInt = 5
    # "nvme": the most elements a buffer holds; a larger shard on disk is refused at initialize (the buffers
    # are allocated at the largest shard's size, at most this)
    buffer_size: NonNegativeInt = 100_000_000
    # "nvme": elements of shards kept in host memory for good (the first buckets'), never in the file
    max_in_cpu: NonNegativeInt = 1_000_000_000


class ZeroConfig(_Section):
    stage: Annotated[int, Field(ge=0, le=3)] = 0
    # Elements, not bytes, as in DeepSpeed. Smaller than DeepSpeed's 5e8 default: a model under the
    # bucket size is one bucket, whose reduction cannot start before backward ends (no overlap), and
    # the stage-2 bucket pool would then be a whole-model gradient. Left unset on gloo, buckets hold about 1/8 of
    # the model instead (engine/layout/layout.py, bucket_numel).
    reduce_bucket_size: PositiveInt = REDUCE_BUCKET_SIZE
    allgather_bucket_size: PositiveInt = 500_000_000
    overlap_comm: bool = True
    # Stages 1-2: step() returns with the updated parameters still being all-gathered, and the next
    # forward waits for each bucket just before its first use (Megatron's overlap_param_gather).
    # Off by default: parameters read directly between step() and the next forward would be stale;
    # engine.wait_for_parameters() makes them current.
    overlap_param_gather: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    load_from_fp32_weights: bool = True
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    stage3_prefetch_bucket_size: NonNegativeInt = 50_000_000
    stage3_param_persistence_threshold: NonNegativeInt = 100_000
    # zerodp's own key: what stage 3 gathers, releases and reduces as one unit (engine/layout/units.py):
    # "blocks" (the model's repeated children, and the model for the rest), "module" (every module
    # that registers parameters), or a list of module class names or module names.
    stage3_unit: Literal["blocks", "module"] | Annotated[list[str], Field(min_length=1)] = "blocks"
    stage3_max_live_parameters: NonNegativeInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegativeInt = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    # Elements of the master shard stepped per optimizer.step() call in mixed precision: bounds the
    # step's fp32 copy of the gradients to 4 x this many bytes (0.4 GB; DeepSpeed's default is 1e9,
    # which at one rank would put 4 GB on top of the gradients).
    sub_group_size: PositiveInt = 100_000_000
    # zerodp's own key. false (PyTorch's semantics): a parameter that got no gradient on any rank in
    # the accumulation window is not stepped; it, its master and its optimizer state stay as they were
    # (unused.py). true: DeepSpeed's behaviour, every parameter is stepped, the unused ones with a zero
    # gradient (AdamW then decays them and their moments).
    step_unused_parameters: bool = False

    @model_validator(mode="after")
    def _old_cpu_offload(self) -> ZeroConfig:
        if self.cpu_offload:
            if "offload_optimizer" in self.model_fields_set:
                raise ValueError("cpu_offload (DeepSpeed's old key) and offload_optimizer are both given; "
                                 "keep only offload_optimizer")
            self.offload_optimizer = OffloadOptimizerConfig(device="cpu")
        return self

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> ZeroConfig:
        if self.offload_optimizer.device == "nvme" and not self.offload_optimizer.nvme_path:
            raise ValueError("offload_optimizer.device \"nvme\" needs offload_optimizer.nvme_path: a directory on "
                             "the disk where each rank keeps its optimizer states' scratch file")
        return self

    @model_validator(mode="after")
    def _param_nvme_needs_a_path_and_a_buffer(self) -> ZeroConfig:
        off = self.offload_param
        if off.device == "nvme" and not off.nvme_path:
            raise ValueError("offload_param.device \"nvme\" needs offload_param.nvme_path: a directory on the disk "
                             "where each rank keeps its parameter shards' scratch file")
        if off.device == "nvme" and off.buffer_count < 1:
            raise ValueError("offload_param.buffer_count 0 with device \"nvme\": the shards on disk pass through "
                             "host buffers; set buffer_count to at least 1 (2 or more to read ahead)")
        return self

    @model_validator(mode="after")
    def _offload_param_below_stage3_is_ignored(self) -> ZeroConfig:
        # DeepSpeed's stages 0-2 never read offload_param and train with every parameter on the device;
        # DeepSpeed-Chat's configs set it together with offload_optimizer at any stage. So do the same,
        # saying so once: the section is reset, and the engine and its set-up line see no offload.
        if self.offload_param.device != "none" and self.stage != 3:
            logging.getLogger("zerodp").warning(
                "zero_optimization.offload_param is ignored at stage %d, as DeepSpeed ignores it: only stage 3 "
                "partitions parameters, so they stay on the device; use stage 3 to offload them, or remove "
                "the section", self.stage)
            self.offload_param = OffloadParamConfig()
        return self

    # Hierarchical sharding (DeepSpeed's MiCS names): model states sharded within groups of this
    # many consecutive ranks and replicated across world / mics_shard_size groups (comm.py);
    # -1 (DeepSpeed's default) or the world size: one flat group. Checked against the world in
    # Engine (shard_size_for), where the world size is known.
    mics_shard_size: Annotated[int, Field(ge=-1)] = -1
    mics_hierarchical_params_gather: bool = False
    zero_hpz_partition_size: NonNegativeInt = 1  # refused above 1 (keys.REFUSED)

    def shard_size(self, world_size: int) -> int:
        """S, the ranks one copy of the model states is sharded over, checked against the world."""
        s = self.mics_shard_size
        if s in (-1, world_size):
            return world_size
        if self.stage == 0:
            raise ConfigError(f"zero_optimization.mics_shard_size {s} shards model states, which stage 0 "
                              "does not do; use stage 1, 2 or 3, or remove the key")
        if not 1 <= s <= world_size or world_size % s:
            raise ConfigError(f"zero_optimization.mics_shard_size {s} must divide the world size "
                              f"{world_size} (1 <= S <= {world_size}), or be -1 for one flat group")
        return s

    # DeepSpeed's other keys: see keys.py for what each does here (most: nothing, or refused).
    stage3_gather_fp16_weights_on_model_save: bool = False
    stage3_model_persistence_threshold: NonNegativeInt | None = None
    stage3_module_granularity_threshold: NonNegativeInt = 0
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    use_multi_rank_bucket_allreduce: bool = True
    compute_grad_norm: bool = True
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    parameter_alignment: bool = False
    # DeepSpeed's old name for offload_optimizer {device: cpu}, which it still maps (its zero/config.py);
    # DeepSpeedExamples' configs write it.
    cpu_offload: bool = False
    cpu_offload_params: bool = False
    cpu_offload_use_pin_memory: bool = False
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: dict[str, Any] | None = None
    zenflow: dict[str, Any] | None = None
