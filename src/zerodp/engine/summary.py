"""The set-up line: which ZeRO stage, offload and dtype a job runs, said once on rank 0.

A job configured by defaults (no config, or a config without `zero_optimization.stage`) trains plain
data parallelism, stage 0: every rank holds the whole model, its gradients and its optimizer state.
Saying so at set-up is what keeps that from going unnoticed; `no_stage_chosen` tells a caller (the
Hugging Face Trainer, whose users expect ZeRO) when to turn the line into a warning.
"""

from __future__ import annotations

import logging

from zerodp.config import Config

logger = logging.getLogger("zerodp")

# what each stage shards (None: nothing)
_SHARDED = {0: None, 1: "optimizer state", 2: "optimizer state and gradients",
            3: "optimizer state, gradients and parameters"}
_NOTHING = "nothing sharded: plain data parallelism"
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}


def set_up_line(config: Config, world_size: int, shard_size: int, forward_only: bool = False,
                collectives: str = "") -> str:
    """One line: stage (what it shards, over how many ranks), offload, dtype, batch sizes (forward_only:
    a frozen-only engine, which has none), and how the collectives run (CollectivePlan.describe)."""
    zero = config.zero_optimization
    what = _SHARDED[zero.stage]
    over = f" over {shard_size} of {world_size} ranks" if what else f", {world_size} rank(s)"
    offload = [(name, section.device) for name, section in (("optimizer", zero.offload_optimizer),
                                                            ("parameters", zero.offload_param))
               if section.device != "none"]
    if len({device for _, device in offload}) == 1:  # "optimizer and parameters to cpu"
        said = f"{' and '.join(name for name, _ in offload)} to {offload[0][1]}"
    else:
        said = " and ".join(f"{name} to {device}" for name, device in offload) or "none"
    line = (f"zerodp: ZeRO stage {zero.stage} ({what + ' sharded' if what else _NOTHING}{over}); offload: "
            f"{said}; dtype {_DTYPE_NAMES[str(config.dtype)]}; ")
    tail = f"; {collectives}" if collectives else ""
    if forward_only:
        return line + "forward only (no optimizer, nothing to train)" + tail
    batch = config.batch(world_size)
    return line + (f"batch {batch.micro_batch_size} per rank x {batch.gradient_accumulation_steps} accumulation "
                   f"x {world_size} ranks = {batch.train_batch_size}") + tail


def no_stage_chosen(config: Config) -> bool:
    """True when the stage is the default one (0) because the config never set it."""
    zero = config.zero_optimization
    return "zero_optimization" not in config.model_fields_set or "stage" not in zero.model_fields_set


def log_set_up(config: Config, world_size: int, shard_size: int, rank: int, forward_only: bool = False,
               collectives: str = "") -> None:
    """The set-up line at INFO, on rank 0 only (one line per job, not one per rank)."""
    if rank == 0:
        logger.info("%s", set_up_line(config, world_size, shard_size, forward_only, collectives))
