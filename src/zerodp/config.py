"""Typed zerodp configuration: DeepSpeed's JSON keys, validated, with errors that name the key.

This module owns the config schema (one pydantic model per section, keys spelled as in DeepSpeed's
ds_config.json), the batch-size arithmetic (train = micro × accumulation × world), building the torch
optimizer and learning-rate schedule that a config names, and `load_config`, the one entry point that
turns a dict or a JSON file into a `Config` or raises a `ConfigError` with one line per problem.
Validation runs locally and identically on every rank, before any collective: a typo never hangs a job.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import os
import types
from dataclasses import dataclass
from typing import Annotated, Any, Iterable, Literal, Union, get_args, get_origin

import torch
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]


class ConfigError(ValueError):
    """A config problem, said in terms of the config's own keys."""


class _Section(BaseModel):
    # A misspelt key must be an error, not a silently ignored setting; so must a value of the wrong
    # JSON type (strict): "yes" is not a boolean, true is not a batch size, "2" is not a stage, the
    # string "1e-3" is not a number. An integer is still a number where a float is expected.
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _integral_float_as_int(cls, value: Any, info: ValidationInfo) -> Any:
        # JSON configs write sizes as 5e8, which JSON parsers read as a float: a whole float is
        # accepted where an integer is expected (5.5 is still an error).
        wants_int = _expects_int(cls.model_fields[info.field_name].annotation)
        if isinstance(value, float) and value.is_integer() and wants_int:
            return int(value)
        return value


def _expects_int(annotation: Any) -> bool:
    """True for int, Annotated[int, ...] and their optional forms (not bool, not float)."""
    if annotation is int:
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return _expects_int(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return any(_expects_int(a) for a in get_args(annotation))
    return False


class FP16Config(_Section):
    enabled: bool = False
    loss_scale: Annotated[float, Field(ge=0)] = 0.0  # 0 means dynamic loss scaling
    initial_scale_power: Annotated[int, Field(ge=0, le=64)] = 16
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: Annotated[float, Field(gt=0)] = 1.0
    auto_cast: bool = False


class BF16Config(_Section):
    enabled: bool = False


class OffloadOptimizerConfig(_Section):
    device: Literal["none", "cpu"] = "none"
    pin_memory: bool = True

    @field_validator("device", mode="before")
    @classmethod
    def _no_nvme(cls, device: Any) -> Any:
        if device == "nvme":
            raise ValueError("NVMe offload is not supported by zerodp; use \"cpu\"")
        return device


class OffloadParamConfig(_Section):
    """Stage 3's parameter shards in host memory (DeepSpeed's offload_param): each gather copies the
    rank's shard to the device first. buffer_count, buffer_size, max_in_cpu and nvme_path size
    DeepSpeed's NVMe buffers, which zerodp does not have: accepted (DeepSpeed's types) with no effect."""

    device: Literal["none", "cpu"] = "none"
    pin_memory: bool = True
    nvme_path: str | None = None
    buffer_count: NonNegativeInt = 5
    buffer_size: NonNegativeInt = 100_000_000
    max_in_cpu: NonNegativeInt = 1_000_000_000

    @field_validator("device", mode="before")
    @classmethod
    def _no_nvme(cls, device: Any) -> Any:
        if device == "nvme":
            raise ValueError("NVMe offload is not supported by zerodp; use \"cpu\"")
        return device


class NonFiniteConfig(_Section):
    """What a step with a non-finite (nan/inf) global gradient norm leads to: zerodp's own section
    (DeepSpeed has none). Such a step is always skipped on every rank; `policy` "raise" then raises
    zerodp.NonFiniteError once `max_consecutive_skips` steps in a row were skipped, "skip" goes on.
    fp16 overflows while dynamic loss scaling can still lower the scale do not count (engine docs)."""

    policy: Literal["raise", "skip"] = "raise"
    max_consecutive_skips: PositiveInt = 3


class ZeroConfig(_Section):
    stage: Annotated[int, Field(ge=0, le=3)] = 0
    # Elements, not bytes, as in DeepSpeed. Smaller than DeepSpeed's 5e8 default: a model under the
    # bucket size is one bucket, whose reduction cannot start before backward ends (no overlap), and
    # the stage-2 bucket pool would then be a whole-model gradient.
    reduce_bucket_size: PositiveInt = 50_000_000
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
    zero_hpz_partition_size: PositiveInt = 1

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

    @field_validator("mics_hierarchical_params_gather")
    @classmethod
    def _no_two_hop_gather(cls, value: bool) -> bool:
        if value:
            raise ValueError("zerodp all-gathers parameters inside the shard group in one collective; "
                             "the two-hop (inter-node, then intra-node) gather is not implemented: keep "
                             "mics_shard_size within a node (e.g. the GPUs per node) and set this to false")
        return value

    @field_validator("zero_hpz_partition_size")
    @classmethod
    def _no_hpz(cls, value: int) -> int:
        if value > 1:
            raise ValueError(f"zero_hpz_partition_size {value}: ZeRO++'s secondary copy of the stage-3 "
                             "parameters is not implemented; use mics_shard_size (the same intra-node "
                             "gathers, with every model state sharded within the group) or set it to 1")
        return value


class ActivationCheckpointingConfig(_Section):
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: PositiveInt | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @field_validator("partition_activations")
    @classmethod
    def _no_partition(cls, value: bool) -> bool:
        # DeepSpeed splits each saved activation across the model-parallel group; plain data
        # parallelism has no such group, so "partitioning" would silently do nothing.
        if value:
            raise ValueError(
                "partitioning activations only has meaning with a model-parallel (tensor-parallel) "
                "group, which zerodp's plain data parallelism does not have, so activations are not "
                "partitioned; use cpu_checkpointing to move them off the accelerator"
            )
        return value

    @model_validator(mode="after")
    def _contiguous_needs_count(self) -> ActivationCheckpointingConfig:
        # The contiguous buffer is sized up front, one slot per checkpoint.
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError("contiguous_memory_optimization: true requires number_checkpoints")
        return self


_OPTIMIZERS = {name.lower(): name for name in ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop")}


class OptimizerConfig(_Section):
    """DeepSpeed's `optimizer` section, mapped onto the torch.optim class of the same name."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        if name.lower() not in _OPTIMIZERS:
            raise ValueError(f"supported optimizers are {', '.join(_OPTIMIZERS.values())}")
        return _OPTIMIZERS[name.lower()]

    @model_validator(mode="after")
    def _params_fit(self) -> OptimizerConfig:
        self._torch_class_and_kwargs()
        return self

    def _torch_class_and_kwargs(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        kwargs = dict(self.params)
        cls = getattr(torch.optim, self.type)
        if self.type in ("Adam", "AdamW"):
            kwargs.pop("torch_adam", None)  # DeepSpeed's choice of kernel; torch's is the only one here
            # DeepSpeed's adam_w_mode defaults to True: its "Adam" decays weights the AdamW way
            # unless the config opts out, so "Adam" + weight_decay means torch.optim.AdamW.
            w_mode = kwargs.pop("adam_w_mode", True) or self.type == "AdamW"
            cls = torch.optim.AdamW if w_mode else torch.optim.Adam
        if "max_grad_norm" in kwargs:
            raise ConfigError("config key 'optimizer.params.max_grad_norm' is not supported; "
                              "use the top-level key 'gradient_clipping'")
        for key, value in kwargs.items():
            if isinstance(value, str) and value == "auto":
                raise ConfigError(f"config key 'optimizer.params.{key}' = \"auto\": {_AUTO} a number")
        known = [p for p in inspect.signature(cls).parameters if p != "params"]
        unknown = [_unknown_key(f"optimizer.params.{k}", known) + f" (optimizer {self.type}, "
                   f"torch.optim.{cls.__name__})" for k in kwargs if k not in known]
        if unknown:
            raise ConfigError("\n".join(unknown))
        try:  # values are checked by torch itself, on a one-element dummy, so errors come at load
            cls([torch.zeros(1, requires_grad=True)], **kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(f"config key 'optimizer.params' rejected by torch.optim."
                              f"{cls.__name__}: {e}") from None
        return cls, kwargs

    def build(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> torch.optim.Optimizer:
        cls, kwargs = self._torch_class_and_kwargs()
        groups = list(params)
        tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
        # Adam(W): one fused kernel over each flat master shard (DeepSpeed's FusedAdam on GPUs, its
        # CPUAdam for offload), unless the config picks foreach or fused itself. On the CPU the
        # foreach form allocates full-size temporaries every step, which on one flat shard of millions
        # of elements costs more in fresh pages than the arithmetic (5 ms fused vs 30 ms, 4.9M).
        if (cls in (torch.optim.Adam, torch.optim.AdamW) and "fused" not in kwargs and "foreach" not in kwargs
                and tensors and all(t.device.type in ("cuda", "cpu") for t in tensors)):
            kwargs["fused"] = True
        return cls(groups, **kwargs)


class _WarmupLRParams(_Section):
    warmup_min_lr: Annotated[float, Field(ge=0)] = 0.0
    warmup_max_lr: Annotated[float, Field(gt=0)] | None = None  # None: the optimizer's lr
    warmup_num_steps: NonNegativeInt = 1000
    warmup_type: Literal["log", "linear"] = "log"


class _WarmupDecayLRParams(_WarmupLRParams):
    total_num_steps: PositiveInt
    warmup_max_lr: Annotated[float, Field(gt=0)] | None = 0.001


class _WarmupCosineLRParams(_Section):
    total_num_steps: PositiveInt
    warmup_min_ratio: Annotated[float, Field(ge=0)] = 0.0
    warmup_num_steps: NonNegativeInt = 1000
    cos_min_ratio: Annotated[float, Field(ge=0)] = 0.0001
    warmup_type: Literal["log", "linear"] = "log"


_SCHEDULERS = {"WarmupLR": _WarmupLRParams, "WarmupDecayLR": _WarmupDecayLRParams,
               "WarmupCosineLR": _WarmupCosineLRParams}


def _warmup_gamma(step: int, warmup_steps: int, kind: str) -> float:
    """Fraction of the warmup done at `step` (DeepSpeed's formula; 1.0 once warmup is over)."""
    if step >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


class SchedulerConfig(_Section):
    """DeepSpeed's `scheduler` section, built as a LambdaLR stepped once per optimizer step.

    The lr the optimizer uses at step t (t optimizer steps already taken) is DeepSpeed's formula at
    t. DeepSpeed itself applies its step-0 value twice (once at construction, once after the first
    step), so its sequence lags this one by one step.
    """

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        by_lower = {k.lower(): k for k in _SCHEDULERS}
        if name.lower() not in by_lower:
            raise ValueError(f"supported schedulers are {', '.join(_SCHEDULERS)}")
        return by_lower[name.lower()]

    @model_validator(mode="after")
    def _params_fit(self) -> SchedulerConfig:
        self._parsed_params()
        return self

    def _parsed_params(self) -> Any:
        try:
            p = _SCHEDULERS[self.type].model_validate(self.params)
        except ValidationError as e:
            raise ConfigError(_format_errors(e, _SCHEDULERS[self.type], "scheduler.params")) from None
        total = getattr(p, "total_num_steps", None)  # WarmupLR has no end
        if total is not None and total <= p.warmup_num_steps:
            raise ConfigError(f"config key 'scheduler.params.total_num_steps' = {total}: "
                              f"expected more than warmup_num_steps = {p.warmup_num_steps}")
        return p

    def build(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        p = self._parsed_params()
        warmup = max(2, p.warmup_num_steps)  # DeepSpeed's floor: log warmup divides by log(warmup)
        if self.type == "WarmupCosineLR":
            decay_steps = max(1, p.total_num_steps - warmup)

            def ratio(step: int) -> float:  # a fraction of the optimizer's own lr
                if step < warmup:
                    gamma = _warmup_gamma(step, warmup, p.warmup_type)
                    return p.warmup_min_ratio + (1.0 - p.warmup_min_ratio) * gamma
                # Clamped at total_num_steps, where DeepSpeed's cosine would start to rise again.
                progress = min(1.0, (step - warmup + 1) / decay_steps)
                return p.cos_min_ratio + (1.0 - p.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2
            return torch.optim.lr_scheduler.LambdaLR(optimizer, ratio)

        # WarmupLR / WarmupDecayLR give absolute lrs: pin every group's base lr to the peak and
        # express the schedule as a ratio of it, so LambdaLR's state dict stays the usual one.
        max_lr = p.warmup_max_lr if p.warmup_max_lr is not None else optimizer.param_groups[0]["lr"]
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = max_lr
        total = getattr(p, "total_num_steps", None)

        def absolute_ratio(step: int) -> float:
            gamma = _warmup_gamma(step, warmup, p.warmup_type)
            if total is not None and step >= warmup:  # linear decay to 0 at total_num_steps
                gamma = max(0.0, (total - step) / max(1, total - warmup))
            return (p.warmup_min_lr + (max_lr - p.warmup_min_lr) * gamma) / max_lr
        return torch.optim.lr_scheduler.LambdaLR(optimizer, absolute_ratio)


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


# After _Section, which the monitor sections build on (zerodp.monitor.config imports it from here).
from .monitor.config import (CometConfig, CommsLoggerConfig, CSVConfig, FlopsProfilerConfig,  # noqa: E402
                             TensorBoardConfig, WandbConfig)


class Config(_Section):
    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None
    gradient_clipping: Annotated[float, Field(ge=0)] = 0.0  # 0 = off
    steps_per_print: PositiveInt | None = None  # DeepSpeed's default now: no step lines
    wall_clock_breakdown: bool = False
    zero_allow_untested_optimizer: bool = True
    prescale_gradients: bool = False
    gradient_predivide_factor: Annotated[float, Field(gt=0)] = 1.0
    dump_state: bool = False
    seed: int | None = None
    # Floating buffers (BatchNorm running statistics) take rank 0's values before each forward that
    # follows a training forward, as DDP's broadcast_buffers=True (its default); see buffers.py.
    broadcast_buffers: bool = True
    # Seconds any collective may wait for a peer before the job ends (init_process_group's timeout,
    # when zerodp creates the group).
    comm_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0
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
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None

    @model_validator(mode="after")
    def _one_half_precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        return self

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


_AUTO = "'auto' is a placeholder the Hugging Face Trainer fills in; give"


def _unknown_key(path: str, known: Iterable[str]) -> str:
    known = list(known)
    close = difflib.get_close_matches(path.rsplit(".", 1)[-1], known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys are {', '.join(known)}"
    return f"unknown config key {path!r}; {hint}"


def _section_at(model: type[BaseModel], loc: Iterable[str]) -> type[BaseModel] | None:
    """The section model that `loc` names inside `model`, or None if loc names a plain value."""
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        args = (field.annotation, *getattr(field.annotation, "__args__", ()))
        sections = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if not sections:
            return None
        model = sections[0]
    return model


# The strict types' expected forms, in JSON's words.
_EXPECTED = {
    "bool_type": "true or false (a JSON boolean, not a string or a number)",
    "int_type": "an integer (a JSON number without a fraction, not a string or a boolean)",
    "float_type": "a number (a JSON number, not a string or a boolean)",
}


def _format_error(err: dict[str, Any], model: type[BaseModel], prefix: str) -> str:
    loc = [str(part) for part in err["loc"]]
    path = ".".join(([prefix] if prefix else []) + loc)
    kind, value = err["type"], err["input"]
    if kind == "extra_forbidden":
        return _unknown_key(path, _section_at(model, loc[:-1]).model_fields)
    if kind == "missing":
        return f"config key {path!r} is required"
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # raised by a nested check that already names its keys
        return str(cause)
    if isinstance(value, str) and value == "auto":
        return f"config key {path!r} = \"auto\": {_AUTO} {'a boolean' if kind.startswith('bool') else 'a number'}"
    if cause is not None:
        problem = str(cause)
    elif kind in _EXPECTED:
        problem = "expected " + _EXPECTED[kind]
    else:
        problem = "expected " + err["msg"].removeprefix("Input should be ")
    if cause is not None and _section_at(model, loc) is not None:  # a check across a section's keys
        return f"config section {path!r}: {problem}" if path else problem
    return f"config key {path!r} = {json.dumps(value, default=repr)}: {problem}"


def _format_errors(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    return "\n".join(_format_error(err, model, prefix) for err in exc.errors())


def load_config(source: Config | dict[str, Any] | str | os.PathLike[str] | None) -> Config:
    """A Config from a Config (returned as is), None (defaults), a dict, or a JSON file path."""
    if isinstance(source, Config):
        return source
    if source is None:
        return Config()
    origin = ""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        origin = f"in config file {path!r}:\n"
        try:
            with open(path, encoding="utf-8") as f:
                source = json.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid JSON: line {e.lineno} "
                              f"column {e.colno}: {e.msg}") from None
    if not isinstance(source, dict):
        raise ConfigError(f"{origin}a config must be a JSON object (a dict), got {type(source).__name__}")
    try:
        return Config.model_validate(source)
    except ValidationError as e:
        raise ConfigError(origin + _format_errors(e, Config)) from None
