"""The config schema: the top-level `Config` (DeepSpeed's ds_config.json keys, one pydantic model per
section), its smaller sections, the batch-size arithmetic (train = micro × accumulation × world), and
`load_config`, which turns a dict or a JSON file into a `Config` or raises a `ConfigError` with one line
per problem. The larger sections have modules of their own (zero_optimization.py, optimizer.py,
scheduler.py, monitor.py); keys.py lists the keys that have no effect here or are refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

from zerodp.config.base import ConfigError, NonNegativeInt, PositiveInt, _format_errors, _Section
from zerodp.config.keys import refusals
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
from zerodp.config.zero_optimization import ZeroConfig


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



class NonFiniteConfig(_Section):
    """What a step with a non-finite (nan/inf) global gradient norm leads to: zerodp's own section
    (DeepSpeed has none). Such a step is always skipped on every rank; `policy` "raise" then raises
    zerodp.NonFiniteError once `max_consecutive_skips` steps in a row were skipped, "skip" goes on.
    fp16 overflows while dynamic loss scaling can still lower the scale do not count (engine docs).
    `read_back`: when the host learns of a skip (engine/stepping/non_finite.py): "same_step" reads the decision
    in step() (a device sync per step), "next_step" skips on the device and reads it a step later,
    "auto" is next_step on an accelerator where possible."""

    policy: Literal["raise", "skip"] = "raise"
    max_consecutive_skips: PositiveInt = 3
    read_back: Literal["auto", "same_step", "next_step"] = "auto"



class AioConfig(_Section):
    """DeepSpeed's `aio` section: how the disk tier (offload_optimizer.device "nvme", engine/stepping/disk.py)
    reads and writes its scratch file, with os.preadv/os.pwritev on a thread pool instead of DeepSpeed's
    libaio extension. A sub-group's transfer is cut into block_size requests, split into at most queue_depth
    runs that proceed at once on thread_count threads; single_submit issues each request as its own system
    call instead of one vectored call per run. overlap_events false is refused (keys.py)."""

    block_size: PositiveInt = 1_048_576
    queue_depth: PositiveInt = 8
    thread_count: PositiveInt = 1
    single_submit: bool = False
    overlap_events: bool = True

    @field_validator("block_size")
    @classmethod
    def _whole_disk_blocks(cls, size: int) -> int:
        # O_DIRECT transfers whole logical blocks of the disk: 4096 bytes covers every disk's (512 or 4096).
        if size % 4096:
            raise ValueError(f"expected a multiple of 4096 bytes (the disk's O_DIRECT alignment), got {size}")
        return size


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


class HybridEngineConfig(_Section):
    """DeepSpeed's `hybrid_engine` (DeepSpeed-Chat's RLHF step: one model switched between training and
    DeepSpeed's inference kernels for generation). Every config of DeepSpeed-Chat carries the section,
    disabled: disabled it has no effect; enabled it is refused (config/keys.py says why). DeepSpeed's
    names, types and defaults."""

    enabled: bool = False
    max_out_tokens: PositiveInt = 512
    inference_tp_size: PositiveInt = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: PositiveInt = 8
    enable_cuda_graph: bool = False


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


@dataclass(frozen=True)
class Said:
    """A value a training framework decides for the run, with the words naming where the framework says it,
    for the error a conflicting config gets: Said(3, "accumulate_grad_batches says 3")."""

    value: Any
    by: str


# What a model that trains nothing beside a trained one keeps of the trained one's config: its precision and
# timeout, and its zero_optimization but the optimizer's offload (Config.for_frozen_model).
_FROZEN_MODEL_KEYS = ("bf16", "fp16", "comm_timeout_s")


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
    # Seconds any collective of zerodp's may wait for a peer before it raises PeerFailure: the timeout of the
    # group zerodp creates; given here, also of zerodp's collectives on a group the script created
    # (Comm.bound runs them on a twin of it with this timeout).
    # At most ~3 years: the timeout becomes a timedelta and then milliseconds inside torch.distributed.
    comm_timeout_s: Annotated[float, Field(gt=0, le=1e8, allow_inf_nan=False)] = 600.0
    # Seconds a collective of zerodp's may keep this rank waiting before it says so in one line (the collective,
    # where the engine is, where the other ranks are), then again at doubling intervals (distributed/waits.py).
    wait_notice_s: Annotated[float, Field(gt=0, le=1e8, allow_inf_nan=False)] = 60.0
    # How the sharding collectives (gradient reduce-scatter, parameter all-gather) run: "auto" measures at
    # set-up which is faster on this backend (on gloo; NCCL keeps its own), "native" the backend's own ops,
    # "all_reduce" both through an all-reduce (distributed/plan.py). Any other value is refused.
    collectives: Literal["auto", "native", "all_reduce"] = "auto"
    # DeepSpeed never reads it (an unknown top-level key to it); DeepSpeedExamples' configs carry it.
    cuda_visible_devices: int | str | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    non_finite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
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
    def _low_precision_optimizer(self) -> Config:
        bf16 = self.bf16
        if (bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states) and not bf16.enabled:
            raise ValueError("bf16.bf16_master_weights_and_grads / bf16.bf16_optimizer_states are set with "
                             "bf16.enabled false: they keep the optimizer's masters and states beside bf16 "
                             "working weights; set bf16.enabled true, or remove them")
        if bf16.bf16_master_weights_and_grads and self.zero_optimization.offload_optimizer.device == "cpu":
            raise ValueError("bf16.bf16_master_weights_and_grads with zero_optimization.offload_optimizer is "
                             "not supported (the remainder lives beside the working shard on the device); "
                             "offloaded masters cost no device memory: remove one of the two")
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

    def for_frozen_model(self) -> Config:
        """The config of a model that trains nothing beside this one (a DPO reference, a distillation teacher):
        the same sharding, placement, precision and timeout, derived from what this config set; no optimizer,
        scheduler, batch sizes or offloaded optimizer, which a model without an optimizer has no use for."""
        given = self.model_dump(exclude_unset=True)
        zero = {k: v for k, v in given.get("zero_optimization", {}).items() if k != "offload_optimizer"}
        return Config.model_validate({**{k: given[k] for k in _FROZEN_MODEL_KEYS if k in given},
                                      "zero_optimization": zero})

    def under_framework(self, *, gradient_accumulation_steps: Said | None = None,
                        gradient_clipping: Said | None = None, dtype: Said | None = None,
                        micro_batch_size: int | None = None) -> Config:
        """This config under a training framework's loop (Lightning's Trainer or Fabric), which decides the
        accumulation steps, the clipping and the precision itself. Precedence: the framework decides, the config
        may repeat its value but not contradict it: a key the config left unset takes the framework's value, a
        different one is a ConfigError naming both. dtype ("fp32", "bf16" or "fp16"): an fp16 / bf16 section
        enabled for another precision is a conflict; the framework's is enabled, the section's other keys kept.
        micro_batch_size (the framework's data loader's) fills only a config that gives no batch size, since
        zerodp then only reports it (the loop is the framework's)."""
        given = self.model_dump(exclude_unset=True)
        for key, said in (("gradient_accumulation_steps", gradient_accumulation_steps),
                          ("gradient_clipping", gradient_clipping)):
            if said is not None and key in given and given[key] != said.value:
                raise ConfigError(f"the zerodp config has {key}={given[key]!r} but {said.by}; give it in one place")
            if said is not None:
                given[key] = said.value
        if micro_batch_size is not None and "train_batch_size" not in given:
            given.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
        if dtype is not None:
            for section in ("bf16", "fp16"):
                if getattr(self, section).enabled and section != dtype.value:
                    raise ConfigError(f"the zerodp config enables {section} but {dtype.by}; give the precision in "
                                      f"one place (drop the config's {section} section, or change the framework's)")
            if dtype.value != "fp32":
                given[dtype.value] = {**given.get(dtype.value, {}), "enabled": True}
        return Config.model_validate(given)

    def for_job(self, *, stage: int, offload_optimizer: Literal["none", "cpu", "nvme"], nvme_path: str | None,
                dtype: Literal["fp32", "bf16", "fp16"],
                micro_batch_size: int, gradient_accumulation_steps: int, gradient_clipping: float,
                comm_timeout_s: float, non_finite_policy: Literal["raise", "skip"]) -> Config:
        """This config (`zerodp train --ds-config`'s) under the job's settled options. Precedence: the options
        replace the config's values, with no conflict possible: they were settled with this file as their lowest
        layer (flags over --config over it), so each is the file's own value unless the user gave another on
        purpose. The optimizer, scheduler and train_batch_size go: the job builds the optimizer and schedule from
        its options (train/ds_sections.py), and its batch is micro_batch_size x gradient_accumulation_steps x world."""
        given = self.model_dump(exclude_unset=True, exclude={"optimizer", "scheduler", "train_batch_size"})
        zero = given.get("zero_optimization", {})
        offload = {**zero.get("offload_optimizer", {}), "device": offload_optimizer}
        if nvme_path is not None:
            offload["nvme_path"] = nvme_path
        given.update(comm_timeout_s=comm_timeout_s, train_micro_batch_size_per_gpu=micro_batch_size,
                     gradient_accumulation_steps=gradient_accumulation_steps, gradient_clipping=gradient_clipping,
                     bf16={**given.get("bf16", {}), "enabled": dtype == "bf16"},
                     fp16={**given.get("fp16", {}), "enabled": dtype == "fp16"},
                     non_finite={**given.get("non_finite", {}), "policy": non_finite_policy},
                     zero_optimization={**zero, "stage": stage, "offload_optimizer": offload})
        return Config.model_validate(given)

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
                f"gradient_accumulation_steps {gas} × world size {world_size} = {micro * gas * world_size}; "
                f"train_batch_size {micro * gas * world_size} would work, or leave one of the three out and it "
                "is derived from the other two")
        return BatchSizes(train, micro, gas)


def _divide(train: int, unknown: str, other_name: str, other: int, world_size: int) -> int:
    """Solve train = unknown × other × world_size for `unknown`, which must come out whole."""
    if train % (other * world_size):
        raise ConfigError(
            f"cannot derive {unknown}: train_batch_size {train} is not divisible by "
            f"{other_name} {other} × world size {world_size} = {other * world_size}; "
            f"{_what_would_divide(train, other_name, other * world_size, world_size)}")
    return train // (other * world_size)


def _what_would_divide(train: int, other_name: str, step: int, world_size: int) -> str:
    """The values near the given ones that make train_batch_size divide: the multiples of `step` around
    it, and, when train_batch_size divides over the ranks at all, the values of `other_name` that fit."""
    below, above = train // step * step, (train // step + 1) * step
    hint = f"train_batch_size {' or '.join(str(v) for v in (below, above) if v > 0)} would work (a multiple of {step})"
    if train % world_size == 0:
        per_rank = train // world_size
        fits = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        more = ", ..." if len(fits) > 8 else ""
        hint += (f", or {other_name} {', '.join(map(str, fits[:8]))}{more} (the divisors of train_batch_size / "
                 f"world size = {per_rank})")
    return hint


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
