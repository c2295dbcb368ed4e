"""Correctness on the device: zerodp against plain PyTorch on one GPT, with deterministic kernels.

The comparisons of issue 27, each a line of the check's summary as soon as it ends:
  fp32 stage 0-3 vs plain     fp32 masters and losses after --steps steps, to 1e-5
  bf16 stage 1-3 vs stage 0   the bf16 stages against each other (same kernels, same data: to 1e-5)
  bf16 stage 0 vs plain AMP   losses only (bf16 parameters against fp32 ones under autocast: 2e-2)
  offload_optimizer           stage 2 with its optimizer stepped in host memory vs the same on device
  offload_param               stage 3 with its parameter shards in host memory vs without
  activation offload x2       cpu_checkpointing twice vs plain checkpointing (1e-6), and the two runs
                              bit for bit: a side stream's copy read before it landed shows up there
  small buckets stage 2/3     fp32, a bucket about a thousandth of the model, vs plain
  fake world 8, stage 1-3     rank 0 of 8 on the fake process group: memory_report()'s model states
                              against DESIGN.md's formula (stage 3: 16Ψ/N), and steps that stay finite

On CUDA it runs the 125M GPT (micro-batch 4 x 256 tokens, math attention, deterministic algorithms,
no TF32); on a CPU the "tiny" one (2 x 16 tokens, one thread), the same code, in seconds. One
process, engines built one after another, each freed (gc, the allocator's cache emptied) before the
next.

    python benchmarks/gpu/correctness.py --summary out/summary.jsonl
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: set before CUDA loads it

import argparse
import contextlib
import gc
import json
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import zerodp
from zerodp.engine.engine import inside
from zerodp.activations import checkpoint_blocks
from zerodp.distributed import device as dev
from zerodp.distributed.comm import init_fake
from zerodp.plan.formulas import formula
from zerodp.models.gpt import GPT, Block, gpt_config

FP32_TOL = 1e-5      # largest |difference| of an fp32 master weight, and of a loss (relative)
AMP_LOSS_TOL = 2e-2  # relative loss difference, zerodp bf16 against plain PyTorch AMP
FORMULA_TOL = 0.01   # memory_report's model states against the formula (padding)
OFFLOAD_TOL = 1e-6   # activation offload against plain checkpointing: the same kernels on the same bits


@dataclass
class Setup:
    """What every run in this process trains: the same GPT, batches, optimizer and clipping."""

    model: str
    micro_batch: int
    seq: int
    steps: int
    device: torch.device
    lr: float = 1e-4
    clip: float = 1.0


def setup_for(device: torch.device, steps: int) -> Setup:
    if dev.is_accelerator(device):
        return Setup("125M", 4, 256, steps, device)
    return Setup("tiny", 2, 16, steps, device)


def batches(s: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    vocab = gpt_config(s.model).vocab_size
    tokens = [torch.randint(0, vocab, (s.micro_batch, s.seq + 1), generator=g) for _ in range(s.steps)]
    return [(t[:, :-1].to(s.device), t[:, 1:].contiguous().to(s.device)) for t in tokens]


def build(s: Setup) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device(s.device):
        model = GPT(gpt_config(s.model, block_size=max(s.seq, 64)))
    return model, torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1, fused=True)


def release() -> None:
    """Free the last run's model, engine and optimizer (reference cycles through hooks) and give the
    allocator's cache back, so each run starts from the same device memory. (Not on the CPU, where
    the tiny models' memory does not matter and a full collection costs more than their runs.)"""
    device = dev.local(0)
    if dev.is_accelerator(device):
        gc.collect()
        dev.empty_cache(device)


def train_plain(s: Setup, amp: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: fp32 parameters, optionally bf16 autocast, clip_grad_norm_, fused AdamW."""
    model, opt = build(s)
    losses = []
    for x, y in batches(s):
        with torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    out = [float(v) for v in losses]
    del model, opt
    release()
    return out, state


def zero_config(s: Setup, stage: int, bf16: bool, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": s.clip, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, **zero}}


def train_zerodp(s: Setup, config: dict, activations: dict | None = None,
                 ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training under zerodp.initialize(config); `activations` checkpoints every block with
    that activation_checkpointing section (None: no checkpointing)."""
    model, opt = build(s)
    engine = zerodp.initialize(model, opt, config)
    if activations is not None:
        checkpoint_blocks(engine.module, (Block,), activations)
    losses = []
    for x, y in batches(s):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    state = engine.full_state_dict()
    out = [float(v) for v in losses]
    del model, opt, engine
    release()
    return out, state


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = [k for k in a if k in b and a[k].is_floating_point()]
    if not keys:
        raise ValueError("the two runs share no floating-point weights to compare")
    return max(float((a[k].float() - b[k].float().to(a[k].device)).abs().max()) for k in keys)


def max_loss_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


class Report:
    """Prints each comparison and appends it to the summary as one JSON line, as it ends."""

    def __init__(self, summary: str | None, s: Setup):
        self.summary, self.setup, self.failed, self.done = summary, s, 0, 0

    def line(self, check: str, ok: bool, result: str, **detail) -> None:
        self.failed += not ok
        self.done += 1
        row = {"piece": f"correctness: {check}", "status": "ok" if ok else "FAIL", "result": result,
               "model": self.setup.model, **detail}
        print(f"{'ok  ' if ok else 'FAIL'} {check}: {result}", flush=True)
        if self.summary:
            with open(self.summary, "a") as f:
                f.write(json.dumps(row) + "\n")

    def compare(self, check: str, got, want, tol: float, loss_tol: float | None = None,
                params: bool = True, seconds: float = 0.0) -> None:
        dp = max_param_diff(got[1], want[1]) if params else None
        dl = max_loss_diff(got[0], want[0])
        lt = tol if loss_tol is None else loss_tol
        finite = all(math.isfinite(v) for v in got[0])
        ok = finite and dl <= lt and (dp is None or dp <= tol)
        text = f"loss diff {dl:.1e} (tol {lt:g})"
        if dp is not None:
            text = f"weight diff {dp:.1e} (tol {tol:g}), " + text
        text += f"; losses {got[0][0]:.4f}->{got[0][-1]:.4f}"
        self.line(check, ok, text, loss_diff=dl, weight_diff=dp, tol=tol, seconds=round(seconds, 2))


def timed(fn: Callable, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def check_fp32(s: Setup, r: Report, ref: dict) -> None:
    ref["plain"], secs = timed(train_plain, s)
    r.line("plain fp32 reference", all(map(math.isfinite, ref["plain"][0])),
           f"losses {ref['plain'][0][0]:.4f}->{ref['plain'][0][-1]:.4f}", seconds=round(secs, 2))
    for stage in range(4):
        got, secs = timed(train_zerodp, s, zero_config(s, stage, bf16=False))
        r.compare(f"fp32 stage {stage} vs plain", got, ref["plain"], FP32_TOL, seconds=secs)


def check_bf16(s: Setup, r: Report, ref: dict) -> None:
    for stage in range(4):
        ref[f"bf16-{stage}"], secs = timed(train_zerodp, s, zero_config(s, stage, bf16=True))
        if stage:
            r.compare(f"bf16 stage {stage} vs stage 0", ref[f"bf16-{stage}"], ref["bf16-0"], FP32_TOL,
                      seconds=secs)
    amp, secs = timed(train_plain, s, amp=True)
    r.compare("bf16 stage 0 vs plain AMP (losses)", ref["bf16-0"], amp, FP32_TOL, loss_tol=AMP_LOSS_TOL,
              params=False, seconds=secs)


def check_offload(s: Setup, r: Report, ref: dict) -> None:
    cfg = zero_config(s, 2, bf16=True, offload_optimizer={"device": "cpu"})
    got, secs = timed(train_zerodp, s, cfg)
    r.compare("offload_optimizer (stage 2) vs on device", got, ref["bf16-2"], FP32_TOL, seconds=secs)
    cfg = zero_config(s, 3, bf16=True, offload_param={"device": "cpu"})
    got, secs = timed(train_zerodp, s, cfg)
    r.compare("offload_param (stage 3) vs on device", got, ref["bf16-3"], FP32_TOL, seconds=secs)


def check_activation_offload(s: Setup, r: Report, ref: dict) -> None:
    cfg = zero_config(s, 2, bf16=True)
    plain_ckpt, secs = timed(train_zerodp, s, cfg, activations={})
    r.compare("plain checkpointing vs none", plain_ckpt, ref["bf16-2"], FP32_TOL, seconds=secs)
    runs = []
    for run in (1, 2):
        got, secs = timed(train_zerodp, s, cfg, activations={"cpu_checkpointing": True})
        r.compare(f"activation offload run {run} vs plain checkpointing", got, plain_ckpt, OFFLOAD_TOL, seconds=secs)
        runs.append(got)
    # The same code on the same numbers with deterministic kernels: a copy read before it landed is
    # the one way two runs can differ.
    r.compare("activation offload run 2 vs run 1 (bitwise)", runs[1], runs[0], 0.0)


def check_small_buckets(s: Setup, r: Report, ref: dict) -> None:
    numel = sum(v.numel() for k, v in ref["plain"][1].items() if k != "lm_head.weight")
    bucket = max(1000, numel // 1000)
    for stage in (2, 3):
        zero = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
        if stage == 3:
            zero.update(stage3_prefetch_bucket_size=bucket, stage3_param_persistence_threshold=0)
        got, secs = timed(train_zerodp, s, zero_config(s, stage, bf16=False, **zero))
        r.compare(f"fp32 stage {stage}, {bucket:,}-element buckets, vs plain", got, ref["plain"], FP32_TOL,
                  seconds=secs)


def fake_world_stage(s: Setup, stage: int, world: int) -> dict:
    """One engine as rank 0 of `world` fake ranks: its model states against the formula, and steps."""
    model, opt = build(s)
    psi = model.num_params()
    engine = zerodp.initialize(model, opt, zero_config(s, stage, bf16=True))
    losses = []
    for x, y in batches(s):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    report = engine.memory_report()  # after the steps: AdamW makes its states in the first one
    owned = report["model_states"]
    masters = inside(engine).training.partitioned_optimizer.masters
    finite = all(bool(torch.isfinite(m).all()) for m in masters) and all(map(math.isfinite, losses))
    out = {"psi": psi, "owned": owned, "formula": formula(psi, world, stage, "bf16"), "losses": losses,
           "finite": finite, "skipped_steps": getattr(engine, "skipped_steps", None)}
    del model, opt, engine, masters
    release()
    return out


def check_fake_world(s: Setup, r: Report, ref: dict, world: int = 8) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    init_fake(world)
    try:
        for stage in (1, 2, 3):
            got, secs = timed(fake_world_stage, s, stage, world)
            rel = got["owned"] / got["formula"] - 1
            ok = abs(rel) <= FORMULA_TOL and got["finite"] and got["skipped_steps"] in (0, None)
            what = "16Ψ/N" if stage == 3 else "formula"
            r.line(f"fake world {world}, stage {stage}: memory_report vs {what}", ok,
                   f"model states {got['owned'] / 2**20:,.2f} MiB vs {got['formula'] / 2**20:,.2f} MiB "
                   f"({rel:+.2%}, tol {FORMULA_TOL:.0%}); {len(got['losses'])} steps, finite={got['finite']}, "
                   f"skipped={got['skipped_steps']}", seconds=round(secs, 2),
                   **{k: got[k] for k in ("psi", "owned", "formula", "skipped_steps")})
    finally:
        dist.destroy_process_group()


CHECKS = {"fp32": check_fp32, "bf16": check_bf16, "offload": check_offload,
          "activation-offload": check_activation_offload, "small-buckets": check_small_buckets,
          "fake-world": check_fake_world}
# What each check compares against, run by the check that makes it when that one was not asked for.
NEEDS = {"offload": "bf16", "activation-offload": "bf16", "small-buckets": "fp32"}


@contextlib.contextmanager
def deterministic():
    """Deterministic algorithms, no TF32, and math attention (flash and memory-efficient attention
    accumulate with atomics in backward), so two runs of the same numbers give the same bits."""
    if not dev.is_accelerator(dev.local(0)):  # the CPU's kernels are; and the switch imports dynamo (seconds)
        yield
        return
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32


def run(checks: list[str], steps: int, summary: str | None) -> int:
    """Run the named checks in order; the number that failed (an exception counts as one)."""
    device = dev.local(0)
    if not dev.is_accelerator(device):
        torch.set_num_threads(1)  # the tiny model's kernels are too small to share out
    s = setup_for(device, steps)
    r, ref = Report(summary, s), {}
    print(f"correctness on {dev.device_name(device) if dev.is_accelerator(device) else 'CPU'}: "
          f"{s.model} GPT, micro-batch {s.micro_batch} x {s.seq} tokens, {s.steps} steps", flush=True)
    todo = list(dict.fromkeys([NEEDS[c] for c in checks if c in NEEDS and NEEDS[c] not in checks] + checks))
    with deterministic():
        for name in todo:
            try:
                CHECKS[name](s, r, ref)
            except Exception as e:  # noqa: BLE001 - one check's failure is a line; the next still runs
                r.line(name, False, f"{type(e).__name__}: {e}".splitlines()[0][:300])
                release()
    print(f"{r.done - r.failed} of {r.done} comparisons ok")
    return r.failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checks", nargs="+", default=list(CHECKS), choices=list(CHECKS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--summary", help="append one JSON line per comparison to this file")
    args = p.parse_args()
    raise SystemExit(1 if run(args.checks, args.steps, args.summary) else 0)


if __name__ == "__main__":
    main()
