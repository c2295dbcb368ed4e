"""The offloaded optimizer step alone: one flat fp32 shard stepped by torch's AdamW as built by default
(its single-tensor loop on the CPU), torch's fused AdamW and DeepSpeedCPUAdam, in one process, in
interleaved rounds (issue 27; benchmarks/RESULTS.md).

    python benchmarks/offload_step.py [NUMEL]        # needs `pip install deepspeed` (JIT-builds its CPU Adam)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

KINDS = ("default", "fused", "deepspeed")


def build(kind: str, numel: int) -> torch.optim.Optimizer:
    """An optimizer of `kind` over one parameter of `numel` elements, with a gradient, stepped once."""
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel) * 1e-2
    if kind == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.1, adamw_mode=True)
    else:
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True if kind == "fused" else None)
    opt.step()  # the state exists before the timed steps
    return opt


def main(numel: int, rounds: int = 4) -> None:
    torch.manual_seed(0)
    opts = {k: build(k, numel) for k in KINDS}
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(rounds):
        for k in KINDS:
            start = time.perf_counter()
            opts[k].step()
            times[k].append(time.perf_counter() - start)
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {numel:,} fp32 parameters; "
          f"median of {rounds} interleaved rounds")
    for k in KINDS:
        print(f"{k:10s} {median[k]:8.1f} ms  {median[k] / median['deepspeed']:.2f}x DeepSpeedCPUAdam  "
              f"rounds {[round(t * 1e3, 1) for t in times[k]]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50_000_000)
