"""overlap_param_gather: the next forward waits for each bucket's all-gather before its first use.

In a world of one every gather finishes at once, so here the engine's all-gathers are replaced by
handles that only count as finished once waited for; a TorchFunctionMode then checks that no
parameter is passed to any torch function while its bucket's gather is still in flight.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import zerodp
from zerodp.engine.engine import inside
from oracle import D_IN, D_OUT, Toy, one_group


class _Gather:
    def __init__(self, done: set, k: int):
        self.done, self.k = done, k

    def wait(self):
        self.done.add(self.k)
        return True


class _CheckReady(TorchFunctionMode):
    def __init__(self, bucket_of, done):
        super().__init__()
        self.bucket_of, self.done, self.stale = bucket_of, done, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            k = self.bucket_of.get(id(t)) if isinstance(t, nn.Parameter) else None
            if k is not None and k not in self.done:
                self.stale.append((func.__name__, k))
        return func(*args, **(kwargs or {}))


def _engine(stage, **zero):
    model = Toy(tied=True, parent=True, reuse=True, ckpt=True, unused=True)
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, **zero}}
    return model, zerodp.initialize(model, one_group(model), cfg)


@pytest.mark.parametrize("stage", [1, 2])
def test_every_parameter_is_gathered_before_its_first_use(stage):
    model, engine = _engine(stage, overlap_param_gather=True)
    buckets = inside(engine).training.partitioned_optimizer.buckets
    assert len(buckets) > 5, "the check needs many buckets"
    bucket_of = {id(s.param): b.index for b in buckets for s in b.slots}
    by_ptr = {b.data.data_ptr(): b.index for b in buckets}
    done: set[int] = set(range(len(buckets)))

    def all_gather(out, inp, async_op=False):
        k = by_ptr[out.data_ptr()]
        done.discard(k)
        return _Gather(done, k)

    inside(engine).comm.all_gather = all_gather
    ready_at_root = []
    model.register_forward_pre_hook(lambda m, a: ready_at_root.append(len(done)))
    g = torch.Generator().manual_seed(0)
    check = _CheckReady(bucket_of, done)
    for step in range(3):
        model.use_sometimes = step % 2 == 1
        x, y = torch.randn(3, D_IN, generator=g), torch.randn(3, D_OUT, generator=g)
        with check:
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        assert len(done) < len(buckets), "step() must leave gathers in flight"
    assert check.stale == [], "parameters used before their gather finished"
    # After the traced first forward the root starts with most gathers still in flight: overlap.
    assert all(n < len(buckets) for n in ready_at_root[1:]), ready_at_root
    engine.wait_for_parameters()
    assert len(done) == len(buckets)


def test_without_overlap_step_returns_with_parameters_gathered():
    model, engine = _engine(2)
    assert inside(engine).training.forward_order is None
    x, y = torch.randn(3, D_IN), torch.randn(3, D_OUT)
    engine.backward(engine(x, y))
    engine.step()
    assert not inside(engine).training.partitioned_optimizer.pending


def test_forward_that_raises_ends_the_trace():
    model, engine = _engine(2, overlap_param_gather=True)
    with pytest.raises(RuntimeError):
        engine(torch.randn(3, D_IN + 1), torch.randn(3, D_OUT))
    assert inside(engine).training.forward_order._trace is None
    assert not torch._C._is_torch_function_mode_enabled()
    loss = engine(torch.randn(3, D_IN), torch.randn(3, D_OUT))
    engine.backward(loss)
    engine.step()
    assert inside(engine).training.forward_order.traced
