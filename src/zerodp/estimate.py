"""`zerodp estimate`: per-rank memory of a GPT for any world size, from DESIGN.md's formula and from
one measured training step as rank 0 of N (memory.py holds the report and the formula it compares).

Planner: the fake process group (backend "fake": every collective returns at once, nothing is sent)
lets one process act as rank 0 of N ranks, so it allocates exactly rank 0's partitions; each
(N, stage) runs in its own subprocess because a process holds one default process group.
`--fake-tensors` measures the peak instead (see peak.py): two real training steps of rank 0 of N on
fake tensors, which allocate nothing, so any model size runs on a laptop; with `--fsdp2` FSDP2 is
measured beside zerodp the same way, with and without resharding after forward. The peak is split
by category (params, grads, master, optimizer states, buckets, activations, temporaries) at the
moment it is reached.
`--fit BUDGET` answers from estimates, not measurements (a search would need a run per candidate):
the formula, stage 2's bucket pool and `activation_estimate`; with --model it gives the largest
micro-batch, without it the largest named GPT size at --micro-batch.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from . import comm_plan
from .config import ZeroConfig
from .memory import WORKING_BYTES, activation_estimate, formula, memory_report
from .reducer import POOL_BUFFERS

_DEFAULT_BUCKET = ZeroConfig.model_fields["reduce_bucket_size"].default


# ---- one measured step as rank 0 of N (runs in a child process) ---------------------------------
def measure(spec: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """One measured step (see `_measure_here`) in a fresh Python process, so in a fresh process group."""
    return measure_many([spec], timeout)[0]


def measure_many(specs: list[dict[str, Any]], timeout: float | None = None) -> list[dict[str, Any]]:
    """Several measured steps one after another in one fresh Python process (cheaper to start);
    the process group is destroyed and created anew between them."""
    where = ", ".join(f"world={s['world']} stage={s['stage']}" for s in specs)
    return run_child(["zerodp.estimate", "--_measure", json.dumps(specs)], f"the measuring subprocess for {where}",
                     timeout)


def run_child(module_argv: list[str], what: str, timeout: float | None) -> Any:
    """`python -m <module_argv>` in a fresh process; its last stdout line, parsed as JSON."""
    out = subprocess.run([sys.executable, "-m", *module_argv], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure_here(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zerodp
    from zerodp.activations import checkpoint_blocks
    from zerodp.train.model import GPT, GPTConfig, Block

    world, stage = spec["world"], spec["stage"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(**spec["model"])
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.init_weights()
    psi = model.num_params()
    config = {"train_micro_batch_size_per_gpu": spec["micro_batch"],
              "gradient_accumulation_steps": spec.get("gas", 1),
              "zero_optimization": {"stage": stage,
                                    "reduce_bucket_size": spec.get("reduce_bucket_size", _DEFAULT_BUCKET),
                                    "mics_shard_size": spec.get("mics_shard_size", -1),
                                    "offload_optimizer": {"device": "cpu" if spec.get("offload") else "none"}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if spec["dtype"] != "fp32":
        config[spec["dtype"]] = {"enabled": True}
    rss0 = _rss()
    engine = zerodp.initialize(model, None, config)
    if spec.get("checkpointing"):
        checkpoint_blocks(engine.module, (Block,), engine.config.activation_checkpointing)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seq = spec["seq"]
    for _ in range(engine.gas):
        x = torch.randint(0, cfg.vocab_size, (spec["micro_batch"], seq), device=device)
        engine.backward(engine(x, x))
        engine.step()
    report = memory_report(engine)
    del engine, model
    dist.destroy_process_group()
    return {"num_params": psi, "report": report, "device": str(device),
            "peak_rss": _rss(), "rss_before_engine": rss0}


def _rss() -> int:
    """Peak resident set of this process in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- CLI ----------------------------------------------------------------------------------------
def parse_bytes(text: str) -> int:
    """'80GiB', '16GB', '1.5e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GiB, 16GB or 1.5e9")
    units = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return int(float(m.group(1)) * units[m.group(2)])


def _model_config(name: str | None, seq: int | None):
    from zerodp.train.model import SIZES, GPTConfig, gpt_config
    if name is None:
        return None
    if name in SIZES:
        return gpt_config(name)
    path = Path(name)
    if not path.exists():
        raise SystemExit(f"--model {name!r}: not a named size ({', '.join(SIZES)}) nor a JSON file")
    fields = json.loads(path.read_text())
    base = fields.pop("size", None)
    return gpt_config(base, **fields) if base else GPTConfig(**fields)


def human(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: '1.23 GiB', '456.0 MiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _num_params(cfg) -> int:
    with torch.device("meta"):
        from zerodp.train.model import GPT
        return GPT(cfg).num_params()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_measure"]:
        print(json.dumps([_measure_here(spec) for spec in json.loads(argv[1])]))
        return
    ap = argparse.ArgumentParser(prog="zerodp estimate", description=(
        "Per-rank memory for a GPT: docs/DESIGN.md's formula and one measured training step as rank 0 of "
        "N (fake process group, local device). --fit answers from the formula plus an activation "
        "estimate: the largest micro-batch for --model, or the largest named size without it."))
    ap.add_argument("--model", help="named size (tiny, small, 125M ... 13B) or a JSON file of GPTConfig fields")
    ap.add_argument("--world", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--stage", type=int, nargs="+", default=[1, 2], choices=[0, 1, 2, 3])
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, help="sequence length (default: the model's block_size)")
    ap.add_argument("--dtype", default="bf16", choices=list(WORKING_BYTES))
    ap.add_argument("--gas", type=int, default=1, help="gradient accumulation steps of the measured step")
    ap.add_argument("--checkpointing", action="store_true", help="checkpoint every block")
    ap.add_argument("--loss-chunk", type=int, default=None,
                    help="tokens per piece of the output head and loss (GPTConfig.loss_chunk)")
    ap.add_argument("--reduce-bucket-size", type=int, default=_DEFAULT_BUCKET,
                    help="elements (default: the engine's, %(default)s)")
    ap.add_argument("--no-measure", action="store_true", help="the formula only")
    ap.add_argument("--fake-tensors", action="store_true",
                    help="measure the peak of a training step on fake tensors (any size, no memory)")
    ap.add_argument("--fsdp2", action="store_true",
                    help="with --fake-tensors: also measure FSDP2 (reshard_after_forward True and False)")
    ap.add_argument("--plain", action="store_true",
                    help="with --fake-tensors: also measure plain PyTorch AMP in one process (fp32 "
                         "parameters, bf16 autocast), the baseline of zerodp bench")
    ap.add_argument("--json", help="with --fake-tensors: write the measurements here")
    ap.add_argument("--fit", type=parse_bytes, metavar="BUDGET", help="per-rank budget, e.g. 80GiB")
    comm_plan.add_arguments(ap)
    args = ap.parse_args(argv)

    from rich.console import Console
    console = Console()
    if args.fit is not None:
        console.print(_fit_table(args))
        return
    if args.model is None:
        ap.error("--model is required (it may be left out only with --fit)")
    cfg = _model_config(args.model, args.seq)
    if args.loss_chunk is not None:
        cfg.loss_chunk = args.loss_chunk
    seq = args.seq or cfg.block_size
    if (args.fsdp2 or args.plain) and not args.fake_tensors:
        ap.error("--fsdp2 and --plain are measured on fake tensors only: add --fake-tensors")
    if args.fake_tensors and args.gas != 1:
        ap.error("--fake-tensors measures one micro-step per step: leave --gas at 1")
    if args.fake_tensors and args.dtype == "fp16":
        ap.error("--fake-tensors cannot run fp16: the step's overflow check reads a value, which fake "
                 "tensors do not have; --dtype bf16 has the same sizes")
    if seq > cfg.block_size:  # the position table must cover the sequence, as bench builds it
        cfg.block_size = seq
    if args.fake_tensors:
        console.print(_peak_table(args, cfg, seq, console))
    else:
        console.print(_estimate_table(args, cfg, seq, console))
    if args.comm:  # bytes per step by collective and link, and the step-time model (comm_plan.py)
        from .train.model import GPT
        with torch.device("meta"):
            model = GPT(cfg)
        console.print(*comm_plan.section(args, model, args.micro_batch * seq * args.gas, WORKING_BYTES[args.dtype]))


def _estimate_table(args, cfg, seq: int, console):
    from rich.table import Table
    psi = _num_params(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = Table(title=f"GPT {args.model}: Ψ = {psi:,} parameters, {args.dtype}, AdamW, micro-batch "
                        f"{args.micro_batch} x {seq} tokens, per rank; measured on {device}")
    for col in ("N", "stage", "formula", "measured model states", "grads", "master+states",
                "buckets", "step transient", "peak" if device == "cuda" else "peak RSS (whole process)"):
        table.add_column(col, justify="right")
    for world in args.world:
        for stage in args.stage:
            f = formula(psi, world, stage, args.dtype, "adamw", args.gas)
            row = [str(world), str(stage), human(f)]
            if args.no_measure:
                table.add_row(*row, "-", *[""] * 5)
                continue
            spec = {"world": world, "stage": stage, "model": cfg.__dict__, "micro_batch": args.micro_batch,
                    "seq": seq, "dtype": args.dtype, "gas": args.gas, "checkpointing": args.checkpointing,
                    "reduce_bucket_size": args.reduce_bucket_size}
            try:
                with console.status(f"measuring N={world} stage={stage} ..."):
                    r = measure(spec)
            except RuntimeError as e:  # e.g. a stage the engine does not implement: say so, go on
                table.add_row(*row, "failed: " + str(e).strip().splitlines()[-1][-60:], *[""] * 5)
                continue
            rep = r["report"]
            peak = rep.get("cuda_peak_allocated", r["peak_rss"])
            table.add_row(*row, human(rep["model_states"]), human(rep["gradients"]),
                          human(rep["fp32_master"] + rep["optimizer_states"]), human(rep["reduce_buckets"]),
                          human(rep["step_transient"]), human(peak))
    table.caption = ("formula: docs/DESIGN.md (2/14 bytes split, fp32 grads when --gas > 1); measured: bytes of the "
                     "tensors the engine owns after one step, padding included. Peak is CUDA's "
                     "max_memory_allocated; on CPU only the process's peak RSS, which includes torch itself.")
    return table


def _peak_table(args, cfg, seq: int, console):
    """Peak per rank of one training step on fake tensors, zerodp stages (and FSDP2), by category."""
    from rich.table import Table

    from .peak import COLUMNS, measure_peaks
    psi = _num_params(cfg)
    base = {"model": cfg.__dict__, "micro_batch": args.micro_batch, "seq": seq, "dtype": args.dtype,
            "checkpointing": args.checkpointing}
    specs = [{**base, "mode": "zerodp", "stage": stage, "world": world,
              "reduce_bucket_size": args.reduce_bucket_size} for world in args.world for stage in args.stage]
    specs += [{**base, "mode": "fsdp2", "world": world, "reshard_after_forward": reshard}
              for world in args.world for reshard in (True, False)] if args.fsdp2 else []
    specs += [{**base, "mode": "plain", "world": 1}] if args.plain else []
    with console.status(f"measuring {len(specs)} configurations on fake tensors ..."):
        results = measure_peaks(specs)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    shown = [c for c in COLUMNS if any(r["at_peak"][c] for r in results)]
    table = Table(title=f"GPT {args.model}: Ψ = {psi:,} parameters, {args.dtype}, AdamW, micro-batch "
                        f"{args.micro_batch} x {seq} tokens{', checkpointing' if args.checkpointing else ''}: "
                        f"peak per rank as rank 0 of N, on fake tensors")
    for col in ("N", "mode", "model states (formula)", "peak", *shown, "peak reached in"):
        table.add_column(col, justify="left" if col in ("mode", "peak reached in") else "right")
    for r in results:
        spec = r["spec"]
        fsdp2 = spec["mode"] == "fsdp2"
        if fsdp2:
            mode = "FSDP2" if spec["reshard_after_forward"] else "FSDP2 no reshard"
        elif spec["mode"] == "plain":
            mode = "PyTorch AMP"
        else:
            mode = f"zerodp {spec['stage']}"
        # Plain AMP keeps fp32 parameters (its master) and fp32 gradients: 4 + 4 + 8 bytes each.
        f = (16 * psi if spec["mode"] == "plain" else
             formula(psi, spec["world"], 3 if fsdp2 else spec["stage"], args.dtype, "adamw"))
        table.add_row(str(spec["world"]), mode, human(f), human(r["peak"]),
                      *[human(r["at_peak"][c]) for c in shown], r["peak_at"])
    table.caption = ("model states: docs/DESIGN.md's formula (FSDP2 as stage 3). peak: the largest sum of live "
                     "tensors over two steps (PyTorch's MemTracker), split by category at that moment; "
                     "allocator rounding and library workspaces are not in it. FSDP2's params are its fp32 "
                     "shards (also its master), its gathered the unsharded bf16 parameters; 'no reshard' "
                     "keeps them from forward to backward, as stage 2 keeps its bf16 parameters.")
    return table


def _fit_table(args):
    """Largest micro-batch (--model) or named size (no --model) whose estimate fits the budget."""
    from rich.table import Table
    from zerodp.train.model import SIZES, gpt_config
    budget = args.fit
    kind = "largest micro-batch" if args.model else f"largest named model at micro-batch {args.micro_batch}"
    table = Table(title=f"{kind} within {human(budget)} per rank", min_width=len(kind) + 30)
    table.caption = (f"estimated, not measured: formula + stage 2's reduce bucket pool + activation "
                     f"estimate ({args.dtype}{', checkpointing' if args.checkpointing else ''})")
    table.add_column("N", justify="right")
    for s in args.stage:
        table.add_column(f"stage {s}", justify="right")

    def need(cfg, psi, world, stage, b):
        # Only stage 2 has a bucket pool (reducer.POOL_BUFFERS buffers of the largest bucket).
        buckets = POOL_BUFFERS * min(psi, args.reduce_bucket_size) * WORKING_BYTES[args.dtype] if stage == 2 else 0
        return (formula(psi, world, stage, args.dtype, "adamw", args.gas) + buckets
                + activation_estimate(cfg, b, args.seq or cfg.block_size, args.dtype, args.checkpointing))

    configs = [_model_config(args.model, args.seq)] if args.model else [gpt_config(n) for n in SIZES]
    sized = [(cfg, _num_params(cfg)) for cfg in configs]
    for world in args.world:
        row = [str(world)]
        for stage in args.stage:
            if args.model:
                (cfg, psi), = sized
                fits = lambda b: need(cfg, psi, world, stage, b) <= budget  # noqa: E731
                lo, hi = 0, 1
                while fits(hi) and hi <= 1 << 24:  # double, then bisect between last fit and first miss
                    lo, hi = hi, hi * 2
                while lo and hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
                row.append(str(lo) if lo else "none")
            else:
                names = [n for n, (cfg, psi) in zip(SIZES, sized)
                         if need(cfg, psi, world, stage, args.micro_batch) <= budget]
                row.append(names[-1] if names else "none")
        table.add_row(*row)
    return table


if __name__ == "__main__":
    main()
