"""A fine-tune's per-rank memory (`zerodp estimate --trainable-fraction F`, or `--lora RANK`): a frozen base
with a small part trained (LoRA adapters, a few layers, a reference model beside a policy).

What each rank holds, by ZeRO stage (formulas.finetune):
  trained part  the ZeRO table of the trained elements alone (formulas.placed): working copy, gradients,
                fp32 master and optimizer states, 16 bytes each in bf16 + Adam, sharded as the stage shards;
  frozen base   its working copy only (no gradient, master or optimizer state): whole on every rank at
                stages 0-2, 1/N of it at stage 3, which partitions frozen parameters too (in host memory
                with --offload-param).
  activations   one forward's, held for backward, at --micro-batch x --seq (memory.activation_estimate), as
                full training holds them: backward runs down through the frozen layers to the lowest adapter,
                and an adapter on a Linear keeps that Linear's input for its own gradient.
The device figure is all three; the full-training tables are not printed (they plan another job: the same
command without --lora plans it).
--lora RANK counts LoRA adapters of that rank on every Linear of the model but its output head (the one
producing the vocabulary): r x (in + out) elements each, as QLoRA's and torchtune's "all linear" targets.
Counted from 1- and 2-layer builds on meta (each layer adds the same adapters), so a 70B costs two small
builds. Nothing here runs a step: these are the formula's bytes, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses


def add_arguments(ap: argparse.ArgumentParser) -> None:
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--trainable-fraction", type=float, metavar="F", help="plan a fine-tune training this "
                       "fraction of the parameters (the rest frozen: no gradient, master or optimizer state)")
    group.add_argument("--lora", type=int, metavar="RANK", help="plan a LoRA fine-tune: adapters of this rank on "
                       "every Linear but the output head, the base frozen")


def requested(args: argparse.Namespace) -> bool:
    return args.trainable_fraction is not None or args.lora is not None


def trainable_numel(args: argparse.Namespace, plan_model) -> int:
    """Elements trained: F x Ψ, or the LoRA adapters' (per layer from two small meta builds)."""
    if args.trainable_fraction is not None:
        return round(args.trainable_fraction * plan_model.num_params())
    depth = plan_model._depth_key()
    if depth is None or plan_model.fields[depth] <= 2:
        return _lora_numel(plan_model, args.lora)
    one, two = (_lora_numel(dataclasses.replace(plan_model, fields={**plan_model.fields, depth: n}), args.lora)
                for n in (1, 2))
    return one + (plan_model.fields[depth] - 1) * (two - one)


def _lora_numel(plan_model, rank: int) -> int:
    import torch
    from torch import nn

    with torch.device("meta"):
        model, _ = plan_model.build()
    vocab = (plan_model.shape() or argparse.Namespace(vocab_size=None)).vocab_size
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features != vocab]
    return sum(rank * (m.in_features + m.out_features) for m in linears)


def render(args: argparse.Namespace, plan_model, console) -> None:
    """estimate's section hook (estimate.SECTION_MODULES): with --trainable-fraction or --lora, the table."""
    if not requested(args):
        return
    if args.trainable_fraction is not None and not 0 < args.trainable_fraction <= 1:
        raise SystemExit("zerodp estimate: --trainable-fraction must be in (0, 1]")
    from rich import box
    from rich.table import Table

    from zerodp.plan.formulas import activation_estimate, finetune
    from zerodp.plan.tables import params_text, size
    total, trained, shape = plan_model.num_params(), trainable_numel(args, plan_model), plan_model.shape()
    act = None if shape is None else activation_estimate(shape, args.micro_batch, args.seq, args.dtype,
                                                         args.checkpointing)
    what = f"LoRA rank {args.lora}" if args.lora is not None else f"{args.trainable_fraction:g} of the parameters"
    batch = "the factory's inputs" if act is None else f"micro-batch {args.micro_batch} x {args.seq} tokens"
    table = Table(title=f"Fine-tune of {plan_model.title()}, {args.dtype}, Adam, {batch}: {what} trained "
                        f"({params_text(trained)} of {params_text(total)}, {100 * trained / total:.2f}%); per rank",
                  caption="frozen base: its working copy (whole below stage 3, 1/N at stage 3); trained states: "
                          "the ZeRO table of the trained part; activations: one forward's, held for backward "
                          "(Korthikanti et al.'s 34·s·b·h per layer + logits; --micro-batch, --seq"
                          f"{'' if act is not None else '; unknown for a factory, not counted'}); device, host: "
                          "all of them, where they live (plan/finetune.py)",
                  box=box.SIMPLE_HEAD, padding=(0, 1), title_justify="left", caption_justify="left")
    for col in ("N", "stage", "frozen base", "trained states", "activations", "device", "host"):
        table.add_column(col, justify="right")
    for world in args.world:
        for stage in args.stage:
            b = finetune(total, trained, world, stage, args.dtype, "adam", args.gas, args.offload_optimizer,
                         args.offload_param)
            table.add_row(str(world), str(stage), size(b["frozen"]), size(b["trained"]),
                          "-" if act is None else size(act), size(b["device"] + (act or 0)),
                          size(b["host"]) if b["host"] else "-")
    console.print(table)
