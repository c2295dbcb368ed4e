"""One mode of `zerodp bench` in this process: build the GPT and its optimizer the mode's way, run
--warmup untimed steps and --steps timed ones, and return the mode's row (Result). The driver
(driver.py) starts one such process per mode, so no mode inherits another's allocator state, compiled
kernels or process group.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from zerodp.bench.rows import FAKE_MODES, MODES, Result  # noqa: F401 - zerodp.bench.FAKE_MODES is read from here
from zerodp.distributed.comm import init_distributed, init_fake
from zerodp.distributed.device import (
    device_name,
    is_accelerator,
    local,
    max_memory_allocated,
    max_memory_reserved,
    reset_peak_memory_stats,
    synchronize,
)
from zerodp.models.gpt import GPT, Block, gpt_config

# Dense bf16 tensor-core peak, TFLOP/s, by device-name substring (first match wins).
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("H20", 148.0),
               ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0)]
GIB = 2 ** 30


def _init_process_group(fake_world: int) -> tuple[int, int]:
    if fake_world:
        init_fake(fake_world)
    else:
        init_distributed()
    return dist.get_rank(), dist.get_world_size()


def _device() -> torch.device:
    return local(int(os.environ.get("LOCAL_RANK", "0")))


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant torch.utils.checkpoint)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(model: GPT) -> str:
    """Checkpoint every transformer block, the same way for every mode; says which way."""
    try:
        from zerodp.activations import checkpoint_blocks as zerodp_checkpoint_blocks
    except ImportError:
        zerodp_checkpoint_blocks = None
    if zerodp_checkpoint_blocks is not None:
        zerodp_checkpoint_blocks(model, (Block,))  # non-reentrant, blocks by class, no CPU offload
        return "zerodp.activations.checkpoint_blocks"
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _Checkpointed(block)
    return "torch.utils.checkpoint per block"


def _config(args: argparse.Namespace):
    return gpt_config(args.model, block_size=max(gpt_config(args.model).block_size, args.seq),
                      loss_chunk=args.loss_chunk)


def flops_per_token(args: argparse.Namespace) -> int:
    """6N + 12·L·d·T of the benchmarked GPT, counted on the meta device (no memory, no init time)."""
    with torch.device("meta"):
        return GPT(_config(args)).flops_per_token(args.seq)


def build_model(args: argparse.Namespace, device: torch.device) -> tuple[GPT, str]:
    """The GPT, initialised directly on `device` (a 6.7B model never passes through host memory)."""
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = GPT(_config(args))
    note = checkpoint_blocks(model) if args.checkpointing else ""
    if args.compile:  # per block, before any wrapping, the same in every mode (as torchtitan does)
        for block in model.blocks:
            block.compile()
        note = ", ".join(filter(None, [note, "torch.compile per block"]))
    return model.to(device), note


def _adamw(params, args: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    # fused in every mode and on every device: one kernel per tensor, no full-size temporaries
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, fused=True)


def _torch_step(model: nn.Module, opt: torch.optim.Optimizer, args, amp: bool, device: torch.device):
    """forward / backward / clip / step of a module that PyTorch itself makes data-parallel."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(x, y)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _engine_step(engine):
    """forward / backward / step of an engine that owns them (zerodp's, DeepSpeed's)."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step


def setup_mode(mode: str, args: argparse.Namespace, device: torch.device, world: int):
    """Build the mode's model and optimizer; returns (step function, note, owned-bytes function)."""
    bf16 = args.dtype == "bf16"
    model, note = build_model(args, device)
    if mode == "plain":
        return _torch_step(model, _adamw(model.parameters(), args, device), args, bf16, device), note, None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[device.index] if is_accelerator(device) else None)
        return _torch_step(ddp, _adamw(ddp.parameters(), args, device), args, bf16, device), note, None
    if mode.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        reshard = mode == "fsdp2"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        opt = _adamw(model.parameters(), args, device)
        # FSDP2 casts the parameters itself: no autocast around its forward.
        return _torch_step(model, opt, args, False, device), note, lambda: _fsdp_local_bytes(model, opt)
    if mode.startswith("zerodp"):
        engine = _zerodp_engine(mode, model, args, device)
        step = _engine_step(engine)
        # overlap_param_gather leaves the last step's gathers in flight: the timed region ends after them
        step.finish = engine.wait_for_parameters
        step.blocked = _clock_collectives(engine)
        return step, note, lambda: engine_bytes(engine)
    if mode.startswith("deepspeed"):
        return _engine_step(_deepspeed_engine(mode, model, args, device)), note, None
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


def _clock_collectives(engine):
    """The host time the engine's collectives block its steps from now on (its exposed communication)."""
    from zerodp.distributed.traffic import BlockedClock
    from zerodp.engine.engine import inside
    clock = BlockedClock()
    inside(engine).comm.traffic.blocked = clock
    return clock


def _zerodp_engine(mode: str, model: nn.Module, args: argparse.Namespace, device: torch.device):
    """zerodpN: the fused AdamW of every mode. zerodp2-offload: ZeRO-Offload with a torch AdamW built
    with torch's defaults, as a user writes it (no fused=True: the engine picks the host kernel)."""
    import zerodp
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": args.grad_clip, "bf16": {"enabled": args.dtype == "bf16"},
              "zero_optimization": {"stage": int(mode[len("zerodp")]),
                                    "overlap_param_gather": args.overlap_param_gather}}
    if args.bucket:
        config["zero_optimization"]["reduce_bucket_size"] = args.bucket
    if mode.endswith("-offload"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    else:
        optimizer = _adamw(model.parameters(), args, device)
    return zerodp.initialize(model, optimizer, config)


def _deepspeed_engine(mode: str, model: nn.Module, args: argparse.Namespace, device: torch.device):
    """deepspeed2: ZeRO-2 with the fused torch AdamW. deepspeed2-offload: ZeRO-Offload, whose
    optimizer DeepSpeed builds from the config: DeepSpeedCPUAdam (a C++ kernel it JIT-builds)."""
    import deepspeed  # the caller turned an ImportError into a 'skipped' row
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": args.grad_clip, "bf16": {"enabled": args.dtype == "bf16"},
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}}
    if args.bucket:
        config["zero_optimization"].update(reduce_bucket_size=args.bucket, allgather_bucket_size=args.bucket)
    if mode.endswith("-offload"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        optimizer = _adamw(model.parameters(), args, device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def skip_reason(mode: str, device: torch.device) -> str:
    if mode.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (import deepspeed fails)"
    if mode.startswith("fsdp2") and importlib.util.find_spec("torch.distributed.fsdp") is None:
        return "this torch has no torch.distributed.fsdp"
    return ""


def _batch(args: argparse.Namespace, vocab: int, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    tokens = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].contiguous().to(device)


def engine_bytes(engine) -> dict[str, int]:
    """Bytes the zerodp engine owns on this rank, by category: engine.memory_report()."""
    return {k: int(v) for k, v in engine.memory_report().items() if isinstance(v, (int, float))}


def _fsdp_local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """FSDP2: this rank's shards of the parameters and of the optimizer states (gradients are freed
    by zero_grad after each step; gathered parameters are transient)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    state = sum(local(t).numel() * local(t).element_size() for s in opt.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return {"params_shard": params, "optimizer_states": state, "model_states": params + state}


def run_worker(mode: str, args: argparse.Namespace) -> Result:
    """Run one mode in this process (rank 0 of its world returns the measured row)."""
    device = _device()
    world = args.fake_world or 1
    reason = skip_reason(mode, device)
    if reason:
        return Result(mode, "skipped", world, reason)
    if device.type == "cpu":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_ranks))
    rank, world = _init_process_group(args.fake_world)
    try:
        step, note, owned_bytes = setup_mode(mode, args, device, world)
        x, y = _batch(args, gpt_config(args.model).vocab_size, rank, device)
        reset_peak_memory_stats(device)
        for _ in range(args.warmup):
            step(x, y)
        synchronize(device)
        blocked = getattr(step, "blocked", None)
        if blocked is not None:
            blocked.take()  # the timed steps' alone
        start = time.perf_counter()
        losses = [step(x, y) for _ in range(args.steps)]
        getattr(step, "finish", lambda: None)()
        synchronize(device)
        seconds = time.perf_counter() - start
        fake = args.fake_world > 0
        fpt = flops_per_token(args)
        compute_world = 1 if fake else world  # fake ranks do no work: per-rank numbers only
        tokens_per_s = compute_world * args.micro_batch * args.seq * args.steps / seconds
        tflops = fpt * tokens_per_s / compute_world / 1e12
        peak = _peak_tflops(device)
        result = Result(mode, "ok", world, tokens_per_s=tokens_per_s, tflops=tflops,
                        mfu=tflops / peak if peak else None, seconds=seconds,
                        losses=[float(v) for v in torch.stack(losses).float().cpu()], note=note,
                        exposed_comm_ms=None if blocked is None else 1e3 * blocked.take() / args.steps)
        if is_accelerator(device):
            result.peak_allocated_gib = max_memory_allocated(device) / GIB
            result.peak_reserved_gib = max_memory_reserved(device) / GIB
        if fake and owned_bytes is not None:
            result.owned_bytes = owned_bytes()
        if fake:
            fake_note = f"fake rank 0 of {world}: collectives send nothing (every rank holds rank 0's data)"
            result.note = ", ".join(filter(None, [note, fake_note]))
        dist.barrier()  # no rank tears down gloo while a peer still uses it (see tests/spawn.py)
        return result
    finally:
        dist.destroy_process_group()


def _peak_tflops(device: torch.device) -> float | None:
    if not is_accelerator(device):
        return None
    name = device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)
