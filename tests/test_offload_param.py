"""Stage 3's offload_param: the rank's parameter shards live in host memory and reach the device only
for a gather (in-process, world of one; test_engine.py checks the results against the oracle on
worlds 1 and 2). On a CPU machine host and device are one memory, so placement is checked by where the
engine keeps each buffer and what its memory report counts; the CUDA test checks device memory."""

from __future__ import annotations

import logging

import pytest
import torch

import zerodp
from zerodp.engine.engine import inside
from oracle import D_IN, D_OUT, Toy, one_group
from zerodp.config import OffloadParamConfig
from zerodp.plan.formulas import offload_split


def _config(stage: int = 3, offload_param: dict | None = None, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "offload_param": offload_param or {"device": "cpu"}, **extra}}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage3_is_ignored_with_one_warning_line_as_deepspeed_does(stage, caplog):
    with caplog.at_level(logging.WARNING, logger="zerodp"):
        cfg = zerodp.load_config(_config(stage, offload_param={"device": "cpu", "pin_memory": False}))
    assert cfg.zero_optimization.offload_param == OffloadParamConfig()  # as if absent
    assert [r.getMessage().count("\n") for r in caplog.records] == [0]
    assert f"offload_param is ignored at stage {stage}, as DeepSpeed ignores it" in caplog.text


def test_offload_param_to_nvme_needs_a_path_and_a_buffer():
    """(tests/test_nvme.py trains with it.)"""
    with pytest.raises(zerodp.ConfigError, match=r"offload_param.device \"nvme\" needs offload_param.nvme_path"):
        zerodp.load_config(_config(offload_param={"device": "nvme"}))
    with pytest.raises(zerodp.ConfigError, match=r"offload_param.buffer_count 0 with device \"nvme\""):
        zerodp.load_config(_config(offload_param={"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 0}))
    cfg = zerodp.load_config(_config(offload_param={"device": "nvme", "nvme_path": "/local_nvme"}))
    assert cfg.zero_optimization.offload_param.device == "nvme"


def test_deepspeeds_nvme_buffer_keys_load_with_cpu_offload_which_reads_them_not():
    keys = {"device": "cpu", "pin_memory": True, "buffer_count": 4, "buffer_size": 1e8, "max_in_cpu": 1e9}
    cfg = zerodp.load_config(_config(offload_param=keys)).zero_optimization.offload_param
    assert (cfg.device, cfg.buffer_count, cfg.buffer_size) == ("cpu", 4, 100_000_000)
    with pytest.raises(zerodp.ConfigError, match="buffer_count"):
        zerodp.load_config(_config(offload_param={"device": "cpu", "buffer_count": -1}))


def _engine(offload_param: bool, device: str = "cpu", offload_optimizer: bool = False):
    torch.manual_seed(0)
    model = Toy(hidden=300).to(device)
    extra = {"offload_optimizer": {"device": "cpu" if offload_optimizer else "none"}}
    cfg = _config(offload_param={"device": "cpu" if offload_param else "none"}, **extra)
    return model, zerodp.initialize(model, one_group(model), cfg)


def _train(model, engine, steps: int = 2):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(3, D_IN, generator=g), torch.randn(3, D_OUT, generator=g)
        engine.backward(engine(x.to(inside(engine).spec.device), y.to(inside(engine).spec.device)))
        engine.step()


def test_stage3_offload_param_keeps_the_shards_in_host_memory_and_reports_them_there():
    model, engine = _engine(offload_param=True)
    _train(model, engine)
    assert all(g.data.device.type == "cpu" for g in inside(engine).layout.groups)
    report = engine.memory_report()
    assert report["gathered_params"] == 0, "between steps nothing is gathered"
    assert report["host_model_states"] == report["working_params"] > 0
    assert report["device_model_states"] == report["model_states"] - report["working_params"]


def test_offload_split_formula_moves_the_param_shard_to_the_host():
    psi, n = 10**9, 8
    assert offload_split(psi, n) == {"device": 16 * psi // n, "host": 0}
    assert offload_split(psi, n, offload_param=True) == {"device": 14 * psi // n, "host": 2 * psi // n}
    assert offload_split(psi, n, offload_param=True, offload_optimizer=True) == {"device": 2 * psi // n,
                                                                                "host": 20 * psi // n}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU host and device are one memory")
def test_stage3_offload_param_on_cuda_holds_only_gathered_windows_on_the_device():
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model, on_device = _engine(offload_param=False, device="cuda")
    device_bytes = torch.cuda.memory_allocated() - base
    del model, on_device
    model, engine = _engine(offload_param=True, device="cuda")
    offloaded_bytes = torch.cuda.memory_allocated() - base
    shard = sum(g.data.numel() * g.data.element_size() for g in inside(engine).layout.groups)
    assert all(g.data.device.type == "cpu" and g.data.is_pinned() for g in inside(engine).layout.groups)
    assert all(b.data.device.type == "cuda" for g in inside(engine).layout.groups for b in g.buckets)
    assert offloaded_bytes <= device_bytes - shard + 4096  # the bf16 shards left the device
    _train(model, engine)
    assert engine.memory_report()["gathered_params"] == 0
