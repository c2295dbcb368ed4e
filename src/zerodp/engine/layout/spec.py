"""The engine's facts, named once (EngineSpec): the ZeRO stage, the batch sizes, the shard size, the working
precision, the device, stage 3's units and each param group's OptimizerView. A frozen dataclass: the rest of
the engine reads these facts and never derives them again. What decides them is engine/decide.py
(`local_check`); where the parameters' values come from (setup/fill.py's `Filling`) is decided there too,
and handed to the set-up beside the spec, since only set-up reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from zerodp.config import BatchSizes
from zerodp.engine.layout.formats import is_params4bit
from zerodp.engine.layout.units import Units


class OptimizerView(Enum):
    """How the optimizer of one param group sees its parameters (stepping/optimizer_view.py decides which)."""

    FLAT_SHARDS = "flat shards"            # element-wise: 1/N of every bucket, parameters cut anywhere
    WHOLE_PARAMETERS = "whole parameters"  # shape-aware: each parameter whole, on the one rank that owns it


@dataclass(frozen=True)
class EngineSpec:
    """What the engine is, decided before it builds anything."""

    stage: int  # ZeRO stage 0-3: what is sharded (nothing, optimizer states, + gradients, + parameters)
    batch: BatchSizes  # micro batch, gradient accumulation steps and global batch at this world size
    shard_size: int  # ranks one copy of the model states is sharded over (< world: hierarchical, MiCS)
    dtype: torch.dtype  # working precision of parameters and gradients (the masters are fp32)
    device: torch.device  # this rank's device: the module's, or the backend's accelerator
    units: Units | None  # stage 3's units, gathered and released together; None below stage 3
    offload_param: bool  # stage 3's offload_param: this rank's parameter shards live in host memory
    # per optimizer param group: its optimizer steps flat shards (element-wise) or whole parameters
    views: tuple[OptimizerView, ...] = ()
    # Stage 3: frozen parameters are partitioned and gathered like trained ones (Layout.frozen), with no
    # gradient, master or optimizer state. False: stages 0-2, which keep every parameter whole.
    shards_frozen: bool = False
    # Something to train. False: a frozen-only engine (a DPO reference model, a distillation teacher),
    # built without any optimizer for a model with no trainable parameter: forward only.
    trains: bool = True
    # Stage 3's offload_param "nvme": the parameter shards live in a file of this rank's (sharding/on_disk.py)
    # and in host memory only while used (offload_param is then true too: they reach the device from the host).
    params_on_disk: bool = False

    @property
    def gas(self) -> int:
        """Gradient accumulation steps: backward() calls per optimizer step."""
        return self.batch.gradient_accumulation_steps

    @property
    def shards_optimizer(self) -> bool:
        """Stages 1-3: each rank keeps (and steps) only its shard of the masters and optimizer states."""
        return self.stage > 0

    @property
    def keeps_gradient_shard(self) -> bool:
        """Stages 2-3: a rank keeps only its shard of each reduced gradient bucket, not the whole bucket."""
        return self.stage >= 2

    @property
    def gathers_per_unit(self) -> bool:
        """Stage 3: parameters are sharded, gathered per unit for its forward and backward."""
        return self.stage == 3

    @property
    def gathers_after_step(self) -> bool:
        """Stages 1-2: each rank steps its shard, then the updated parameters are all-gathered to every
        rank (stage 0 steps everything everywhere; stage 3 gathers per unit instead)."""
        return self.shards_optimizer and not self.gathers_per_unit

    def kept_dtype(self, t: torch.Tensor) -> torch.dtype:
        """The dtype an untrained tensor (a frozen parameter, a floating buffer) is kept in: its own, bits
        untouched (a bf16 base under an fp32 config stays bf16; packed 4-bit words stay packed), except an fp32
        one under a 16-bit working precision, which the config's bf16/fp16 section asks for (DeepSpeed's
        `module.bfloat16()`). Packed words (bitsandbytes' Params4bit, even in fp32 storage) are never cast."""
        if t.dtype == torch.float32 and self.dtype != torch.float32 and not is_params4bit(t):
            return self.dtype
        return t.dtype

    def whole_parameters(self, group: int) -> bool:
        """Whether param group `group`'s optimizer steps whole parameters (OptimizerView)."""
        return bool(self.views) and self.views[group] is OptimizerView.WHOLE_PARAMETERS
