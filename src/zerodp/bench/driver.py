"""`zerodp bench`: one GPT and one batch under every data-parallel mode, side by side.

The driver: it runs each mode in a fresh process (`python -m zerodp.bench --worker MODE`, under
torchrun for more than one rank; worker.py is what runs there), or with --fork on a CPU in a fork of
one server process that imported all that once, goes round the modes --repeats times (A B C, A B C, ...),
keeps each mode's median and spread, adds every mode's ratio to plain PyTorch of the same invocation and,
round by round, to DDP and FSDP2 (spread.py), says which zerodp modes can be told apart from those two,
and prints and writes the table (--json: every repeat's row too, in the order they ran).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict

# torch and the worker are imported on use: `zerodp bench --help` answers before torch loads.
from zerodp.bench.rows import DEEPSPEED_PAIRS, FAKE_MODES, MODES, Result
from zerodp.bench.spread import MIN_REPEATS, RATIO_BASELINES, Spread, pairs_that_matter, round_ratios, spread, tell_apart

# Defaults that depend on the device, (CUDA, CPU): filled in after parsing (main), when torch is loaded.
# On CPU, every mode but plain runs on the train job's 2 ranks.
_DEVICE_DEFAULTS = {"model": ("350M", "tiny"), "micro_batch": (8, 2), "seq": (1024, 64), "steps": (20, 5),
                    "warmup": (5, 2), "dtype": ("bf16", "fp32"), "world": (1, 2)}
# Said under every CPU table: a CPU computes slowly next to its memory copies and gloo's collectives,
# so the communication and bookkeeping that a GPU's speed exposes weigh differently there.
CPU_NOTE = ("measured on a CPU: these ratios are not GPU ratios (a CPU's slow compute hides communication "
            "and memory traffic that a GPU exposes, and gloo is not NCCL); benchmarks/RESULTS.md has GPU rows")
# --shape: issue 44's two, where communication (2 x 64) and compute (4 x 256) dominate in turn, and "train", the
# shape `zerodp train` runs by default (train_shape). Each sets --model, --micro-batch and --seq.
SHAPES = {"2x64": {"model": "small", "micro_batch": 2, "seq": 64},
          "4x256": {"model": "small", "micro_batch": 4, "seq": 256}, "train": None}


def train_shape() -> dict[str, object]:
    """The model, micro-batch and sequence length of `zerodp train` with its default options."""
    from zerodp.models.sizes import SIZES
    from zerodp.train.options import DEFAULTS  # torch-free, as this driver before a mode runs

    model = DEFAULTS["model"]
    return {"model": model, "micro_batch": DEFAULTS["micro_batch"],
            "seq": DEFAULTS["block_size"] or SIZES[model]["block_size"]}


def apply_shape(args: argparse.Namespace) -> None:
    """--shape fills --model, --micro-batch and --seq; one of them given otherwise is refused by name."""
    if args.shape is None:
        return
    for key, value in (SHAPES[args.shape] or train_shape()).items():
        given = getattr(args, key)
        if given is not None and given != value:
            flag = "--" + key.replace("_", "-")
            raise SystemExit(f"--shape {args.shape} sets {flag} {value}, and {flag} {given} was given: "
                             f"drop {flag} or --shape")
        setattr(args, key, value)


def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--model", args.model, "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
            "--lr", str(args.lr), "--threads", str(args.threads), "--grad-clip", str(args.grad_clip),
            "--seed", str(args.seed), "--bucket", str(args.bucket),
            "--overlap-param-gather" if args.overlap_param_gather else "--no-overlap-param-gather",
            "--loss-chunk", str(args.loss_chunk)]
    return argv + (["--checkpointing"] if args.checkpointing else []) + (["--compile"] if args.compile else [])


def launch(mode: str, world: int, args: argparse.Namespace, fake_world: int = 0) -> Result:
    """Run one mode in processes of its own (a launcher's ranks for world > 1 or DeepSpeed) and read its row."""
    from zerodp.bench.worker import skip_reason
    from zerodp.distributed.device import local

    reason = skip_reason(mode, local(0))
    if reason:  # known before any process starts
        return Result(mode, "skipped", world, reason)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = _worker_argv(args) + ["--worker", mode, "--result", out, "--fake-world", str(fake_world)]
        ranks = world if (world > 1 or mode.startswith("deepspeed")) and not fake_world else 0  # 0: no launcher
        try:
            code, output = (_forked if args.fork else _fresh)(argv, ranks, args.timeout, tmp)
        except KeyboardInterrupt:  # the mode is stopped (by _forked, or the terminal's signal reached it)
            raise SystemExit(f"zerodp bench: stopped by Ctrl-C while mode {mode} ran") from None
        if code is None:
            return Result(mode, "failed", world, f"timed out after {args.timeout} s")
        if code != 0 or not os.path.exists(out):
            tail = output.strip().splitlines()[-3:]
            return Result(mode, "failed", world, f"exit {code}: " + " | ".join(tail))
        with open(out) as f:
            return Result(**json.load(f))


def _fresh(argv: list[str], ranks: int, timeout: float, tmp: str) -> tuple[int | None, str]:
    """The mode in a fresh interpreter: the worker, or torchrun starting `ranks` of them. Returns the exit
    code (None: timed out) and what it printed (stderr, else stdout)."""
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "zerodp.bench", *argv]
    else:
        cmd = [sys.executable, "-m", "zerodp.bench", *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, ""
    return proc.returncode, proc.stderr or proc.stdout


# What the fork server imports once, for every mode forked from it: torch, the worker, the engine, FSDP2, DDP,
# dynamo (activation checkpointing imports it), the elastic launcher and the fake process group. Each import left
# to the modes is paid again by each (a fresh interpreter's share of them: ~5 CPU s).
FORK_PRELOAD = ("zerodp.bench.driver", "zerodp.bench.worker", "zerodp.activations", "zerodp.engine.engine",
                "zerodp.engine.summary", "torch._dynamo", "torch.distributed.fsdp", "torch.nn.parallel",
                "torch.distributed.launcher.api", "torch.testing._internal.distributed.fake_pg")


def _forked(argv: list[str], ranks: int, timeout: float, tmp: str) -> tuple[int | None, str]:
    """--fork: the mode in a fork of multiprocessing's fork server, a process started once that imported
    torch and the worker (FORK_PRELOAD) and has computed nothing: a fork of this process could hang in its
    first multi-threaded op when this one has used OpenMP threads (a Python session, a test). As _fresh
    returns."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORK_PRELOAD))  # read when the server starts, the first time
    log = os.path.join(tmp, "output.log")
    proc = context.Process(target=_forked_mode, args=(argv, ranks, log, dict(os.environ), os.getcwd()))
    proc.start()
    # The mode is a session of its own (_forked_mode): the Ctrl-C or SIGTERM a terminal or `timeout` sends this
    # driver's group does not reach it, so the driver ends it, as it does one that ran past `timeout`.
    try:
        with _sigterm_raises():
            proc.join(timeout)
        timed_out = proc.exitcode is None
    finally:
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.join()
    if timed_out:
        return None, ""
    with open(log) as f:
        return proc.exitcode, f.read()


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises SystemExit(143) in here, so that the finally blocks around it run (in the main thread,
    the only one where Python can take a signal; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame) -> None:
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _forked_mode(argv: list[str], ranks: int, log: str, environ: dict[str, str], cwd: str) -> None:
    """In the fork: this driver's environment and directory (not the server's, from when it started),
    output to `log`; the worker, or torch's elastic launcher (what torchrun runs) forking `ranks` of them."""
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    if not ranks:
        main(argv)
        return
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method="fork")
    elastic_launch(config, main)(argv)


def median_result(runs: list[Result]) -> Result:
    """The repeat with the median tokens/s (the lower middle one), every repeat's tokens/s kept."""
    ok = sorted((r for r in runs if r.status == "ok"), key=lambda r: r.tokens_per_s)
    if len(ok) < len(runs):  # a repeat that did not run makes the mode's row say why
        return next(r for r in runs if r.status != "ok")
    chosen = ok[(len(ok) - 1) // 2]
    chosen.samples = [r.tokens_per_s for r in runs]
    return chosen


def add_ratios(results: list[Result]) -> None:
    """Every measured mode's TFLOP/s per device over plain PyTorch's, from the same invocation; and a
    zerodp mode's step time over its DeepSpeed counterpart's (DEEPSPEED_PAIRS), when both ran."""
    ok = {r.mode: r for r in results if r.status == "ok"}
    plain = ok.get("plain")
    for r in results:
        if plain is not None and r.status == "ok" and r.tflops is not None:
            r.ratio_to_plain = r.tflops / plain.tflops
        theirs = ok.get(DEEPSPEED_PAIRS.get(r.mode, ""))
        if r.status == "ok" and theirs is not None and r.world == theirs.world:
            # same tokens per step in both: the step-time ratio is the inverse tokens/s ratio
            r.step_vs_deepspeed = theirs.tokens_per_s / r.tokens_per_s


def mode_spreads(results: list[Result]) -> dict[str, dict[str, Spread]]:
    """For each mode measured in every round: its tokens/s spread ("tokens_per_s") and, round by round, its
    ratio to each baseline (RATIO_BASELINES) measured in every round too, under the baseline's name."""
    ok = {r.mode: r.samples for r in results if r.status == "ok" and r.samples}
    spreads = {}
    for mode, samples in ok.items():
        spreads[mode] = {"tokens_per_s": spread(samples)}
        for base in RATIO_BASELINES:
            if base in ok:
                spreads[mode][base] = spread(round_ratios(samples, ok[base]))
    return spreads


def verdicts(results: list[Result]):
    """Each zerodp mode against DDP and FSDP2 (spread.pairs_that_matter), both measured in every round."""
    samples = {r.mode: r.samples for r in results if r.status == "ok" and r.samples}
    return [tell_apart(mode, samples[mode], other, samples[other])
            for mode, other in pairs_that_matter(list(samples))]


def owned_total(owned: dict[str, int]) -> int:
    """Model-state bytes of a report: its 'model_states' sum, else every category but CUDA peaks."""
    if "model_states" in owned:
        return owned["model_states"]
    return sum(v for k, v in owned.items() if not any(w in k for w in ("peak", "reserved", "allocated")))


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _range(s: Spread | None, spec: str) -> str:
    return "-" if s is None else f"{s.low:{spec}}-{s.high:{spec}}"


def _ratio(s: Spread | None) -> str:
    """A round-by-round ratio: its median, and its lowest and highest round."""
    return "-" if s is None else f"{s.median:.2f} ({s.low:.2f}-{s.high:.2f})"


# The table's columns; "tokens/s min-max", "vs ddp" and "vs fsdp2" are the spread over the repeats; "exposed comm
# ms" the median repeat's ms per step that rank 0 waited in zerodp's collectives (communication not overlapped).
COLUMNS = ["mode", "world", "tokens/s", "tokens/s min-max", "vs ddp (rounds)", "vs fsdp2 (rounds)", "TFLOP/s",
           "MFU", "peak alloc / rsvd GiB", "vs plain", "step vs DS", "exposed comm ms", "loss first→last",
           "status / note"]


def print_table(title: str, results: list[Result], spreads: dict[str, dict[str, Spread]] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for col in COLUMNS:  # only the note wraps: a number split over two lines misreads
        table.add_column(col, justify="left" if col in ("mode", "status / note") else "right",
                         no_wrap=col != "status / note")
    for r in results:
        own = (spreads or {}).get(r.mode, {})
        loss = f"{r.losses[0]:.3f}→{r.losses[-1]:.3f}" if r.losses else "-"
        mfu = "n/a" if r.status == "ok" and r.mfu is None else _fmt(r.mfu and 100 * r.mfu, ".1f")
        peak = "-" if r.peak_allocated_gib is None else f"{r.peak_allocated_gib:.2f} / {r.peak_reserved_gib:.2f}"
        status = r.status if r.status != "ok" else ""
        r_note = f"model states {owned_total(r.owned_bytes) / 2**20:,.1f} MiB" if r.owned_bytes else ""
        text = "; ".join(filter(None, [status, r.reason, r.note, r_note]))
        table.add_row(r.mode, str(r.world), _fmt(r.tokens_per_s, ",.0f"), _range(own.get("tokens_per_s"), ",.0f"),
                      _ratio(own.get("ddp")), _ratio(own.get("fsdp2")), _fmt(r.tflops, ".3g"), mfu, peak,
                      _fmt(r.ratio_to_plain, ".2f"), _fmt(r.step_vs_deepspeed, ".2f"), _fmt(r.exposed_comm_ms, ".1f"),
                      loss, text)
    Console(width=220).print(table)


def print_verdicts(found: list) -> None:
    """One line per pair that matters: told apart or not at the spread measured (spread.Verdict)."""
    if found:
        print(f"told apart? (tokens/s ranges over the repeats do not overlap; {MIN_REPEATS} repeats at least)")
    for v in found:
        print(f"  {v.sentence()}")


def source_commit() -> str | None:
    """The git commit of the zerodp source that ran (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def device_name() -> str:
    from zerodp.distributed.device import device_name as accelerator_name
    from zerodp.distributed.device import local

    device = local(0)
    if device.type != "cpu":
        return accelerator_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerodp bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES),
                   help="sets --model, --micro-batch and --seq: 2x64 and 4x256 (small, micro-batch x sequence "
                        "length), train (what `zerodp train` runs by default: small, 8 x 256)")
    p.add_argument("--model", help="a size of zerodp.models.gpt.SIZES" + _default("model"))
    p.add_argument("--micro-batch", type=int, help="sequences per rank" + _default("micro_batch"))
    p.add_argument("--seq", type=int, help="sequence length" + _default("seq"))
    p.add_argument("--steps", type=int, help="timed steps" + _default("steps"))
    p.add_argument("--warmup", type=int, help="untimed steps first" + _default("warmup"))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE",
                   help=f"any of {', '.join(MODES)} (plain is always run: it is the baseline)")
    p.add_argument("--world", type=int, help="ranks for every mode but plain (torchrun)" + _default("world"))
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--compile", action="store_true", help="torch.compile every block, in every mode")
    p.add_argument("--dtype", choices=["bf16", "fp32"],
                   help="compute precision (fp32 master weights and optimizer states either way)" + _default("dtype"))
    p.add_argument("--threads", type=int, default=0,
                   help="CPU only: torch threads per rank (default: the cores shared among the ranks)")
    p.add_argument("--bucket", type=int, default=0,
                   help="reduce_bucket_size in elements for zerodp and DeepSpeed (0: each one's own "
                        "default, 5e7 for zerodp and 5e8 for DeepSpeed)")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="tokens per piece of the output head and loss, in every mode (GPTConfig.loss_chunk); "
                        "default 1024 with --checkpointing (the head is checkpointed too), else 0 (whole)")
    p.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="zerodp stages 1-2: the next forward waits for each bucket's parameter gather")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off in every mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fake-world", type=int, default=0,
                   help="also run zerodp2 and fsdp2 as rank 0 of N on the fake process group (memory)")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds over the modes (A B C, A B C, ...): each mode's median and spread, and which "
                        f"modes can be told apart ({MIN_REPEATS} at least for that; default 5)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mode before it counts as failed")
    p.add_argument("--fork", action="store_true",
                   help="CPU only: start each mode as a fork of one server process that imported torch and the "
                        "worker once (~5 CPU s less per mode and rank), not as a fresh interpreter (the default); "
                        "each mode still runs in processes of its own, which ran no other mode")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def _default(key: str) -> str:
    cuda, cpu = _DEVICE_DEFAULTS[key]
    return f" (default {cuda} on CUDA, {cpu} on CPU)"


def fill_device_defaults(args: argparse.Namespace) -> None:
    """The options not given take their device's default (_DEVICE_DEFAULTS)."""
    from zerodp.distributed.device import accelerator_type

    accelerator = accelerator_type() is not None
    for key, (on_accelerator, on_cpu) in _DEVICE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, on_accelerator if accelerator else on_cpu)


def modes_to_run(requested: list[str]) -> list[str]:
    """plain first (every ratio is to it), then the requested modes in order, once each."""
    return ["plain"] + [m for m in dict.fromkeys(requested) if m != "plain"]


def run_rounds(modes: list[str], args: argparse.Namespace) -> tuple[list[Result], list[dict]]:
    """Every mode once per round, --repeats rounds: each mode's median row (its tokens/s of every round in
    `samples`, in round order), and every run's row in the order they ran, with when it started and ended."""
    runs, by_mode = [], {m: [] for m in modes}
    # Round after round over all the modes, so that a drift in the machine's load hits every mode alike.
    for round_ in range(args.repeats):
        for mode in modes:
            started = time.time()
            r = launch(mode, 1 if mode == "plain" else args.world, args)
            runs.append({"sequence": len(runs), "round": round_, "started": started, "ended": time.time(),
                         **asdict(r)})
            by_mode[mode].append(r)
            # a line per run as it ends, on stderr: a long run shows its progress, and one stopped keeps its numbers
            done = f"{r.tokens_per_s:,.0f} tokens/s" if r.status == "ok" else f"{r.status}: {r.reason}"
            print(f"round {round_ + 1}/{args.repeats}: {mode} {done}", file=sys.stderr, flush=True)
    return [median_result(by_mode[m]) for m in modes], runs


def check_args(args: argparse.Namespace) -> None:
    """The driver's options, checked before any mode starts (the worker's are the driver's, already checked)."""
    from zerodp.distributed.device import accelerator_type
    from zerodp.models.gpt import gpt_config

    try:  # a bad size fails here, once, not in every mode's process
        gpt_config(args.model, block_size=max(args.seq, 1))
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from None
    if args.world < 1 or args.repeats < 1:
        raise SystemExit(f"--world and --repeats must be at least 1, got {args.world} and {args.repeats}")
    if args.fork and accelerator_type() is not None:
        raise SystemExit("--fork is for CPU runs (checked there): on an accelerator each mode runs in a fresh "
                         "interpreter, so that none inherits a device context; run without --fork")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    apply_shape(args)
    fill_device_defaults(args)
    if not args.worker:
        from zerodp.lazy import require
        require("zerodp bench", "rich")
    if args.loss_chunk is None:
        # The fp32 logits of a 50k vocabulary outweigh every checkpointed block input together
        # (2.7B, 8 x 1024 tokens: 5.9 GiB with their gradients, against 1.25 GiB of block inputs).
        args.loss_chunk = 1024 if args.checkpointing else 0
    if args.worker:
        from zerodp.bench.worker import run_worker
        result = run_worker(args.worker, args)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.result, "w") as f:
                json.dump(asdict(result), f)
        return
    check_args(args)
    load_at_start = _load_average()
    results, runs = run_rounds(modes_to_run(args.modes), args)
    add_ratios(results)
    report(argv, args, results, runs, load_at_start)


def _load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def report(argv: list[str], args: argparse.Namespace, results: list[Result], runs: list[dict],
           load_at_start: tuple[float, float, float] | None) -> None:
    """Print the table and the verdicts, run the fake world if asked, and write --json."""
    import torch

    from zerodp.distributed.device import accelerator_type

    spreads, found = mode_spreads(results), verdicts(results)
    device = device_name()
    title = (f"{args.model}, micro-batch {args.micro_batch}, seq {args.seq}, {args.dtype}, {args.repeats} rounds"
             f"{', checkpointing' if args.checkpointing else ''} — {device}")
    print_table(title, results, spreads)
    print_verdicts(found)
    note = CPU_NOTE if accelerator_type() is None else None
    if note:
        print(f"note: {note}")
    fake = [launch(m, args.fake_world, args, fake_world=args.fake_world) for m in FAKE_MODES] \
        if args.fake_world else []
    if fake:
        print_table(f"memory as rank 0 of {args.fake_world} (fake process group) — {device}", fake)
    if args.json:
        out = {"command": "zerodp bench " + shlex.join(argv), "device": device, "device_note": note,
               "torch": torch.__version__, "zerodp_commit": source_commit(), "args": vars(args),
               "load_average_at_start": load_at_start, "load_average": _load_average(),
               "results": [asdict(r) for r in results],
               "spread": {m: {k: asdict(v) for k, v in s.items()} for m, s in spreads.items()},
               "verdicts": [{**asdict(v), "sentence": v.sentence()} for v in found],
               "runs": runs, "fake_world": [asdict(r) for r in fake]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
