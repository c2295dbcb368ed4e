"""The partitioned optimizer's own arithmetic: the gradient norm, and clipping folded into a fused step
(world of one, in-process; the oracle in test_engine.py covers the results across ranks)."""

from __future__ import annotations

import pytest
import torch

import zerodp
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
    engine.reducer.wait()
    grads = engine.reducer.shard_grads()
    assert len(grads) > 2
    exact = sum(g.double().square().sum() for g in grads)
    ours = engine.partitioned.grad_norm_squared(grads)
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
