"""One measured training step as rank 0 of N, on real tensors (`zerodp estimate --measure real`).

The fake process group (backend "fake": every collective returns at once, nothing is sent) lets one
process act as rank 0 of N ranks, so it allocates exactly rank 0's partitions; each (N, stage) runs
in a fresh subprocess (`python -m zerodp.plan.measure SPECS`) because a process holds one default
process group. The report is memory.memory_report's: bytes of the tensors the engine owns.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from typing import Any

import torch

from zerodp.config import REDUCE_BUCKET_SIZE
from zerodp.distributed.comm import init_fake
from zerodp.distributed.device import local, reset_peak_memory_stats
from zerodp.engine.engine import inside


def measure(spec: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """One measured step (see `_measure_here`) in a fresh Python process, so in a fresh process group."""
    return measure_many([spec], timeout)[0]


def measure_many(specs: list[dict[str, Any]], timeout: float | None = None) -> list[dict[str, Any]]:
    """Several measured steps one after another in one fresh Python process (cheaper to start);
    the process group is destroyed and created anew between them."""
    where = ", ".join(f"world={s['world']} stage={s['stage']}" for s in specs)
    return run_child(["zerodp.plan.measure", json.dumps(specs)], f"the measuring subprocess for {where}",
                     timeout)


def run_child(module_argv: list[str], what: str, timeout: float | None) -> Any:
    """`python -m <module_argv>` in a fresh process; its last stdout line, parsed as JSON."""
    out = subprocess.run([sys.executable, "-m", *module_argv], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure_here(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import zerodp
    from zerodp.activations import checkpoint_blocks
    from zerodp.models.gpt import Block
    from zerodp.plan.models import PlanModel

    world, stage = spec["world"], spec["stage"]
    init_fake(world)
    device = local(0)
    torch.manual_seed(0)
    source = PlanModel(**spec["source"]) if "source" in spec else PlanModel("gpt", "spec", spec["model"])
    with torch.device(device):
        model, inputs = source.build()
    if inputs is None:
        raise SystemExit(f"{source.ref}: a factory must return (module, inputs) for a measured step")
    psi = sum({id(p): p.numel() for p in model.parameters()}.values())
    config = {"train_micro_batch_size_per_gpu": spec["micro_batch"],
              "gradient_accumulation_steps": spec.get("gas", 1),
              "zero_optimization": {"stage": stage,
                                    "reduce_bucket_size": spec.get("reduce_bucket_size") or REDUCE_BUCKET_SIZE,
                                    "mics_shard_size": spec.get("mics_shard_size", -1),
                                    "offload_optimizer": {"device": "cpu" if spec.get("offload") else "none"}},
              "optimizer": {"type": spec.get("optimizer", "AdamW"), "params": {"lr": 1e-4}}}
    if spec["dtype"] != "fp32":
        config[spec["dtype"]] = {"enabled": True}
    rss0 = _rss()
    engine = zerodp.initialize(model, None, config)
    if spec.get("checkpointing"):
        checkpoint_blocks(engine.module, (Block,), engine.config.activation_checkpointing)
    reset_peak_memory_stats(device)
    seq = spec["seq"]
    for _ in range(inside(engine).spec.gas):
        out = engine(*inputs(spec["micro_batch"], seq, device))
        engine.backward(out if isinstance(out, torch.Tensor) else out.loss)
        engine.step()
    report = engine.memory_report()
    del engine, model
    dist.destroy_process_group()
    return {"num_params": psi, "report": report, "device": str(device),
            "peak_rss": _rss(), "rss_before_engine": rss0}


def _rss() -> int:
    """Peak resident set of this process in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    print(json.dumps([_measure_here(spec) for spec in json.loads(sys.argv[1])]))
