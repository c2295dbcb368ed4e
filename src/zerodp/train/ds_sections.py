"""What `zerodp train` takes from a --ds-config beyond its options: "auto" filled from the job's
options, and the optimizer and scheduler sections.

The config's optimizer (its type and params) is built on the job's two param groups (weight decay on
2-D tensors only), with the job's settled lr and weight_decay, so --lr / --weight-decay given on the
command line (or in --config) win over the section's, which win over the defaults. The config's
scheduler replaces the built-in warmup-cosine unless --warmup or --min-lr was given; --lr given
explicitly also becomes the scheduler's warmup_max_lr. Rank 0 prints one line saying what was used.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch
from torch import nn

from zerodp.config import load_config, read_config_file
from zerodp.config.auto import resolve_auto
from zerodp.models.sizes import SIZES
from zerodp.train.build import build_optimizer, decay_groups, job_schedule

SCHEDULE_FLAGS = ("warmup", "min_lr")  # the built-in schedule's own flags


def known_from_options(o: dict[str, Any], world: int) -> dict[str, Any]:
    """The job's options under the names resolve_auto knows (as Hugging Face's Trainer fills them)."""
    model = o["model"]
    size = model.split(":", 1)[1] if ":" in model else ("small" if model.startswith("hf-") else model)
    return {"lr": o["lr"], "weight_decay": o["weight_decay"], "betas": (0.9, 0.95), "eps": 1e-8,
            "warmup_num_steps": o["warmup"], "total_num_steps": o["steps"],
            "train_micro_batch_size_per_gpu": o["micro_batch"], "gradient_accumulation_steps": o["grad_accum"],
            "world_size": world, "gradient_clipping": o["clip"],
            "fp16": o.get("dtype") == "fp16", "bf16": o.get("dtype") == "bf16",
            "hidden_size": SIZES.get(size, {}).get("n_embd")}


def read_ds_config(path: str, o: dict[str, Any], world: int) -> dict[str, Any]:
    """The --ds-config file as a dict, "auto" resolved from the options `o` (ConfigError if it cannot be)."""
    raw = read_config_file(path)
    return resolve_auto(raw, known_from_options(o, world))


def job_world(opts: argparse.Namespace) -> int:
    """The data-parallel ranks, which the batch counts: torchrun's world when under torchrun (else --nproc),
    over --tp (the tensor-parallel ranks of one data-parallel rank share its batch)."""
    return int(os.environ.get("WORLD_SIZE", opts.nproc)) // opts.tp


def optimizer_and_schedule(model: nn.Module, opts: argparse.Namespace
                           ) -> tuple[torch.optim.Optimizer, Callable, str]:
    """The job's optimizer, its lr scheduler factory, and the line that says what they are and from where."""
    raw = read_ds_config(opts.ds_config, vars(opts), job_world(opts)) if opts.ds_config else {}
    user = set(opts.user_set)
    lr_from = "--lr" if "lr" in user else "--ds-config" if "lr" in (raw.get("optimizer") or {}).get("params", {}) \
        else "default"
    if raw.get("optimizer"):
        section = {**raw["optimizer"]}
        section["params"] = {**section.get("params", {}), "lr": opts.lr, "weight_decay": opts.weight_decay}
        cfg = load_config({"optimizer": section}).optimizer
        optimizer = cfg.build(decay_groups(model, opts.weight_decay))
        what = f"optimizer {cfg.type} (--ds-config)"
    else:
        optimizer, what = build_optimizer(model, opts), "optimizer AdamW (built in)"
    what += f", lr {opts.lr:g} ({lr_from})"
    section = raw.get("scheduler")
    if section and not user & set(SCHEDULE_FLAGS):
        params = dict(section.get("params", {}))
        if "lr" in user and "warmup_max_lr" in params:
            params["warmup_max_lr"] = opts.lr
        sched = load_config({"scheduler": {**section, "params": params}}).scheduler
        return optimizer, sched.build, f"{what}, scheduler {sched.type} (--ds-config)"
    schedule = job_schedule(opts)
    note = f"; --{'/--'.join(f.replace('_', '-') for f in SCHEDULE_FLAGS if f in user)} given, so not the " \
           f"--ds-config's {section.get('type')}" if section else ""
    return (optimizer, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            f"{what}, scheduler warmup-cosine (built in, warmup {opts.warmup}, min lr {opts.min_lr:g}{note})")
