"""The partitioned optimizer's own arithmetic: the gradient norm, and clipping folded into a fused step
(world of one, in-process; the oracle in test_engine.py covers the results across ranks)."""

from __future__ import annotations

import pytest
import torch

import zerodp
from zerodp.engine.engine import inside
from oracle import D_IN, D_OUT, Toy, fused, one_group


def _engine(optimizer, **cfg):
    model = Toy(hidden=300)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1e-3,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000}, **cfg}
    return zerodp.initialize(model, optimizer(model), config)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradient_norm_matches_an_fp64_norm(dtype):
    engine = _engine(one_group, **({"bf16": {"enabled": True}} if dtype == "bf16" else {}))
    x, y = torch.randn(3, D_IN), 100 * torch.randn(3, D_OUT)
    engine.backward(engine(x, y))
    inside(engine).training.reducer.wait()
    grads = inside(engine).training.reducer.shard_grads()
    assert len(grads) > 2
    exact = sum(g.double().square().sum() for g in grads)
    ours, _ = inside(engine).training.partitioned_optimizer.grad_norm_squared(grads)
    assert ours.dtype == torch.float64
    # fp32 row norms: about 1e-8 relative; one fp32 norm per shard would be off by ~1e-6.
    torch.testing.assert_close(ours, exact, rtol=1e-7, atol=0)


@pytest.mark.parametrize("optimizer,passes", [(fused, 0), (one_group, 1)], ids=["fused", "foreach"])
def test_clip_is_folded_into_a_fused_step(monkeypatch, optimizer, passes):
    engine = _engine(optimizer)
    calls = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a: calls.append(1) or real(*a))
    x, y = torch.randn(3, D_IN), 100 * torch.randn(3, D_OUT)
    engine.backward(engine(x, y))
    engine.step()
    assert engine.grad_norm > 1e-3, "clipping must be active"
    assert len(calls) == passes
    assert not hasattr(engine.optimizer, "grad_scale"), "the scale must not outlive the step"


def _train_bf16(**zero):
    torch.manual_seed(0)
    model = Toy(hidden=300)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1e-3, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000, **zero}}
    engine = zerodp.initialize(model, fused(model), config)
    calls = []
    engine.optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        engine.backward(engine(torch.randn(3, D_IN, generator=g), 100 * torch.randn(3, D_OUT, generator=g)))
        engine.step()
    return engine, [m.clone() for m in inside(engine).training.partitioned_optimizer.masters], len(calls) // 3


def test_step_in_sub_groups_is_the_same_step_with_a_smaller_fp32_copy():
    whole, whole_masters, whole_calls = _train_bf16()
    parts, parts_masters, parts_calls = _train_bf16(sub_group_size=6000)
    numels = [b.shard_numel for b in inside(whole).training.partitioned_optimizer.buckets]
    assert whole_calls == 1
    assert parts_calls == len(inside(parts).training.partitioned_optimizer.sub_groups(numels, torch.bfloat16)) == len(numels) > 1
    for a, b in zip(whole_masters, parts_masters):
        assert torch.equal(a, b)
    assert whole.memory_report()["step_transient"] == 4 * sum(numels)
    assert parts.memory_report()["step_transient"] <= 4 * max(6000, max(numels))


def test_element_wise_optimizers_step_flat_shards_and_every_other_one_whole_parameters():
    from zerodp.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zerodp.engine.stepping.optimizer_view import OptimizerView, view_of

    flat = [getattr(torch.optim, n) for n in ("Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "RMSprop", "Adamax",
                                              "NAdam", "RAdam", "ASGD", "Rprop")] + [FusedAdam, DeepSpeedCPUAdam]
    assert all(view_of(cls) is OptimizerView.FLAT_SHARDS for cls in flat)

    class MyAdamW(torch.optim.AdamW):  # a user's subclass may change the update: whole parameters, to be safe
        pass

    class Declared(MyAdamW):
        zerodp_element_wise = True

    for cls in (torch.optim.Adafactor, torch.optim.Muon, MyAdamW):
        assert view_of(cls) is OptimizerView.WHOLE_PARAMETERS
    assert view_of(Declared) is OptimizerView.FLAT_SHARDS


def test_adagrad_built_with_its_initial_state_is_rewired_with_that_state():
    """torch's Adagrad makes its accumulators at construction (initial_accumulator_value): remade on the shards."""
    engine = _engine(lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, initial_accumulator_value=0.25))
    states = [engine.optimizer.state[m] for m in inside(engine).master_shards()]
    assert states and all(torch.equal(s["sum"], torch.full_like(s["sum"], 0.25)) for s in states)
    assert all(float(s["step"]) == 0 for s in states)


def test_a_tp_shard_stepped_whole_counts_tp_times_in_each_ranks_share_of_the_states():
    """memory_report's whole-parameter shares divide state bytes by the elements each rank steps: a tp shard
    in a whole-parameter group is stepped as its whole matrix (tensor_parallel/whole.py), tp times its local size."""
    from zerodp.engine.layout.flat import lay_out
    from zerodp.engine.layout.layout import Layout

    shard, plain = torch.nn.Parameter(torch.zeros(4, 8)), torch.nn.Parameter(torch.zeros(2, 8))
    shard.tensor_model_parallel, shard.partition_dim = True, 0  # a Megatron column-parallel shard
    layout = Layout(lay_out([[shard, plain]], 2, 1000, whole=[True]), rank=0)
    assert sorted(layout.owned_numel()) == [16, 32]  # each rank one parameter whole
    assert sorted(layout.owned_numel(tp_size=2)) == [16, 64]  # the shard's owner steps the 8x8 matrix
    flat = Layout(lay_out([[shard, plain]], 2, 1000), rank=0)  # flat shards: never gathered over tp
    assert flat.owned_numel(tp_size=2) == flat.owned_numel()
