"""`zerodp train --ds-config` uses the config's optimizer and scheduler; flags given win."""

from __future__ import annotations

import json

import pytest
import torch

from zerodp.train.ds_sections import optimizer_and_schedule
from zerodp.train.options import ds_config, parse_options
from oracle import Toy

DS = {"train_micro_batch_size_per_gpu": 2,
      "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.05, "warmup_num_steps": 2,
                                                         "total_num_steps": 10}}}


def _job(tmp_path, ds: dict, *flags: str):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    opts = parse_options(["--ds-config", str(path), "--nproc", "1", "--steps", "10", *flags])
    optimizer, scheduler, line = optimizer_and_schedule(Toy(), opts)
    return opts, optimizer, scheduler(optimizer), line


def test_the_configs_optimizer_and_scheduler_are_used_and_said(tmp_path):
    opts, optimizer, scheduler, line = _job(tmp_path, DS)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]  # 2-D tensors only
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and opts.lr == 0.05
    assert line == "optimizer SGD (--ds-config), lr 0.05 (--ds-config), scheduler WarmupDecayLR (--ds-config)"
    assert ds_config(opts).optimizer is None and ds_config(opts).scheduler is None


def test_flags_given_win_over_the_sections(tmp_path):
    _, optimizer, scheduler, line = _job(tmp_path, DS, "--lr", "0.2")
    assert line.startswith("optimizer SGD (--ds-config), lr 0.2 (--lr), scheduler WarmupDecayLR")
    for _ in range(2):  # the warmup ends at the flag's lr, not the section's warmup_max_lr
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    _, _, scheduler, line = _job(tmp_path, DS, "--warmup", "3")
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert line.endswith("scheduler warmup-cosine (built in, warmup 3, min lr 0.0001; --warmup given, so not "
                         "the --ds-config's WarmupDecayLR)")


def test_without_sections_the_built_in_adamw_and_cosine_are_used_and_auto_comes_from_the_options(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}}
    opts, optimizer, _, line = _job(tmp_path, ds, "--micro-batch", "3", "--model", "tiny")
    assert isinstance(optimizer, torch.optim.AdamW)
    assert line == ("optimizer AdamW (built in), lr 0.001 (default), scheduler warmup-cosine (built in, "
                    "warmup 1, min lr 0.0001)")
    cfg = ds_config(opts)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_clipping) == (3, 1.0)
    assert cfg.zero_optimization.reduce_bucket_size == 64 * 64  # tiny's n_embd, as Hugging Face


def test_bf16_masters_and_optimizer_states_reach_the_engine_config_and_need_bf16(tmp_path):
    """The main job with bf16 optimizer states (benchmarks/bf16_states.py runs it so): the bf16 section's keys
    reach the config the engine is built with; with --dtype fp32 they are refused before any rank starts."""
    ds = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
          "bf16": {"enabled": True, "bf16_optimizer_states": True, "bf16_master_weights_and_grads": True}}
    opts, optimizer, _, _ = _job(tmp_path, ds)
    cfg = ds_config(opts)
    assert (opts.dtype, cfg.zero_optimization.stage, cfg.gradient_clipping) == ("bf16", 2, 1.0)
    assert cfg.bf16.enabled and cfg.bf16.bf16_optimizer_states and cfg.bf16.bf16_master_weights_and_grads
    with pytest.raises(SystemExit, match=r"sets bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states, "
                                         r".* but the job runs in fp32 \(--dtype\); give --dtype bf16"):
        _job(tmp_path, ds, "--dtype", "fp32")
