"""The step path without host syncs, and a fake world whose gradients are real numbers.

Fake world: one process as rank 0 of N on torch's "fake" process group (zerodp estimate --measure
real, zerodp bench --fake-world). Its collectives send nothing; zerodp gives them the values of a
world whose every rank holds this rank's data, so a gradient shard is this rank's chunk of the
one-process gradient (of the parameters it gathered: in stage 3 rank 0's chunk in every place),
whatever the allocator held there before. The test fills every uninitialised
tensor with nan (torch's deterministic mode), as a GPU's reused memory may be.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import tempfile

import pytest
import torch

import oracle
import zerodp

FAKE_WORLD = 4


def _fake_world_step(stage: int, out_path: str) -> None:
    """Rank 0 of FAKE_WORLD on the fake group: its gradient shard after one backward, the plain
    PyTorch gradient of the same batch and parameters laid out the same way, and what the step did."""
    from zerodp.distributed.comm import init_fake

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # torch.empty gives nan
    init_fake(FAKE_WORLD)
    case = oracle.CASES["plain"]
    model = oracle.build(case)
    plain = copy.deepcopy(model)
    cfg = oracle.config_for(oracle.Case(gas=1, clip=0.0), stage, FAKE_WORLD)
    engine = zerodp.initialize(model, case.optimizer(model), cfg)
    # Stage 3 gathers its parameters through the fake collective too: every rank's chunk is rank 0's.
    with engine.gathered_parameters():
        plain.load_state_dict({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    x, y = oracle.batches(1, 1)[0][0]
    engine.backward(engine(x, y))
    engine.reducer.wait()  # stages 0-1 finish their reductions at the step
    grads = [g.clone() for g in engine.reducer.shard_grads()]
    plain(x, y).backward()
    by_name = dict(plain.named_parameters())
    names = {id(p): n for n, p in engine.module.named_parameters()}
    expected = []
    for b in engine.partitioned_optimizer.buckets:
        flat = torch.zeros(b.numel)
        for s in b.slots:
            flat[s.offset:s.offset + s.numel] = by_name[names[id(s.param)]].grad.reshape(-1)
        rank = engine.partitioned_optimizer.rank
        expected.append(flat if stage == 0 else flat[rank * b.shard_numel:(rank + 1) * b.shard_numel])
    engine.step()
    torch.save({"grads": grads, "expected": expected, "skipped": engine.skipped_steps,
                "masters_finite": all(bool(torch.isfinite(m).all()) for m in engine.partitioned_optimizer.masters)},
               out_path)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fake_world_gradient_shard_is_this_ranks_share_of_the_plain_gradient(stage):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pt")
        child = multiprocessing.get_context("fork").Process(target=_fake_world_step, args=(stage, path))
        child.start()
        child.join(120)
        assert child.exitcode == 0, f"the fake-world child failed (exit code {child.exitcode})"
        out = torch.load(path)
    for got, want in zip(out["grads"], out["expected"], strict=True):
        assert torch.isfinite(got).all(), "the fake collective left an unwritten (nan) gradient"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert out["skipped"] == 0 and out["masters_finite"]
