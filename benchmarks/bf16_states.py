"""The main job trained with fp32 and with bf16 optimizer states, in one run (issue 41; benchmarks/RESULTS.md).

Each mode is `zerodp train` itself, the main job (the `small` GPT, 2 CPU ranks, ZeRO-2, its AdamW, lr,
schedule, clipping, batch, seed and data), run one after the other in fresh processes with --steps STEPS
and one --ds-config that differs only in its bf16 section:

  fp32                 fp32 weights; AdamW's m and v in fp32 (the master is the weight itself)
  bf16                 bf16 weights, fp32 masters, fp32 m and v
  bf16-states          bf16 weights, fp32 masters, m and v in bf16 (bf16.bf16_optimizer_states)
  bf16-masters-states  the same with the masters as the bf16 weight + an int16 remainder
                       (bf16.bf16_master_weights_and_grads)

From each run's metrics.jsonl: the validation losses (the same validation batches in every mode) and the
engine's own memory_report at the last step (`zerodp train` writes every rank's), whose fp32_master,
master_remainders and optimizer_states are counted from the tensors the partitioned optimizer holds. Summed
over the ranks and divided by the parameter count they give the bytes per parameter of master + states,
printed beside plan/formulas.py's K, and each rank's model states beside formula(); the final validation
loss of each mode and its relative difference to the first mode's.

    PYTHONPATH=src python benchmarks/bf16_states.py --modes fp32 bf16-states --steps 300 \\
        --json benchmarks/results/bf16-states-small-300.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from zerodp.models.build import build_model
from zerodp.plan.formulas import formula, optimizer_bytes

MODES = {
    "fp32": {},
    "bf16": {"enabled": True},
    "bf16-states": {"enabled": True, "bf16_optimizer_states": True},
    "bf16-masters-states": {"enabled": True, "bf16_optimizer_states": True, "bf16_master_weights_and_grads": True},
}
OPTIMIZER_KEYS = ("fp32_master", "master_remainders", "optimizer_states")
MODEL_STATE_KEYS = ("working_params", "gradients", *OPTIMIZER_KEYS)
WORLD, STAGE, MICRO_BATCH = 2, 2, 8  # the main job's on CPU


def ds_config(mode: str) -> dict:
    """The main job's settings as a DeepSpeed config (a --ds-config settles stage and clipping: both given),
    and the mode's bf16 section."""
    cfg = {"zero_optimization": {"stage": STAGE}, "gradient_clipping": 1.0}
    return {**cfg, "bf16": MODES[mode]} if MODES[mode] else cfg


def start_mode(mode: str, model: str, steps: int, eval_every: int, root: str) -> dict:
    """One `zerodp train` of `mode`, started."""
    path = os.path.join(root, f"{mode}.json")
    with open(path, "w") as f:
        json.dump(ds_config(mode), f)
    out = os.path.join(root, mode)
    command = [sys.executable, "-m", "zerodp.train", "--model", model, "--ds-config", path, "--steps", str(steps),
               "--eval-every", str(eval_every), "--save-every", "0", "--nproc", str(WORLD), "--out", out]
    log = open(os.path.join(root, f"{mode}.log"), "w")
    return {"mode": mode, "out": out, "log": log, "start": time.time(), "load": os.getloadavg(),
            "process": subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)}


def finish_mode(job: dict, timeout: float) -> dict:
    """Its end waited for; its metrics read back."""
    code = job["process"].wait(timeout=max(1.0, job["start"] + timeout - time.time()))
    job["log"].close()
    if code != 0:
        with open(job["log"].name) as f:
            raise SystemExit(f"bf16_states: mode {job['mode']} failed (exit {code}):\n{f.read()[-3000:]}")
    return {"mode": job["mode"], "bf16": MODES[job["mode"]], "seconds": time.time() - job["start"],
            "load_average_at_start": job["load"], "load_average_at_end": os.getloadavg(),
            **read_metrics(os.path.join(job["out"], "metrics.jsonl"))}


def read_metrics(path: str) -> dict:
    """Validation losses by step, train losses, median seconds per step, and every rank's memory at the end."""
    records = [json.loads(line) for line in open(path)]
    run = next(r for r in records if r["kind"] == "run")
    train = [r for r in records if r["kind"] == "train"]
    memory = [r for r in records if r["kind"] == "memory"][-1]
    seconds = [r["tokens_per_s"] for r in train]
    return {"dtype": run["dtype"], "stage": run["stage"], "ranks": run["ranks"],
            "val_losses": {r["step"]: r["val_loss"] for r in records if r["kind"] == "eval"},
            "train_losses": [r["loss"] for r in train],
            "tokens_per_s_median": statistics.median(seconds), "memory_step": memory["step"],
            "memory": memory["ranks"]}


def parameters(model: str) -> tuple[int, int]:
    """Ψ of the job's model and its sequence length (byte-level vocabulary, built on meta: nothing allocated)."""
    with torch.device("meta"):
        net, shape = build_model(model, 256, None)
    return sum(p.numel() for p in net.parameters()), shape.block_size


def bytes_row(result: dict, psi: int) -> dict:
    """Measured bytes per parameter of master + states (all ranks) and model states per rank, with formulas."""
    mode, ranks = MODES[result["mode"]], result["memory"]
    dtype = result["dtype"]
    master, states = mode.get("bf16_master_weights_and_grads", False), mode.get("bf16_optimizer_states", False)
    held = {k: sum(r.get(k, 0) for r in ranks) for k in OPTIMIZER_KEYS}
    return {"psi": psi, "held": held, "k_measured": sum(held.values()) / psi,
            "k_formula": optimizer_bytes("adamw", dtype, master, states),
            "model_states_per_rank": [sum(r.get(k, 0) for k in MODEL_STATE_KEYS) for r in ranks],
            "model_states_formula": formula(psi, len(ranks), result["stage"], dtype, "adamw",
                                            bf16_master=master, bf16_states=states)}


def table(report: dict) -> str:
    """RESULTS.md's table."""
    first = report["results"][0]
    base = first["val_losses"][str(report["steps"])]
    lines = [f"`{report['command']}`", "",
             f"{report['device']}, torch {report['torch']}, commit {report['zerodp_commit']}; Ψ = {report['psi']:,}",
             "", "| mode | dtype | val loss step 0 | final val loss | vs " + first["mode"] + " | master + states B/param "
             "measured (formula) | model states per rank MiB measured (formula) | s/step median | load average |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        final, b = r["val_losses"][str(report["steps"])], r["bytes"]
        per_rank = "/".join(f"{x / 2**20:.2f}" for x in b["model_states_per_rank"])
        load = f"{r['load_average_at_start'][0]:.1f} → {r['load_average_at_end'][0]:.1f}"
        lines.append(f"| {r['mode']} | {r['dtype']} | {r['val_losses']['0']:.5f} | {final:.5f} "
                     f"| {(final - base) / base:+.3%} | {b['k_measured']:.3f} ({b['k_formula']}) | {per_rank} "
                     f"({b['model_states_formula'] / 2**20:.2f}) | {r['tokens_per_step'] / r['tokens_per_s_median']:.2f} "
                     f"| {load} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["fp32", "bf16-states"])
    p.add_argument("--model", default="small", help="the main job's default")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per mode")
    p.add_argument("--together", action="store_true", help="run the modes at the same time, not one by one")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args()
    psi, block = parameters(a.model)
    results = []
    with tempfile.TemporaryDirectory(prefix="bf16_states-") as root:
        # --together: every mode's ranks at once (the same losses; on a machine shared with other work each
        # run then gets a larger share of it), else one mode after the other
        groups = [a.modes] if a.together else [[m] for m in a.modes]
        for group in groups:
            jobs = [start_mode(mode, a.model, a.steps, a.eval_every, root) for mode in group]
            for job in jobs:
                r = finish_mode(job, a.timeout)
                r["tokens_per_step"] = WORLD * MICRO_BATCH * block
                r["bytes"] = bytes_row(r, psi)
                r = json.loads(json.dumps(r))  # step keys as JSON has them (strings), as table() reads them
                results.append(r)
                print(f"{r['mode']}: final val loss {r['val_losses'][str(a.steps)]:.5f}, master + states "
                      f"{r['bytes']['k_measured']:.3f} B/param (formula {r['bytes']['k_formula']}), "
                      f"{r['seconds']:.0f} s", flush=True)
    commit = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    report = {"command": "PYTHONPATH=src python benchmarks/bf16_states.py " + " ".join(sys.argv[1:]),
              "device": f"CPU ({os.cpu_count()} cores)", "torch": torch.__version__, "zerodp_commit": commit,
              "steps": a.steps, "psi": psi, "together": a.together, "results": results}
    print(table(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
