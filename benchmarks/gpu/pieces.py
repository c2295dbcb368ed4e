"""The Python side of benchmarks/gpu/check.sh: each piece of the GPU check, its summary lines, the table.

Every piece appends one JSON line per result to the summary ($OUT/summary.jsonl) as soon as that result
exists, so a check killed halfway still reports what finished; check.sh adds one line per piece when
the piece ends (its status, seconds and limit). Only the standard library is imported at the top: the
environment piece and the table must work where torch or zerodp does not import.

    python benchmarks/gpu/pieces.py env --state STATE.sh --detail ENV.json   # cuda=0/1 zerodp=0/1
    python benchmarks/gpu/pieces.py throughput --model 350M --budget 100 --json bench-350M.json
    python benchmarks/gpu/pieces.py peak --budget 90 --json peak-2.7B.json
    python benchmarks/gpu/pieces.py fake --budget 60 --json fake64-6.7B.json
    python benchmarks/gpu/pieces.py table --summary summary.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
# zerodp estimate's predictions for the peak rows, made on the CPU beforehand (fake tensors):
# benchmarks/README.md gives the commands that wrote them.
PREDICTIONS = {"peak": RESULTS / "gpu-check-2.7B-ckpt-world1.json",
               "fake": RESULTS / "gpu-check-6.7B-ckpt-fake64.json"}
PEAK_TOL = 0.10  # the allocator's peak may exceed the tensors' by its rounding and workspaces
THROUGHPUT_MODES = ("zerodp2", "zerodp3", "fsdp2")
GIB = 2 ** 30


def emit(summary: str | None, piece: str, status: str, result: str, **detail) -> None:
    """One line of the summary, printed too."""
    row = {"piece": piece, "status": status, "result": result, **detail}
    print(f"{status:<8} {piece}: {result}", flush=True)
    if summary:
        with open(summary, "a") as f:
            f.write(json.dumps(row) + "\n")


# ---- environment -----------------------------------------------------------------------------------
def _version(name: str) -> str:
    """The installed version of a distribution that also imports (a module of that name), or 'missing'."""
    try:
        importlib.import_module(name.replace("-", "_"))
        return importlib.metadata.version(name)
    except Exception:  # noqa: BLE001 - not installed, or installed and broken: either way not usable
        return "missing"


def environment() -> dict:
    """What the machine has: GPU, driver, Python, torch, CUDA, NCCL, and zerodp's dependencies."""
    env = {"python": platform.python_version(), "machine": platform.machine(),
           **{name: _version(name) for name in ("pydantic", "pydantic-core", "safetensors", "numpy", "rich",
                                                 "typing-extensions", "transformers")}}
    try:  # not imported: DeepSpeed's import probes the accelerator and prints
        env["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        env["deepspeed"] = "missing"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["nvidia-smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        env["nvidia-smi"] = f"not run: {e}"
    try:
        import torch
        env.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            env.update(gpu=torch.cuda.get_device_name(0),
                       gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / GIB, 1),
                       nccl=".".join(map(str, torch.cuda.nccl.version())))
    except Exception as e:  # noqa: BLE001 - reported, and every later piece is skipped with it
        env.update(torch=f"import fails: {type(e).__name__}: {e}", cuda_available=False)
    try:
        importlib.import_module("zerodp.engine.engine")  # the engine and its config (pydantic)
        env["zerodp"] = "imports"
    except Exception as e:  # noqa: BLE001 - typically pydantic missing: said in one line
        env["zerodp"] = f"import fails: {type(e).__name__}: {e}"
    return env


def env_piece(args: argparse.Namespace) -> int:
    """Print the environment; write check.sh's state and the versions for its summary line."""
    env = environment()
    for k, v in env.items():
        print(f"  {k}: {v}")
    if env["pydantic"] == "missing":
        print("pydantic is missing: zerodp cannot import. Make the wheels where pip works "
              "(bash benchmarks/gpu/wheels.sh) and carry .whl to this machine.")
    ok = env["zerodp"] == "imports"
    with open(args.state, "w") as f:
        f.write(f"cuda={int(bool(env.get('cuda_available')))}\nzerodp={int(ok)}\n"
                f"zerodp_error={shlex.quote(env['zerodp'])}\n")
    if args.detail:
        Path(args.detail).write_text(json.dumps(env))
    gpu = env.get("gpu") or "no CUDA device"
    print(f"{gpu}; torch {env.get('torch')} CUDA {env.get('cuda')} NCCL {env.get('nccl', '-')}; "
          f"Python {env['python']}; pydantic {env['pydantic']}; zerodp {env['zerodp']}")
    return 0 if ok else 1


# ---- the bench rows: zerodp bench's worker, one fresh process per mode ---------------------------
class Budget:
    """The piece's own deadline: each mode gets what is left of it, and none starts without enough."""

    def __init__(self, seconds: float, least: float = 20.0):
        self.end, self.least = time.monotonic() + seconds, least

    def left(self) -> float:
        return self.end - time.monotonic() - 5.0  # the last line is written before check.sh's timeout

    def enough(self) -> bool:
        return self.left() >= self.least


def bench_args(argv: list[str]) -> argparse.Namespace:
    """`zerodp bench` options, with the device's defaults filled in as its main() does."""
    from zerodp.bench.driver import fill_device_defaults, parser

    args = parser().parse_args(argv)
    fill_device_defaults(args)
    if args.loss_chunk is None:
        args.loss_chunk = 1024 if args.checkpointing else 0
    return args


def describe(r, prediction: int | None = None) -> tuple[str, str]:
    """A row's status and one-line result (a bench Result)."""
    if r.status != "ok":
        return ("skipped" if r.status == "skipped" else "FAIL"), f"{r.status}: {r.reason}"
    parts = [f"{r.tflops:.1f} TFLOP/s"]
    if r.ratio_to_plain is not None:
        parts.append(f"{r.ratio_to_plain:.2f}x plain")
    if r.mfu is not None:
        parts.append(f"MFU {r.mfu:.1%}")
    if r.peak_allocated_gib is not None:
        parts.append(f"peak {r.peak_allocated_gib:.2f} GiB")
    status = "ok"
    if prediction:
        measured = (r.peak_allocated_gib or 0.0) * GIB
        off = measured / prediction - 1
        status = "ok" if abs(off) <= PEAK_TOL else "FAIL"
        parts.append(f"predicted {prediction / GIB:.2f} GiB ({off:+.1%}, tol {PEAK_TOL:.0%})")
    return status, ", ".join(parts)


def predicted_peak(kind: str, mode: str, bench: argparse.Namespace, world: int = 1) -> int | None:
    """zerodp estimate's peak for a bench mode, from the shipped prediction file; None where the file
    has no entry for this mode with the bench's model, batch, checkpointing and world."""
    path = PREDICTIONS.get(kind)
    if path is None or not path.exists():
        return None
    from zerodp.models.gpt import gpt_config

    model = gpt_config(bench.model)
    for entry in json.loads(path.read_text()):
        spec = entry["spec"]
        fields = spec["source"]["fields"] if "source" in spec else spec["model"]  # zerodp's rows, plain's
        same_run = (fields["n_layer"], fields["n_embd"], fields["loss_chunk"], spec["micro_batch"], spec["seq"],
                    spec["checkpointing"], spec["world"]) == \
            (model.n_layer, model.n_embd, bench.loss_chunk, bench.micro_batch, bench.seq, bench.checkpointing, world)
        same_mode = (mode == "plain" and spec["mode"] == "plain") or \
            (mode.startswith("zerodp") and spec["mode"] == "zerodp" and spec.get("stage") == int(mode[-1]))
        if same_run and same_mode:
            return int(entry["peak"])
    return None


def run_rows(args: argparse.Namespace, label: str, bench: argparse.Namespace, modes: list[str],
             world: int = 1, fake_world: int = 0, plain_tflops: float | None = None) -> int:
    """Launch each mode in turn (plain first when listed), a summary line as each one ends, the
    rows written to --json after each; the number of rows that failed."""
    from dataclasses import asdict

    from zerodp.bench.driver import launch
    budget, rows, failed = Budget(args.budget), [], 0
    for mode in modes:
        if not budget.enough():
            emit(args.summary, f"{label}: {mode}", "skipped", f"deadline: {budget.left():.0f} s left of the piece")
            continue
        bench.timeout = budget.left()
        r = launch(mode, world, bench, fake_world=fake_world)
        if mode == "plain" and r.status == "ok":
            plain_tflops = r.tflops
        if r.status == "ok" and plain_tflops and not fake_world:
            r.ratio_to_plain = r.tflops / plain_tflops
        status, text = describe(r, predicted_peak(args.kind, mode, bench, world) if args.kind else None)
        failed += status == "FAIL"
        emit(args.summary, f"{label}: {mode}", status, text, row=asdict(r))
        rows.append(asdict(r))
        if args.json:
            Path(args.json).write_text(json.dumps({"label": label, "argv": args.bench_argv, "rows": rows}, indent=1))
    print(f"{label}: {sum(r['status'] == 'ok' for r in rows)} of {len(modes)} rows measured, {failed} failed")
    return failed


def plain_from(path: str | None) -> float | None:
    """plain's TFLOP/s from an earlier piece's --json (DeepSpeed's ratio without running plain again)."""
    if not path or not os.path.exists(path):
        return None
    rows = json.loads(Path(path).read_text())["rows"]
    return next((r["tflops"] for r in rows if r["mode"] == "plain" and r["status"] == "ok"), None)


def bench_piece(args: argparse.Namespace) -> int:
    """throughput and peak: plain first (every ratio is to it) unless --plain-from has its TFLOP/s;
    fake: the listed modes alone, as rank 0 of --fake-world (plain at that size could not fit)."""
    bench = bench_args(args.bench_argv)
    fake = args.command == "fake"
    plain = plain_from(args.plain_from)
    modes = args.modes if plain or fake else ["plain", *args.modes]
    label = {"throughput": f"throughput {bench.model}", "peak": f"peak {bench.model} checkpointed",
             "fake": f"{bench.model} as rank 0 of {args.fake_world} (fake)"}[args.command]
    failed = run_rows(args, label, bench, modes, world=args.fake_world if fake else 1,
                      fake_world=args.fake_world if fake else 0, plain_tflops=plain)
    return 1 if failed else 0


# ---- the table -----------------------------------------------------------------------------------
def table(summary: str, width: int = 180) -> str:
    rows = [json.loads(line) for line in Path(summary).read_text().splitlines() if line.strip()] \
        if os.path.exists(summary) else []
    name_w = min(70, max([len(r["piece"]) for r in rows] + [5]))
    lines = [f"{'piece':<{name_w}}  {'status':<8} {'s':>6}  result", "-" * width]
    for r in rows:
        secs = r.get("seconds")
        secs = "" if secs is None else f"{secs:.0f}"
        lines.append(f"{r['piece'][:name_w]:<{name_w}}  {r['status']:<8} {secs:>6}  {r['result']}"[:width])
    bad = sum(r["status"] in ("FAIL", "failed", "timeout") for r in rows)
    lines.append(f"{len(rows)} lines: {sum(r['status'] == 'ok' for r in rows)} ok, {bad} failed, "
                 f"{sum(r['status'] == 'skipped' for r in rows)} skipped")
    return "\n".join(lines)


def record_piece(args: argparse.Namespace) -> int:
    """check.sh's line for a piece that ended: its exit status read as ok / failed / timeout."""
    rc = args.rc
    status = "ok" if rc == 0 else "timeout" if rc in (124, 137) else "failed"
    text = args.result or {"ok": "done", "timeout": f"killed at its limit of {args.limit} s"}.get(status, f"exit {rc}")
    detail = json.loads(Path(args.detail).read_text()) if args.detail and os.path.exists(args.detail) else {}
    emit(args.summary, args.piece, status if args.status is None else args.status, text,
         seconds=args.seconds, limit=args.limit, rc=rc, **detail)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["env", "throughput", "peak", "fake", "table", "record"])
    p.add_argument("--summary", help="append JSON lines here")
    p.add_argument("--state", help="env: write cuda=, zerodp= for check.sh here")
    p.add_argument("--detail", help="env: write the versions here; record: add what this file holds")
    p.add_argument("--budget", type=float, default=float(os.environ.get("PIECE_BUDGET", 600)),
                   help="seconds this piece may take (default: check.sh's PIECE_BUDGET)")
    p.add_argument("--json", help="the rows of a bench piece, rewritten after each row")
    p.add_argument("--modes", nargs="+", default=list(THROUGHPUT_MODES))
    p.add_argument("--fake-world", type=int, default=64)
    p.add_argument("--plain-from", help="take plain's TFLOP/s from this earlier --json instead of running it")
    p.add_argument("--piece"), p.add_argument("--status"), p.add_argument("--result")
    p.add_argument("--rc", type=int, default=0), p.add_argument("--seconds", type=float)
    p.add_argument("--limit", type=float)
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    args.bench_argv = [a for a in rest if a != "--"]  # what follows: zerodp bench's own options
    args.kind = args.command if args.command in ("peak", "fake") else None
    if args.command == "env":
        return env_piece(args)
    if args.command == "table":
        print(table(args.summary))
        return 0
    if args.command == "record":
        return record_piece(args)
    return bench_piece(args)


if __name__ == "__main__":
    raise SystemExit(main())
