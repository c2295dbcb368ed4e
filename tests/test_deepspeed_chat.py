"""The DeepSpeed names that DeepSpeed-Chat-style scripts import, each used as those scripts use it:
ops.adam's FusedAdam / DeepSpeedCPUAdam, `from deepspeed import get_accelerator`, compression.helper's
recursive_getattr / recursive_setattr, the `hybrid_engine` section, engine.tput_timer, offload_param
beside offload_optimizer at stage 2, and `--local_rank` under torchrun. tests/scripts/dsc_sft.py (step 1
of DeepSpeed-Chat in miniature, its imports ported and nothing else) runs on 2 ranks and matches one
process on the whole batch."""

from __future__ import annotations

import argparse
import logging
import math
import os
import types

import pytest
import torch
from torch.utils.data import DistributedSampler

import zerodp.deepspeed as deepspeed
from oracle import D_IN, D_OUT, Toy
from spawn import run_ranks
from test_deepspeed_scripts import load, port
from zerodp.config import ConfigError

WORLD, MICRO, GAS, EPOCHS = 2, 4, 2, 2


def _run_sft(rank: int, world: int, tmp: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zerodp").addHandler(handler)
    sft = load(os.path.join(tmp, "dsc_sft.py"))
    fused = sft.main([])
    fused["warnings"], warnings[:] = list(warnings), []
    offload = sft.main(["--offload"])
    offload["warnings"] = list(warnings)
    return {"fused": fused, "offload": offload}


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dsc"))
    port("dsc_sft.py", tmp)
    return tmp, run_ranks(_run_sft, WORLD, tmp)


@pytest.fixture(scope="module")
def sft_reference(sft_runs):
    return _reference(load(os.path.join(sft_runs[0], "dsc_sft.py")))


def _reference(sft) -> tuple[list[float], float, dict]:
    """One process, torch.optim.AdamW, each step on every rank's micro-batches of the step at once."""
    args = sft.parse_args(["--local_rank", "0"])
    model = sft.build_model(args)
    opt = torch.optim.AdamW(sft.get_optimizer_grouped_parameters(model, args.weight_decay), lr=args.learning_rate,
                            betas=(0.9, 0.95))
    train, evaluate = sft.datasets()
    per_rank = len(train) // WORLD
    steps = math.ceil(per_rank / MICRO / GAS)
    sched = sft.warmup_linear(opt, 2, EPOCHS * steps)
    losses = []
    for epoch in range(EPOCHS):
        orders = []
        for r in range(WORLD):
            sampler = DistributedSampler(train, num_replicas=WORLD, rank=r)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for s in range(steps):
            loss = model(*train[[i for o in orders for i in o[s * MICRO * GAS:(s + 1) * MICRO * GAS]]])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
    with torch.no_grad():
        eval_loss = model(*evaluate[:]).item()
    return losses, eval_loss, dict(model.named_parameters())


@pytest.mark.parametrize("run", ["fused", "offload"])
def test_deepspeed_chat_sft_script_with_only_its_imports_ported_matches_one_process(sft_runs, sft_reference, run):
    _, runs = sft_runs
    losses, eval_loss, weights = sft_reference
    got = [sum(sum(r[run]["losses"][s * GAS:(s + 1) * GAS]) for r in runs) / (WORLD * GAS)
           for s in range(len(losses))]
    assert len(runs[0][run]["losses"]) == len(losses) * GAS == 16
    assert max(abs(a - b) for a, b in zip(got, losses)) < 1e-6, (got, losses)
    for rank, r in enumerate(runs):
        out = r[run]
        assert out["eval_loss"] == pytest.approx(eval_loss, abs=1e-6)
        assert max((out["weights"][n] - w).abs().max().item() for n, w in weights.items()) < 1e-6
        # FusedAdam / DeepSpeedCPUAdam: torch's fused AdamW, rewired to step the engine's master shards.
        assert out["optimizer"] == ("FusedAdam" if run == "fused" else "DeepSpeedCPUAdam")
        assert out["fused"] and out["masters_not_model"]
        # --local_rank: LOCAL_RANK under torchrun, as DeepSpeed's launcher would pass it, and after initialize.
        assert out["seen_local_rank"] == out["local_rank_after"] == rank
        # engine.tput_timer: every optimizer step counted, the epochs the script counted, a rate.
        assert (out["epochs"], out["timed_steps"]) == (EPOCHS, len(losses))
        assert 0 < out["samples_per_sec"] < math.inf


def test_offload_param_at_stage_2_is_ignored_with_one_warning_line_as_deepspeed(sft_runs):
    _, runs = sft_runs
    for r in runs:
        assert (r["offload"]["offload_param"], r["offload"]["offload_optimizer"]) == (False, True)
        assert [w for w in r["offload"]["warnings"] if "offload_param" in w] == [
            "zero_optimization.offload_param is ignored at stage 2, as DeepSpeed ignores it: only stage 3 "
            "partitions parameters, so they stay on the device; use stage 3 to offload them, or remove the section"]
        assert not [w for w in r["fused"]["warnings"] if "offload_param" in w]


def test_get_accelerator_is_imported_from_the_package_too():
    from zerodp.deepspeed import get_accelerator
    from zerodp.deepspeed.accelerator import get_accelerator as from_module

    assert get_accelerator is from_module and get_accelerator() is from_module()
    assert deepspeed.get_accelerator().communication_backend_name() in ("gloo", "nccl", "xccl")


def test_recursive_getattr_and_setattr_swap_modules_by_dotted_name_as_lora_conversion_does():
    from zerodp.deepspeed.compression.helper import recursive_getattr, recursive_setattr

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    assert recursive_getattr(model, "1.1") is model[1][1]
    assert recursive_getattr(model, "1.1.weight") is model[1][1].weight
    new = torch.nn.Linear(3, 1)
    recursive_setattr(model, "1.1", new)
    assert model[1][1] is new and dict(model.named_modules())["1.1"] is new
    recursive_setattr(model, "0", torch.nn.Identity())
    assert isinstance(model[0], torch.nn.Identity)
    with pytest.raises(AttributeError):
        recursive_getattr(model, "1.nothing")


def test_fused_adam_and_cpu_adam_are_adamw_by_default_and_adam_with_l2_without_it():
    from zerodp.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    cases = [(FusedAdam, {}, torch.optim.AdamW), (FusedAdam, {"adam_w_mode": False}, torch.optim.Adam),
             (DeepSpeedCPUAdam, {}, torch.optim.AdamW), (DeepSpeedCPUAdam, {"adamw_mode": False}, torch.optim.Adam)]
    for cls, mode, torch_cls in cases:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(50, generator=g, requires_grad=True)
        w_ref = w.detach().clone().requires_grad_()
        ours = cls([{"params": [w]}], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **mode)
        ref = torch_cls([w_ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        for _ in range(4):
            w.grad = torch.randn(50, generator=g)
            w_ref.grad = w.grad.clone()
            ours.step()
            ref.step()
        assert ours.defaults["fused"] and isinstance(ours, torch.optim.Adam)
        assert (w - w_ref).abs().max().item() < 1e-6, (cls.__name__, mode)


def test_what_torchs_adam_cannot_do_is_refused_naming_the_argument():
    from zerodp.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"FusedAdam\(bias_correction=False\) is not supported: torch's Adam"):
        FusedAdam(params, bias_correction=False)
    with pytest.raises(ValueError, match=r"fp32_optimizer_states=False\) is not supported: zerodp keeps"):
        DeepSpeedCPUAdam(params, fp32_optimizer_states=False)


HYBRID = {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": False,
          "pin_parameters": True, "tp_gather_partition_size": 8}


def test_hybrid_engine_disabled_has_no_effect_and_enabled_is_refused_with_the_reason():
    config = {"train_micro_batch_size_per_gpu": 2, "hybrid_engine": HYBRID}
    engine, *_ = deepspeed.initialize(model=(m := Toy()), optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                      config=config)
    assert engine.config.hybrid_engine.enabled is False
    with pytest.raises(ConfigError, match=r"'hybrid_engine.enabled' = true is not supported: DeepSpeed's hybrid "
                                          r"engine .* zerodp does not have"):
        deepspeed.initialize(model=(m := Toy()), optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                             config={**config, "hybrid_engine": {**HYBRID, "enabled": True}})
    with pytest.raises(ConfigError, match=r"unknown config key 'hybrid_engine.max_out_token'"):
        deepspeed.initialize(model=(m := Toy()), optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                             config={**config, "hybrid_engine": {"enabled": False, "max_out_token": 256}})


def test_engine_tput_timer_counts_every_micro_step_and_optimizer_step():
    model = Toy()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        engine.backward(engine(torch.randn(2, D_IN, generator=g), torch.randn(2, D_OUT, generator=g)))
        engine.step()
    timer = engine.tput_timer
    assert (timer.global_step_count, timer.micro_step_count, timer.batch_size) == (5, 10, 4)
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)
    assert timer.avg_samples_per_sec() == pytest.approx(4 / (timer.total_elapsed_time / 3))


def test_throughput_timer_skips_the_warm_up_steps_and_reports_as_deepspeed(monkeypatch):
    from zerodp.deepspeed.utils import timer as timer_module

    clock = iter(range(100, 1000, 1))  # each reading one second later
    monkeypatch.setattr(timer_module.time, "time", lambda: float(next(clock)))
    lines: list[str] = []
    timer = timer_module.ThroughputTimer(batch_size=8, start_step=2, steps_per_output=2, logging_fn=lines.append)
    assert timer.avg_samples_per_sec() == -math.inf
    for _ in range(6):  # 6 optimizer steps of one micro-step; the last 4 are timed, 1 s each
        timer.start()
        timer.stop(global_step=True)
    assert timer.total_elapsed_time == 4.0 and timer.avg_samples_per_sec() == 8.0
    assert lines == [f"epoch=0/micro_step={n}/global_step={n}, RunningAvgSamplesPerSec=8.0, CurrSamplesPerSec=8.0, "
                     "MemAllocated=0.0GB, MaxMemAllocated=0.0GB" for n in (4, 6)]
    # DeepSpeed's timers.throughput settings: disabled counts nothing; synchronized waits for the device.
    off = timer_module.ThroughputTimer(types.SimpleNamespace(enabled=False, synchronized=True), batch_size=8)
    off.start()
    off.stop(global_step=True)
    assert off.global_step_count == 0
    syncs = []
    monkeypatch.setattr(timer_module.get_accelerator(), "synchronize", lambda *a: syncs.append(1))
    synced = timer_module.ThroughputTimer(types.SimpleNamespace(enabled=True, synchronized=True), batch_size=8,
                                          start_step=0, steps_per_output=1, monitor_memory=True,
                                          logging_fn=lines.append)
    synced.start()
    synced.stop(global_step=True)
    assert len(syncs) == 2 and "vm %: " in lines[-1] and "swap %: " in lines[-1]


def _parser(declare_first: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    if declare_first:
        parser.add_argument("--local_rank", type=int, default=-1)
    return deepspeed.add_config_arguments(parser)


def test_local_rank_defaults_to_torchruns_local_rank_as_deepspeeds_launcher_passes_it(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _parser().parse_args([]).local_rank == -1  # no launcher: not distributed, as with DeepSpeed
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _parser().parse_args([]).local_rank == 3
    assert _parser().parse_args(["--local_rank=3"]).local_rank == 3  # DeepSpeed's launcher's own flag
    assert not hasattr(_parser(declare_first=False).parse_args([]), "local_rank")  # none declared: none added


def test_initialize_aligns_args_local_rank_with_local_rank_and_refuses_a_mismatch(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)  # declared after: the default stays -1
    args = parser.parse_args([])
    assert args.local_rank == -1
    config = {"train_micro_batch_size_per_gpu": 2}
    deepspeed.initialize(args=args, model=(m := Toy()), optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                         config=config)
    assert args.local_rank == 0  # as DeepSpeed's engine sets it
    args.local_rank = 1
    with pytest.raises(ValueError, match=r"Mismatch in local rank setting, args.local_rank=1 but "
                                         r"env\['LOCAL_RANK'\]=0"):
        deepspeed.initialize(args=args, model=(m := Toy()), optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                             config=config)
