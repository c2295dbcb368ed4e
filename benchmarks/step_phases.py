"""Where a training step's time goes, zerodp against plain PyTorch in the same process.

Times forward, backward and optimizer step separately (median over --steps after --warmup) for plain
PyTorch (fused AdamW, clip_grad_norm_) and for zerodp stages 0-3 on the same GPT and batch, one process,
world of one, and prints each phase's ratio to plain. The phases zerodp adds work to are backward
(gradient hooks copying into buckets) and step (norm, unscale/clip, masters, working-copy update),
so this isolates the engine's overhead from the model's compute.

    python benchmarks/step_phases.py --model small --micro-batch 4 --seq 256
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import zerodp
from zerodp.distributed.device import empty_cache, is_accelerator, local, synchronize
from zerodp.models.gpt import GPT, gpt_config


def _sync(device: torch.device) -> None:
    if is_accelerator(device):
        synchronize(device)


def _clock(device: torch.device) -> float:
    # On CPU the process's own CPU time: the 2-core machines this runs on are shared, and wall time
    # there measures the neighbours as much as the code. On CUDA, wall time after a synchronize.
    return time.perf_counter() if is_accelerator(device) else time.process_time()


def measure(mode: str, args, device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(gpt_config(args.model, block_size=args.seq)).to(device)
    # fused on every device, as zerodp bench: the foreach form's full-size temporaries cost fresh
    # pages on the CPU every step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    bf16 = args.dtype == "bf16"
    if mode == "plain":
        step_fn, fwd = None, model
    else:
        cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
               "zero_optimization": {"stage": int(mode[-1])}}
        if bf16:
            cfg["bf16"] = {"enabled": True}
        engine = zerodp.initialize(model, opt, cfg)
        fwd = engine
    x = torch.randint(0, model.config.vocab_size, (args.micro_batch, args.seq), device=device)
    phases = {"forward": [], "backward": [], "step": []}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and mode == "plain")
    for i in range(args.warmup + args.steps):
        _sync(device)
        t0 = _clock(device)
        with autocast:
            loss = fwd(x, x)
        _sync(device)
        t1 = _clock(device)
        if mode == "plain":
            loss.backward()
        else:
            engine.backward(loss)
        _sync(device)
        t2 = _clock(device)
        if mode == "plain":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            engine.step()
        _sync(device)
        t3 = _clock(device)
        if i >= args.warmup:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[k].append(v)
    return {k: statistics.median(v) for k, v in phases.items()}


def rounds(modes: list[str], args, device: torch.device, n: int = 3) -> dict[str, list[dict[str, float]]]:
    """`n` interleaved rounds of every mode (drifting machine load falls on every mode alike)."""
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(n):
        for m in modes:
            rows[m].append(measure(m, args, device))
            # The engine and its model hold each other through hooks, so they outlive measure() until a
            # collection; collect them and give their cached blocks back to the device before the next
            # mode builds its own (15 engines of a 1.3B model do not fit together on one GPU).
            gc.collect()
            empty_cache(device)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--modes", nargs="+", default=["plain", "zerodp0", "zerodp1", "zerodp2", "zerodp3"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = local(0)
    modes = ["plain"] + [m for m in args.modes if m != "plain"]
    rows = rounds(modes, args, device)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in rows.items()}
    base = med["plain"]
    clock = "wall" if is_accelerator(device) else "process CPU"
    print(f"{device.type} ({clock} time), torch {torch.__version__}, {args.model} GPT, micro-batch {args.micro_batch}, "
          f"seq {args.seq}, {args.dtype}, {args.threads} thread(s); median ms of 3 rounds x {args.steps} steps")
    print(f"{'mode':<9}" + "".join(f"{k:>18}" for k in ("forward", "backward", "step", "total")))
    for m, ph in med.items():
        total = sum(ph.values())
        cells = [(ph[k], ph[k] / base[k]) for k in ("forward", "backward", "step")]
        cells.append((total, total / sum(base.values())))
        print(f"{m:<9}" + "".join(f"{v * 1e3:>10.1f} ({r:4.2f}x)" for v, r in cells))


if __name__ == "__main__":
    main()
