"""`zerodp bench`: one GPT and one batch under every data-parallel mode, side by side.

Each mode runs in its own fresh process (torchrun for more than one rank), so no mode inherits
another's allocator state, compiled kernels or process group:
  plain            plain PyTorch: fp32 parameters, bf16 autocast (CUDA), fused AdamW
  ddp              DistributedDataParallel around the same
  fsdp2            torch.distributed.fsdp.fully_shard per block and root, bf16 params / fp32 reduce
  fsdp2-noreshard  the same with reshard_after_forward=False (ZeRO-2-like: no regather in backward)
  zerodp0/1/2      zerodp stages 0, 1, 2: bf16 working parameters, fp32 master (CUDA)
  deepspeed2       DeepSpeed ZeRO-2 with the same torch AdamW, when `import deepspeed` works
Every mode reports tokens/s, TFLOP/s per device (flops_per_token = 6N + 12·L·d·T), MFU against the
device's dense bf16 peak, CUDA peak allocated / reserved memory, and its TFLOP/s ratio to `plain`
measured in the same invocation. `--fake-world N` adds a memory-only run of zerodp stage 2 and FSDP2
acting as rank 0 of N ranks on the fake process group (collectives are no-ops).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .train.model import GPT, Block, gpt_config

MODES = {
    "plain": "PyTorch AMP, fused AdamW",
    "ddp": "DistributedDataParallel",
    "fsdp2": "fully_shard, reshard_after_forward=True",
    "fsdp2-noreshard": "fully_shard, reshard_after_forward=False",
    "zerodp0": "zerodp stage 0",
    "zerodp1": "zerodp stage 1",
    "zerodp2": "zerodp stage 2",
    "deepspeed2": "DeepSpeed ZeRO-2",
}
FAKE_MODES = ("zerodp2", "fsdp2", "fsdp2-noreshard")

# Dense bf16 tensor-core peak, TFLOP/s, by device-name substring (first match wins).
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("H20", 148.0),
               ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0)]
GIB = 2 ** 30


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
    note: str = ""
    samples: list[float] = field(default_factory=list)  # tokens/s of every repeat (--repeats)


# ---- the worker: one mode in this process ---------------------------------------------------------
def _init_process_group(device: torch.device, fake_world: int) -> tuple[int, int]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    else:  # a world of one needs no rendezvous: no port, no socket
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


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


def setup_mode(mode: str, args: argparse.Namespace, device: torch.device, world: int):
    """Build the mode's model and optimizer; returns (step function, note, owned-bytes function)."""
    bf16 = args.dtype == "bf16"
    model, note = build_model(args, device)
    if mode == "plain":
        return _torch_step(model, _adamw(model.parameters(), args, device), args, bf16, device), note, None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
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
        import zerodp
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": args.grad_clip, "bf16": {"enabled": bf16},
                  "zero_optimization": {"stage": int(mode[-1]),
                                        "overlap_param_gather": args.overlap_param_gather}}
        if args.bucket:
            config["zero_optimization"]["reduce_bucket_size"] = args.bucket
        engine = zerodp.initialize(model, _adamw(model.parameters(), args, device), config)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.detach()
        return step, note, lambda: engine_bytes(engine)
    if mode == "deepspeed2":
        import deepspeed  # the caller turned an ImportError into a 'skipped' row
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": args.grad_clip, "bf16": {"enabled": bf16},
                  "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}}
        if args.bucket:
            config["zero_optimization"].update(reduce_bucket_size=args.bucket, allgather_bucket_size=args.bucket)
        optimizer = _adamw(model.parameters(), args, device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def ds_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.detach()
        return ds_step, note, None
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


def _skip_reason(mode: str, device: torch.device) -> str:
    if mode == "deepspeed2" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (import deepspeed fails)"
    if mode == "deepspeed2" and device.type != "cuda":
        return "DeepSpeed ZeRO-2 is benchmarked on CUDA only (its CPU accelerator needs extra packages)"
    if mode.startswith("fsdp2") and importlib.util.find_spec("torch.distributed.fsdp") is None:
        return "this torch has no torch.distributed.fsdp"
    return ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(args: argparse.Namespace, vocab: int, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    tokens = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].contiguous().to(device)


def engine_bytes(engine) -> dict[str, int]:
    """Bytes the zerodp engine owns on this rank, by category: engine.memory_report()."""
    return {k: int(v) for k, v in engine.memory_report().items() if isinstance(v, (int, float))}


def owned_total(owned: dict[str, int]) -> int:
    """Model-state bytes of a report: its 'model_states' sum, else every category but CUDA peaks."""
    if "model_states" in owned:
        return owned["model_states"]
    return sum(v for k, v in owned.items() if not any(w in k for w in ("peak", "reserved", "allocated")))


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
    reason = _skip_reason(mode, device)
    if reason:
        return Result(mode, "skipped", world, reason)
    if device.type == "cpu":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_ranks))
    rank, world = _init_process_group(device, args.fake_world)
    try:
        step, note, owned_bytes = setup_mode(mode, args, device, world)
        x, y = _batch(args, gpt_config(args.model).vocab_size, rank, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.warmup):
            step(x, y)
        _sync(device)
        start = time.perf_counter()
        losses = [step(x, y) for _ in range(args.steps)]
        _sync(device)
        seconds = time.perf_counter() - start
        fake = args.fake_world > 0
        fpt = flops_per_token(args)
        compute_world = 1 if fake else world  # fake ranks do no work: per-rank numbers only
        tokens_per_s = compute_world * args.micro_batch * args.seq * args.steps / seconds
        tflops = fpt * tokens_per_s / compute_world / 1e12
        peak = _peak_tflops(device)
        result = Result(mode, "ok", world, tokens_per_s=tokens_per_s, tflops=tflops,
                        mfu=tflops / peak if peak else None, seconds=seconds,
                        losses=[float(v) for v in torch.stack(losses).float().cpu()], note=note)
        if device.type == "cuda":
            result.peak_allocated_gib = torch.cuda.max_memory_allocated(device) / GIB
            result.peak_reserved_gib = torch.cuda.max_memory_reserved(device) / GIB
        if fake and owned_bytes is not None:
            result.owned_bytes = owned_bytes()
        if fake:
            result.note = ", ".join(filter(None, [note, f"fake rank 0 of {world}: collectives are no-ops"]))
        return result
    finally:
        dist.destroy_process_group()


def _peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def source_commit() -> str | None:
    """The git commit of the zerodp source that ran (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores)"


# ---- the driver: one fresh process per mode ---------------------------------------------------------
def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--model", args.model, "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
            "--lr", str(args.lr), "--threads", str(args.threads), "--grad-clip", str(args.grad_clip),
            "--seed", str(args.seed), "--bucket", str(args.bucket),
            "--overlap-param-gather" if args.overlap_param_gather else "--no-overlap-param-gather",
            "--loss-chunk", str(args.loss_chunk)]
    return argv + (["--checkpointing"] if args.checkpointing else []) + (["--compile"] if args.compile else [])


def launch(mode: str, world: int, args: argparse.Namespace, fake_world: int = 0) -> Result:
    """Run one mode in a fresh process (torchrun for world > 1 or DeepSpeed) and read its row."""
    reason = _skip_reason(mode, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if reason:  # known before any process starts
        return Result(mode, "skipped", world, reason)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = _worker_argv(args) + ["--worker", mode, "--result", out, "--fake-world", str(fake_world)]
        if (world > 1 or mode == "deepspeed2") and not fake_world:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world}", "-m", "zerodp.bench", *argv]
        else:
            cmd = [sys.executable, "-m", "zerodp.bench", *argv]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            return Result(mode, "failed", world, f"timed out after {args.timeout} s")
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return Result(mode, "failed", world, f"exit {proc.returncode}: " + " | ".join(tail))
        with open(out) as f:
            return Result(**json.load(f))


def median_result(runs: list[Result]) -> Result:
    """The repeat with the median tokens/s (the lower middle one), every repeat's tokens/s kept."""
    ok = sorted((r for r in runs if r.status == "ok"), key=lambda r: r.tokens_per_s)
    if len(ok) < len(runs):  # a repeat that did not run makes the mode's row say why
        return next(r for r in runs if r.status != "ok")
    chosen = ok[(len(ok) - 1) // 2]
    chosen.samples = [r.tokens_per_s for r in runs]
    return chosen


def add_ratios(results: list[Result]) -> None:
    """Every measured mode's TFLOP/s per device over plain PyTorch's, from the same invocation."""
    plain = next((r for r in results if r.mode == "plain" and r.status == "ok"), None)
    for r in results:
        if plain is not None and r.status == "ok" and r.tflops is not None:
            r.ratio_to_plain = r.tflops / plain.tflops


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(title: str, results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for col in ["mode", "world", "tokens/s", "TFLOP/s", "MFU", "peak alloc GiB", "peak rsvd GiB",
                "vs plain", "loss first→last", "status / note"]:
        table.add_column(col, justify="left" if col in ("mode", "status / note") else "right")
    for r in results:
        loss = f"{r.losses[0]:.3f}→{r.losses[-1]:.3f}" if r.losses else "-"
        mfu = "n/a" if r.status == "ok" and r.mfu is None else _fmt(r.mfu and 100 * r.mfu, ".1f")
        status = r.status if r.status != "ok" else ""
        r_note = f"model states {owned_total(r.owned_bytes) / 2**20:,.1f} MiB" if r.owned_bytes else ""
        text = "; ".join(filter(None, [status, r.reason, r.note, r_note]))
        table.add_row(r.mode, str(r.world), _fmt(r.tokens_per_s, ",.0f"), _fmt(r.tflops, ".3g"), mfu,
                      _fmt(r.peak_allocated_gib, ".2f"), _fmt(r.peak_reserved_gib, ".2f"),
                      _fmt(r.ratio_to_plain, ".2f"), loss, text)
    Console(width=200).print(table)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerodp bench", description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--model", default="350M" if cuda else "tiny", help="a size of zerodp.train.model.SIZES")
    p.add_argument("--micro-batch", type=int, default=8 if cuda else 2)
    p.add_argument("--seq", type=int, default=1024 if cuda else 64)
    p.add_argument("--steps", type=int, default=20 if cuda else 5, help="timed steps")
    p.add_argument("--warmup", type=int, default=5 if cuda else 2, help="untimed steps first")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE",
                   help=f"any of {', '.join(MODES)} (plain is always run: it is the baseline)")
    p.add_argument("--world", type=int, default=1, help="ranks for every mode but plain (torchrun)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--compile", action="store_true", help="torch.compile every block, in every mode")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16" if cuda else "fp32",
                   help="compute precision (fp32 master weights and optimizer states either way)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU only: torch threads per rank (default: the cores shared among the ranks)")
    p.add_argument("--bucket", type=int, default=0,
                   help="reduce_bucket_size in elements for zerodp and DeepSpeed (0: each one's own "
                        "default, 5e7 for zerodp and 5e8 for DeepSpeed)")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="tokens per piece of the output head and loss, in every mode (GPTConfig.loss_chunk)")
    p.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="zerodp stages 1-2: the next forward waits for each bucket's parameter gather")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off in every mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fake-world", type=int, default=0,
                   help="also run zerodp2 and fsdp2 as rank 0 of N on the fake process group (memory)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every mode this many times, interleaved, and report the median")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mode before it counts as failed")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def modes_to_run(requested: list[str]) -> list[str]:
    """plain first (every ratio is to it), then the requested modes in order, once each."""
    return ["plain"] + [m for m in dict.fromkeys(requested) if m != "plain"]


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        result = run_worker(args.worker, args)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.result, "w") as f:
                json.dump(asdict(result), f)
        return
    try:  # a bad size fails here, once, not in every mode's process
        gpt_config(args.model, block_size=max(args.seq, 1))
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from None
    if args.world < 1 or args.repeats < 1:
        raise SystemExit(f"--world and --repeats must be at least 1, got {args.world} and {args.repeats}")
    modes = modes_to_run(args.modes)
    # Repeats go round all the modes in turn, so a drift in the machine's load hits every mode alike.
    rounds = [[launch(m, 1 if m == "plain" else args.world, args) for m in modes]
              for _ in range(args.repeats)]
    results = [median_result(list(runs)) for runs in zip(*rounds)]
    add_ratios(results)
    device = device_name()
    title = (f"{args.model}, micro-batch {args.micro_batch}, seq {args.seq}, {args.dtype}"
             f"{', checkpointing' if args.checkpointing else ''} — {device}")
    print_table(title, results)
    fake = [launch(m, args.fake_world, args, fake_world=args.fake_world) for m in FAKE_MODES] \
        if args.fake_world else []
    if fake:
        print_table(f"memory as rank 0 of {args.fake_world} (fake process group) — {device}", fake)
    if args.json:
        report = {"command": "zerodp bench " + shlex.join(sys.argv[1:] if argv is None else argv),
                  "device": device, "torch": torch.__version__, "zerodp_commit": source_commit(),
                  "args": vars(args),
                  "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
                  "results": [asdict(r) for r in results], "fake_world": [asdict(r) for r in fake]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
