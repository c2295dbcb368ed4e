"""Typed zerodp configuration: DeepSpeed's JSON keys, validated, with errors that name the key.

This module owns the config schema (one pydantic model per section, keys spelled as in DeepSpeed's
ds_config.json), the batch-size arithmetic (train = micro × accumulation × world), and `load_config`,
the one entry point that turns a dict or a JSON file into a `Config` or raises a `ConfigError` with one
line per problem. The optimizer and scheduler sections live in config_optimizer.py and
config_scheduler.py, the shared base and error wording in config_base.py, and the list of keys that
have no effect here or are refused in config_keys.py (see docs/DEEPSPEED.md).
Validation runs locally and identically on every rank, before any collective: a typo never hangs a job.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

from zerodp.config.base import (  # noqa: F401
    _AUTO,
    ConfigError,
    NonNegativeInt,
    PositiveInt,
    _format_errors,
    _Section,
    _unknown_key,
)
from zerodp.config.keys import NO_EFFECT, REFUSED, refusals  # noqa: F401
from zerodp.config.monitor import (
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zerodp.config.optimizer import OptimizerConfig
from zerodp.config.scheduler import SchedulerConfig


class FP16Config(_Section):
    enabled: bool = False
    loss_scale: Annotated[float, Field(ge=0)] = 0.0  # 0 means dynamic loss scaling
    initial_scale_power: Annotated[int, Field(ge=0, le=64)] = 16
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: Annotated[float, Field(gt=0)] = 1.0
    auto_cast: bool = False
    fp16_master_weights_and_grads: bool = False


class BF16Config(_Section):
    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


class _OffloadConfig(_Section):
    """What offload_optimizer and offload_param share: where, and pinned host buffers."""

    device: Literal["none", "cpu"] = "none"
    pin_memory: bool = True

    @field_validator("device", mode="before")
    @classmethod
    def _no_nvme(cls, device: Any) -> Any:
        if device == "nvme":
            raise ValueError("NVMe offload is not supported by zerodp; use \"cpu\"")
        return device


class OffloadOptimizerConfig(_OffloadConfig):
    nvme_path: str | None = None
    buffer_count: NonNegativeInt = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    super_offload: bool = False
    cpuadam_cores_perc: Annotated[float, Field(ge=0, le=1)] = 0.8


class OffloadParamConfig(_OffloadConfig):
    """Stage 3's parameter shards in host memory (DeepSpeed's offload_param): each gather copies the
    rank's shard to the device first. buffer_count, buffer_size, max_in_cpu and nvme_path size
    DeepSpeed's NVMe buffers, which zerodp does not have: accepted (DeepSpeed's types) with no effect."""

    nvme_path: str | None = None
    buffer_count: NonNegativeInt = 5
    buffer_size: NonNegativeInt = 100_000_000
    max_in_cpu: NonNegativeInt = 1_000_000_000


class NonFiniteConfig(_Section):
    """What a step with a non-finite (nan/inf) global gradient norm leads to: zerodp's own section
    (DeepSpeed has none). Such a step is always skipped on every rank; `policy` "raise" then raises
    zerodp.NonFiniteError once `max_consecutive_skips` steps in a row were skipped, "skip" goes on.
    fp16 overflows while dynamic loss scaling can still lower the scale do not count (engine docs).
    `read_back`: when the host learns of a skip (engine/non_finite.py): "same_step" reads the decision
    in step() (a device sync per step), "next_step" skips on the device and reads it a step later,
    "auto" is next_step on an accelerator where possible."""

    policy: Literal["raise", "skip"] = "raise"
    max_consecutive_skips: PositiveInt = 3
    read_back: Literal["auto", "same_step", "next_step"] = "auto"


# ZeroConfig.reduce_bucket_size's default (why: there); `zerodp estimate` keeps a torch-free copy,
# estimate.DEFAULT_BUCKET, that a test holds equal to it.
REDUCE_BUCKET_SIZE = 50_000_000


class ZeroConfig(_Section):
    stage: Annotated[int, Field(ge=0, le=3)] = 0
    # Elements, not bytes, as in DeepSpeed. Smaller than DeepSpeed's 5e8 default: a model under the
    # bucket size is one bucket, whose reduction cannot start before backward ends (no overlap), and
    # the stage-2 bucket pool would then be a whole-model gradient.
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
    # zerodp's own key: what stage 3 gathers, releases and reduces as one unit (engine/units.py):
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
    def _offload_param_needs_stage3(self) -> ZeroConfig:
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(
                f"offload_param is valid only with stage 3 (as in DeepSpeed), not stage {self.stage}: "
                "stages 0-2 keep every parameter whole on every rank; use stage 3 to offload parameters, "
                "or offload_optimizer to move the optimizer state to the CPU")
        return self

    # Hierarchical sharding (DeepSpeed's MiCS names): model states sharded within groups of this
    # many consecutive ranks and replicated across world / mics_shard_size groups (comm.py);
    # -1 (DeepSpeed's default) or the world size: one flat group. Checked against the world in
    # Engine (shard_size_for), where the world size is known.
    mics_shard_size: Annotated[int, Field(ge=-1)] = -1
    mics_hierarchical_params_gather: bool = False
    zero_hpz_partition_size: NonNegativeInt = 1  # refused above 1 (config_keys.REFUSED)

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

    # DeepSpeed's other keys: see config_keys.py for what each does here (most: nothing, or refused).
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


class ParallelWriteConfig(_Section):
    pipeline_stage: bool = False


class CheckpointConfig(_Section):
    """DeepSpeed's `checkpoint` section. Ranks that pass different tags to save_checkpoint always
    fail, on every rank ("Warn" too: such a save could not be read back); "Ignore" is refused."""

    tag_validation: str = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)

    @field_validator("tag_validation")
    @classmethod
    def _tags_always_checked(cls, mode: str) -> str:
        if mode.upper() == "IGNORE":
            raise ValueError("not supported: ranks saving under different tags would write a checkpoint "
                             "that cannot be read back, so tags are always checked; use \"Warn\" or \"Fail\"")
        if mode.upper() not in ("WARN", "FAIL"):
            raise ValueError("expected \"Warn\" or \"Fail\"")
        return mode.capitalize()


class DataTypesConfig(_Section):
    """DeepSpeed's `data_types`. grad_accum_dtype: the dtype gradients are summed in across the
    micro-steps of one accumulation window (None: fp32 when accumulating, else the working dtype)."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None


class ActivationCheckpointingConfig(_Section):
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: PositiveInt | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @model_validator(mode="after")
    def _contiguous_needs_count(self) -> ActivationCheckpointingConfig:
        # The contiguous buffer is sized up front, one slot per checkpoint.
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError("contiguous_memory_optimization: true requires number_checkpoints")
        return self


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int




class Config(_Section):
    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None
    gradient_clipping: Annotated[float, Field(ge=0)] = 0.0  # 0 = off
    steps_per_print: PositiveInt | None = None  # DeepSpeed's default now: no step lines
    wall_clock_breakdown: bool = False
    zero_allow_untested_optimizer: bool = True
    zero_force_ds_cpu_optimizer: bool = True
    # DeepSpeed's reduction: prescale divides gradients by the world size before the sum; a predivide
    # factor f divides by f before and by world / f after. Unset: as DeepSpeed, stage 0 sums and then
    # divides (f = 1), stages 1-3 divide by the world size first (its reduce-scatter path). reducer.py.
    prescale_gradients: bool = False
    gradient_predivide_factor: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    # The dtype gradients travel and are summed in (None: the working dtype), e.g. "fp32" to reduce
    # bf16 gradients in fp32, as torchtitan's and Megatron's fp32 reduction.
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    dump_state: bool = False
    disable_allgather: bool = False
    sparse_gradients: bool = False
    # Seeds torch, random and numpy on every rank at initialize() with seed + rank, so random ops
    # (dropout) repeat from run to run and differ between ranks.
    seed: NonNegativeInt | None = None
    # Floating buffers (BatchNorm running statistics) take rank 0's values before each forward that
    # follows a training forward, as DDP's broadcast_buffers=True (its default); see buffers.py.
    broadcast_buffers: bool = True
    # Seconds any collective may wait for a peer before the job ends (init_process_group's timeout,
    # when zerodp creates the group).
    # At most ~3 years: the timeout becomes a timedelta and then milliseconds inside torch.distributed.
    comm_timeout_s: Annotated[float, Field(gt=0, le=1e8, allow_inf_nan=False)] = 600.0
    # DeepSpeed never reads it (an unknown top-level key to it); DeepSpeedExamples' configs carry it.
    cuda_visible_devices: int | str | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    non_finite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    # What training reports (zerodp.monitor): steps_per_print and wall_clock_breakdown above, and these.
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)

    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _bfloat16_alias(cls, data: Any) -> Any:
        # DeepSpeed still reads its section's old name, "bfloat16", as "bf16".
        if isinstance(data, dict) and "bfloat16" in data:
            if "bf16" in data:
                raise ValueError("both 'bf16' and its old name 'bfloat16' are given; keep only 'bf16'")
            data = {("bf16" if k == "bfloat16" else k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _one_half_precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        return self

    @model_validator(mode="after")
    def _refused_values(self) -> Config:
        problems = refusals(self)
        accum = self.data_types.grad_accum_dtype
        if accum not in (None, "fp32") and _DTYPES[accum] != self.dtype:
            problems.append(f"config key 'data_types.grad_accum_dtype' = \"{accum}\" is not supported with "
                            f"{self.dtype} training: gradients accumulate in the working dtype or in fp32; "
                            "use \"fp32\"")
        if problems:
            raise ConfigError("\n".join(problems))
        return self

    @property
    def grad_accum_dtype(self) -> torch.dtype | None:
        """data_types.grad_accum_dtype as a torch dtype (None: the engine's default)."""
        accum = self.data_types.grad_accum_dtype
        return None if accum is None else _DTYPES[accum]

    @property
    def communication_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in: communication_data_type, else the working dtype."""
        kind = self.communication_data_type
        return self.dtype if kind is None else _DTYPES[kind]

    @property
    def dtype(self) -> torch.dtype:
        """The working precision of parameters, gradients and activations."""
        if self.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if self.bf16.enabled else torch.float32

    def batch(self, world_size: int) -> BatchSizes:
        """Resolve DeepSpeed's rule train_batch_size = micro × accumulation steps × world size."""
        if world_size < 1:
            raise ConfigError(f"world size must be at least 1, got {world_size}")
        train, micro, gas = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                             self.gradient_accumulation_steps)
        if train is None and micro is None:
            raise ConfigError("batch sizes need at least train_batch_size or "
                              "train_micro_batch_size_per_gpu in the config")
        if micro is None:
            gas = gas or 1
            micro = _divide(train, "train_micro_batch_size_per_gpu",
                            "gradient_accumulation_steps", gas, world_size)
        elif train is None:
            gas = gas or 1
            train = micro * gas * world_size
        elif gas is None:
            gas = _divide(train, "gradient_accumulation_steps",
                          "train_micro_batch_size_per_gpu", micro, world_size)
        if train != micro * gas * world_size:
            raise ConfigError(
                f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} × "
                f"gradient_accumulation_steps {gas} × world size {world_size} = {micro * gas * world_size}")
        return BatchSizes(train, micro, gas)


def _divide(train: int, unknown: str, other_name: str, other: int, world_size: int) -> int:
    """Solve train = unknown × other × world_size for `unknown`, which must come out whole."""
    if train % (other * world_size):
        raise ConfigError(
            f"cannot derive {unknown}: train_batch_size {train} is not divisible by "
            f"{other_name} {other} × world size {world_size} = {other * world_size}")
    return train // (other * world_size)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON config file as a dict, or a ConfigError naming the file and what is wrong with it."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: line {e.lineno} "
                          f"column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} must hold a JSON object (a dict), got {type(raw).__name__}")
    return raw


def load_config(source: Config | dict[str, Any] | str | os.PathLike[str] | None) -> Config:
    """A Config from a Config (returned as is), None (defaults), a dict, or a JSON file path."""
    if isinstance(source, Config):
        return source
    if source is None:
        return Config()
    origin = ""
    if isinstance(source, (str, os.PathLike)):
        origin = f"in config file {os.fspath(source)!r}:\n"
        source = read_config_file(source)
    if not isinstance(source, dict):
        raise ConfigError(f"{origin}a config must be a JSON object (a dict), got {type(source).__name__}")
    try:
        return Config.model_validate(source)
    except ValidationError as e:
        raise ConfigError(origin + _format_errors(e, Config)) from None
