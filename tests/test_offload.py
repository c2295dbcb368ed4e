"""ZeRO-Offload's host side (engine/stepping/offload.py): the fused CPU kernel for an optimizer that chose no
implementation, copies that cross devices in one dtype, and the host bytes memory_report counts
(world of one, in-process; the oracle in test_engine.py covers offload's results across ranks)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zerodp
from zerodp.engine.engine import inside
from oracle import D_IN, D_OUT, Toy
from zerodp.engine.stepping.offload import pinned_bytes, use_fused_kernel


def _engine(optimizer, offload: bool = True, dtype: str = "fp32"):
    torch.manual_seed(0)
    model = Toy(hidden=300)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1e-3,
              "bf16": {"enabled": dtype == "bf16"},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000,
                                    **({"offload_optimizer": {"device": "cpu"}} if offload else {})}}
    return zerodp.initialize(model, optimizer(model.parameters()), config)


def _train(engine, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        engine.backward(engine(torch.randn(3, D_IN, generator=g), 100 * torch.randn(3, D_OUT, generator=g)))
        engine.step()


# ---- the fused kernel on the host shards -----------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_torchs_fused_cpu_kernel_is_the_single_tensor_algorithm_within_1e_6(cls):
    """The tolerance docs/CONFIG.md states: after 20 steps the moments are equal and the parameters
    within 1e-6 (the single-tensor loop and the kernel round the update differently, by an ulp)."""
    torch.manual_seed(0)
    start = torch.randn(100_003)
    out = {}
    for fused in (None, True):
        p = torch.nn.Parameter(start.clone())
        opt = cls([p], lr=1e-3, weight_decay=0.1, fused=fused)
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        out[fused] = (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
    for single, kernel in zip(out[None], out[True]):
        torch.testing.assert_close(kernel, single, rtol=1e-6, atol=1e-6)


def test_offload_steps_a_default_adamw_with_torchs_fused_kernel():
    engine = _engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert all(g["fused"] is True for g in engine.optimizer.param_groups)
    steps = []
    real = torch._fused_adamw_
    torch._fused_adamw_ = lambda *a, **k: steps.append(1) or real(*a, **k)
    try:
        _train(engine, 1)
    finally:
        torch._fused_adamw_ = real
    assert steps, "the offloaded step must run the fused kernel"


@pytest.mark.parametrize("chosen", [{"foreach": False}, {"foreach": True}, {"fused": False}])
def test_an_implementation_the_user_chose_is_kept(chosen):
    engine = _engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3, **chosen))
    group = engine.optimizer.param_groups[0]
    assert (group["foreach"], group["fused"]) == (chosen.get("foreach"), chosen.get("fused"))


def test_without_offload_the_users_optimizer_is_left_as_built():
    engine = _engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3), offload=False)
    assert engine.optimizer.param_groups[0]["fused"] is None


def test_offload_with_the_fused_kernel_trains_as_the_single_tensor_loop_within_1e_6():
    ours = _engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    chosen = _engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False))
    _train(ours)
    _train(chosen)
    for a, b in zip(ours.module.parameters(), chosen.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_loaded_state_with_no_implementation_chosen_is_switched_again():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p])
    assert use_fused_kernel(opt)
    saved = opt.state_dict()
    opt.load_state_dict({**saved, "param_groups": [{**saved["param_groups"][0], "fused": None}]})
    assert opt.param_groups[0]["fused"] is True and opt._step_supports_amp_scaling
    opt.load_state_dict({**saved, "param_groups": [{**saved["param_groups"][0], "fused": None, "foreach": False}]})
    assert opt.param_groups[0]["fused"] is None and not opt._step_supports_amp_scaling


def test_only_torchs_own_adam_and_adamw_are_switched():
    p = torch.nn.Parameter(torch.zeros(4))

    class MyAdam(torch.optim.AdamW):
        pass
    assert not use_fused_kernel(MyAdam([p]))
    assert not use_fused_kernel(torch.optim.SGD([p], lr=0.1))


# ---- copies between the device and the host ------------------------------------------------------
class _Copies(TorchDispatchMode):
    """Every copy_ as (destination storage, its dtype, source storage, its dtype)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, torch.dtype, int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            self.seen.append((dst.untyped_storage().data_ptr(), dst.dtype,
                              src.untyped_storage().data_ptr(), src.dtype))
        return func(*args, **(kwargs or {}))


def test_offloaded_bf16_step_copies_to_and_from_device_tensors_in_one_dtype(monkeypatch):
    """A cross-device copy_ that changes dtype converts through a full-size temporary (on the device
    for the gradients, in pageable host memory for the weights): the step casts on the host instead.
    The device's tensors are the working buffers and the gradient shards (all on the CPU here)."""
    engine = _engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3), dtype="bf16")
    _train(engine, 1)
    device = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    part = inside(engine).training.partitioned_optimizer
    real_step = part.step
    monkeypatch.setattr(part, "step", lambda grads, *a, **k: device.update(
        g.untyped_storage().data_ptr() for g in grads) or real_step(grads, *a, **k))
    g = torch.Generator().manual_seed(2)
    engine.backward(engine(torch.randn(3, D_IN, generator=g), torch.randn(3, D_OUT, generator=g)))
    with _Copies() as copies:
        engine.step()
    crossing = [c for c in copies.seen if c[0] in device or c[2] in device]
    assert len(crossing) >= 2 * len(part.buckets), "each bucket's gradient goes out and its weights come back"
    assert [c for c in crossing if c[1] != c[3]] == []


def test_memory_report_counts_the_staging_shards_on_the_host():
    engine = _engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3), dtype="bf16")
    _train(engine, 1)
    report = engine.memory_report()
    shard = sum(b.shard_numel for b in inside(engine).training.partitioned_optimizer.buckets)
    assert report["offload_staging"] == 2 * shard
    assert report["host_model_states"] == (report["fp32_master"] + report["optimizer_states"]
                                           + report["offload_gradients"] + 2 * shard)
    assert report["offload_pinned_rounding"] == 0  # nothing is pinned without an accelerator
    fp32 = _engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3)).memory_report()
    assert fp32["offload_staging"] == 0  # fp32 copies change no dtype


def test_pinned_memory_is_counted_as_the_host_allocator_rounds_it(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert pinned_bytes(5) == 8 and pinned_bytes(2 ** 20) == 2 ** 20 and pinned_bytes(2 ** 20 + 1) == 2 ** 21
    assert pinned_bytes(2 ** 20 + 1, pinned=False) == 2 ** 20 + 1
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True,pinned_max_round_threshold_mb:1")
    assert pinned_bytes(2 ** 20 + 1) == 2 ** 20 + 1 and pinned_bytes(1000) == 1024


def test_offload_host_memory_is_one_block():
    part = inside(_engine(lambda ps: torch.optim.AdamW(ps, lr=1e-3), dtype="bf16")).training.partitioned_optimizer
    block = part.host.block.untyped_storage().data_ptr()
    assert len(part.buckets) > 2
    for t in part.masters + part.host.grads + part.host.staging:
        assert t.untyped_storage().data_ptr() == block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU every tensor is host memory")
def test_offloaded_bf16_step_on_cuda_allocates_no_device_temporary_of_a_shard():
    """The device temporary a dtype-changing non-blocking copy makes would be 4 bytes per shard
    element; the step's own device allocations (norm rows, flags) are a few hundred KiB here."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048).cuda()  # one bucket, one shard of 4.2M elements
    config = {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    x = torch.randn(3, 2048, device="cuda")
    for _ in range(2):  # the second step is measured: the first makes the optimizer state
        engine.backward(engine(x).float().square().mean())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        engine.step()
        torch.cuda.synchronize()
    shard = max(b.shard_numel for b in inside(engine).training.partitioned_optimizer.buckets)
    assert torch.cuda.max_memory_allocated() - before < shard  # bytes: a quarter of the fp32 temporary
    host = inside(engine).training.partitioned_optimizer.host
    assert host.block.is_pinned()
    report = engine.memory_report()
    assert report["offload_pinned_rounding"] == pinned_bytes(host.block.numel()) - host.block.numel()
