"""The set-up peak of a job (build the model, load its weights, `zerodp.initialize`), per rank, beside
the step's peak: a rank can run out of memory before its first step.

Two paths (Ψ parameters, N ranks, w bytes per working parameter, B the largest bucket in elements:
stage 3's largest unit or coalesced bucket, else min(reduce_bucket_size, Ψ); M the fp32 master copy
per rank: 4Ψ/N under mixed precision at stages 1-3, 4Ψ at stage 0, none in fp32, where the master is
the working shard itself):
  meta   the model built on `meta` (or its weights read from files) and each rank materialising only
         what its stage keeps, one bucket at a time. Stages 0-2: the working copy wΨ + M + the
         bucket being filled, in fp32 (4B). Stage 3: the shards wΨ/N + M + the bucket's gathered
         buffer (wB) + this rank's part of it in fp32 (4B/N). Gradients and Adam's m, v do not
         exist until the first step.
  whole  every rank builds the whole model in fp32 (4Ψ), then the engine fills its buffers bucket by
         bucket, each bucket flattened in fp32 (4B) while the user's tensors it replaces are alive:
         stages 1-2  4Ψ + wΨ + M + 4B  (the flat working buffer is allocated at once)
         stage 0     4Ψ + wΨ + 4B  (its whole master takes the place of the user's tensors as they go)
         stage 3     4Ψ + wΨ/N + M + (4 + w)B  (the shards, then each bucket's gathered buffer)
`formula` gives these, device bytes; `measure` runs both paths on fake tensors (rank 0 of N,
peak.py): the model built and `zerodp.initialize` called under PyTorch's MemTracker. On the meta path
that figure also counts the initialisers' CPU stand-ins (one module's tensors at a time, fp32), host
memory on a GPU job: there it is an upper bound on the device's peak. benchmarks/setup_memory.py
measures both paths' resident memory for real.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from zerodp.config import ZeroConfig
from zerodp.plan.formulas import WORKING_BYTES
from zerodp.plan.models import PlanModel

PATHS = ("meta", "whole")


def formula(path: str, psi: int, world: int, stage: int, dtype: str, bucket: int) -> int:
    """Set-up peak bytes per rank on the device (see the module's docstring)."""
    w = WORKING_BYTES[dtype]
    master = 0 if w == 4 else 4 * psi // (world if stage > 0 else 1)
    if stage == 3:
        user = 4 * psi if path == "whole" else 0
        staged = 4 * bucket if path == "whole" else 4 * bucket // world
        return user + w * psi // world + master + w * bucket + staged
    if path == "whole":
        return 4 * psi + w * psi + (master if stage > 0 else 0) + 4 * bucket
    return w * psi + master + 4 * bucket


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
    """(path, N, stage) -> the measured set-up peak; None where it cannot be measured (a model on meta
    with a module that has no initialiser: its user passes param_init_fn, estimate cannot)."""
    return {(r["spec"]["setup"], r["spec"]["world"], r["spec"]["stage"]): r["peak"] for r in measured}


def measure(args: argparse.Namespace, model: PlanModel, cells: list[tuple[int, int]], console
            ) -> dict[tuple[str, int, int], int | None]:
    """The set-up peaks of `cells` measured on fake tensors, in one subprocess (peak.py)."""
    from zerodp.plan.peak import measure_peaks

    specs = measure_specs(args, model, cells)
    with console.status(f"measuring the set-up of {len(specs)} configurations on fake tensors ..."):
        return results(measure_peaks(specs))
