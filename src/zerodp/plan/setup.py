"""The set-up peak of a job (build the model, load its weights, `zerodp.initialize`), per rank, beside
the step's peak: a rank can run out of memory before its first step.

Two paths (Ψ parameters, N ranks, w bytes per working parameter, B the largest bucket in elements:
stage 3's largest unit or coalesced bucket, else min(reduce_bucket_size, Ψ)):
  meta   the model built on `meta` (or its weights read from files) and each rank materialising only
         what its stage keeps, one bucket at a time: the stage's parameters (stage 3: wΨ/N; else wΨ),
         the fp32 master shard when it is a copy (mixed precision: 4Ψ/N; stage 0: 4Ψ), and the bucket
         being filled in fp32 (4B; stage 3 also its working-precision gathered buffer, wB).
         Gradients and Adam's m, v do not exist until the first step.
  whole  every rank builds the whole model in fp32 (4Ψ), then the engine flattens every bucket of it
         in fp32 at once (4Ψ) and allocates its flat working buffer while both are alive:
         stages 0-2  4Ψ + 4Ψ + wΨ
         stage 3     max(4Ψ + 4Ψ + wΨ/N, 4Ψ + wΨ + (4 + w)Ψ/N + wB): the shard buffer first, then each
                     bucket's gathered buffer, filled before the user's tensors it replaces are freed.
`formula` gives these; `measure` runs the whole path itself on fake tensors (rank 0 of N, peak.py):
the model built and `zerodp.initialize` called under PyTorch's MemTracker. The meta path is the
formula, and the table says so: its initialisers draw from rank 0's real random state, which the
fake-tensor mode refuses to mix with fake tensors (benchmarks/setup_memory.py measures it for real).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from zerodp.config import ZeroConfig
from zerodp.engine.memory import WORKING_BYTES
from zerodp.plan.models import PlanModel

PATHS = ("meta", "whole")


def formula(path: str, psi: int, world: int, stage: int, dtype: str, bucket: int) -> int:
    """Set-up peak bytes per rank on the device (see the module's docstring)."""
    w = WORKING_BYTES[dtype]
    master_copy = w != 4  # in fp32 the master is the working shard itself
    if path == "whole":
        if stage == 3:
            # + one bucket's gathered buffer, filled before the parameters it replaces are freed
            return max(8 * psi + w * psi // world, 4 * psi + w * psi + (4 + w) * psi // world + w * bucket)
        return (8 + w) * psi
    shards = world if stage > 0 else 1
    params = w * psi // world if stage == 3 else w * psi
    master = 4 * psi // shards if master_copy else 0
    return params + master + 4 * bucket + (w * bucket if stage == 3 else 0)


_LARGEST: dict[str, int] = {}  # --fit asks for each family member many times; a meta build takes ~0.1 s

_PREFETCH_DEFAULT = ZeroConfig.model_fields["stage3_prefetch_bucket_size"].default


def largest_bucket(model: PlanModel, psi: int, stage: int, reduce_bucket_size: int) -> int:
    """Elements of the largest bucket (at most Ψ): a reduce bucket, or at stage 3 the larger of its
    largest unit and the size small units are coalesced up to (engine/units.layout: the smaller of
    the prefetch and reduce bucket sizes; estimate plans with the prefetch size's default)."""
    if stage != 3:
        return min(reduce_bucket_size, psi)
    key = json.dumps(dataclasses.asdict(model), sort_keys=True, default=str)
    if key not in _LARGEST:
        _LARGEST[key] = model.largest_module()
    return min(psi, max(_LARGEST[key], min(reduce_bucket_size, _PREFETCH_DEFAULT)))


def measure_specs(args: argparse.Namespace, model: PlanModel, cells: list[tuple[int, int]]) -> list[dict]:
    """peak.py's specs for the set-up of each path and (N, stage) cell."""
    base = {"source": dataclasses.asdict(model), "micro_batch": args.micro_batch, "seq": args.seq,
            "dtype": args.dtype, "checkpointing": False, "mode": "setup",
            "reduce_bucket_size": args.reduce_bucket_size}
    return [{**base, "setup": path, "world": w, "stage": s} for path in PATHS for w, s in cells]


def results(measured: list[dict]) -> dict[tuple[str, int, int], int | None]:
    """(path, N, stage) -> the measured set-up peak; None where it cannot be measured (the meta
    path, while zerodp.initialize refuses a model on meta)."""
    return {(r["spec"]["setup"], r["spec"]["world"], r["spec"]["stage"]): r["peak"] for r in measured}


def measure(args: argparse.Namespace, model: PlanModel, cells: list[tuple[int, int]], console
            ) -> dict[tuple[str, int, int], int | None]:
    """The set-up peaks of `cells` measured on fake tensors, in one subprocess (peak.py)."""
    from zerodp.plan.peak import measure_peaks

    specs = measure_specs(args, model, cells)
    with console.status(f"measuring the set-up of {len(specs)} configurations on fake tensors ..."):
        return results(measure_peaks(specs))
