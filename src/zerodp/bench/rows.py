"""What `zerodp bench` runs and reports, torch-free: the modes, and one mode's row (Result).
The driver reads these before it imports torch, so `zerodp bench --help` answers at once."""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = {
    "plain": "PyTorch AMP, fused AdamW",
    "ddp": "DistributedDataParallel",
    "fsdp2": "fully_shard, reshard_after_forward=True",
    "fsdp2-noreshard": "fully_shard, reshard_after_forward=False",
    "zerodp0": "zerodp stage 0",
    "zerodp1": "zerodp stage 1",
    "zerodp2": "zerodp stage 2",
    "zerodp3": "zerodp stage 3",
    "deepspeed2": "DeepSpeed ZeRO-2",
    "zerodp2-offload": "zerodp stage 2, optimizer offloaded to the CPU, torch.optim.AdamW as built by default",
    "deepspeed2-offload": "DeepSpeed ZeRO-Offload (stage 2, DeepSpeedCPUAdam)",
}
# Each zerodp mode's DeepSpeed counterpart: the table gives zerodp's step time over DeepSpeed's.
DEEPSPEED_PAIRS = {"zerodp2": "deepspeed2", "zerodp2-offload": "deepspeed2-offload"}
FAKE_MODES = ("zerodp2", "fsdp2", "fsdp2-noreshard")


@dataclass
class Result:
    """One mode's row: measured, or skipped/failed with the reason."""

    mode: str
    status: str                      # "ok", "skipped" or "failed"
    world: int = 1
    reason: str = ""
    tokens_per_s: float | None = None        # all ranks together
    tflops: float | None = None              # per device
    mfu: float | None = None
    peak_allocated_gib: float | None = None  # CUDA, rank 0
    peak_reserved_gib: float | None = None
    owned_bytes: dict[str, int] | None = None  # fake-world runs: bytes of model states, by category
    seconds: float | None = None
    losses: list[float] = field(default_factory=list)
    ratio_to_plain: float | None = None
    step_vs_deepspeed: float | None = None   # zerodp modes: step time over DeepSpeed's same-run counterpart
    exposed_comm_ms: float | None = None     # zerodp modes: ms per step rank 0 was blocked in collectives
    note: str = ""
    samples: list[float] = field(default_factory=list)  # tokens/s of every repeat (--repeats)
