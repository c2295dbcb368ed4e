"""`zerodp estimate --optimizer muon|adafactor`: each rank's share of the optimizer states when a
shape-aware optimizer steps whole parameters (engine/stepping/optimizer_view.py).

An element-wise optimizer (AdamW) steps flat shards: every rank holds exactly 1/N. Muon (on the hidden
matrices, AdamW on the rest: config type "Muon") and Adafactor step whole parameters, each owned by one
rank, so the shares are whole parameters dealt to N ranks: the table gives, per world size, 1/N of the
model's fp32 master + optimizer state bytes, the largest rank's, its excess over 1/N, and the padding the
whole-parameter buckets add to the working and gradient buffers. It lays the model out exactly as the
engine does (flat.lay_out on the meta model), allocating nothing. Parameters larger than 1/N of their
group are named: one rank holds each whole.
"""

from __future__ import annotations

import argparse

CHOICES = ("adamw", "muon", "adafactor")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("optimizer state shares (--optimizer)")
    g.add_argument("--optimizer", choices=CHOICES, help="print each rank's share of the optimizer states: muon and "
                   "adafactor step whole parameters (one rank owns each), adamw flat shards (1/N exactly)")


def render(args: argparse.Namespace, plan_model, console) -> None:
    """estimate's section hook (estimate.SECTION_MODULES): with --optimizer, the table below."""
    if args.optimizer is None:
        return
    import torch
    with torch.device("meta"):
        model, _ = plan_model.build()
    console.print(table(model, args.optimizer, args.world, args.reduce_bucket_size, args.dtype))


def shares(model, optimizer: str, world: int, bucket_numel: int, dtype: str = "bf16") -> dict:
    """Per rank, the fp32 master + optimizer state bytes of its shards; the padding bytes whole-parameter
    buckets add to each rank's working buffer; the whole-stepped parameters larger than 1/N of their group."""
    from zerodp.config.optimizer import muon_params
    from zerodp.engine.layout.flat import lay_out

    trained = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "muon":
        groups, whole, kinds = list(muon_params(model)), [True, False], ["muon", "adamw"]
    else:
        groups, whole, kinds = [trained], [optimizer == "adafactor"], [optimizer]
    master = 0 if dtype == "fp32" else 4  # in fp32 the master is the working shard itself
    per_rank, padding, large = [0.0] * world, 0, []
    for layout_group, kind, params in zip(lay_out(groups, world, bucket_numel, whole=whole), kinds, groups):
        total = sum(p.numel() for p in params)
        for b in layout_group.buckets:
            padding += b.numel - sum(s.numel for s in b.slots)
            for r in range(world):
                for _, s, lo, hi in b.owned_slots(r):
                    per_rank[r] += (hi - lo) * master + _state_bytes(kind, s.shape, hi - lo)
            large += [tuple(s.shape) for s in b.slots if b.whole and s.numel > total / world]
    return {"per_rank": per_rank, "padding_bytes": padding * (4 if dtype == "fp32" else 2), "large": large}


def _state_bytes(kind: str, shape, numel: int) -> float:
    """Optimizer state bytes of `numel` elements of a parameter of `shape` (all of it, when stepped whole)."""
    if kind == "adamw":
        return 8 * numel
    if kind == "muon":
        return 4 * numel  # the momentum
    if len(shape) < 2:  # Adafactor: a vector's full second moment
        return 4 * numel
    return 4 * (numel // shape[-1] + numel // shape[-2])  # a matrix's row and column factors


def table(model, optimizer: str, worlds: list[int], bucket_numel: int, dtype: str):
    from rich.table import Table

    from zerodp.plan.units import human
    t = Table(title=f"Optimizer state per rank, {optimizer} ({'whole parameters' if optimizer != 'adamw' else 'flat shards'}), "
                    f"fp32 master + optimizer states")
    for c in ("N", "1/N", "largest rank", "excess over 1/N", "bucket padding per rank", "parameters > 1/N"):
        t.add_column(c, justify="right")
    for world in worlds:
        r = shares(model, optimizer, world, bucket_numel, dtype)
        fair, worst = sum(r["per_rank"]) / world, max(r["per_rank"])
        t.add_row(str(world), human(fair), human(worst), f"{human(worst - fair)} ({100 * (worst / fair - 1):.0f}%)"
                  if fair else "0", human(r["padding_bytes"]), str(len(r["large"])))
    return t
