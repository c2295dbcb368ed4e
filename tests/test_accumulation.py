"""backward() and step() called in any order give PyTorch's accumulate-then-step, on every stage.

A pattern is a string of 'b' (engine.backward on a fresh batch) and 's' (engine.step). The reference
is plain PyTorch on one process with each whole batch: every backward adds the gradient of
loss / gradient_accumulation_steps, and a step updates once at least gradient_accumulation_steps
backward() calls were made since the last update (DeepSpeed's step() after every backward() is the
case where it is exactly that many; two backward() calls then one step() at 1 sum both gradients).
"""

from __future__ import annotations

import functools

import pytest
import torch

import zerodp
from zerodp.engine.engine import inside
from oracle import D_IN, D_OUT, MICRO, Toy
from spawn import run_ranks

PATTERNS = {
    "step_without_backward_then_two_backwards_then_step_gas1": (1, "sbbsbbbs"),
    "three_backwards_then_step_gas2": (2, "bbbsbsbs"),
    "backward_across_boundary_without_step_gas2": (2, "bsbbsbs"),
}
SETTINGS = ([(stage, overlap, False) for stage in range(4) for overlap in (True, False)]
            + [(stage, True, True) for stage in (1, 2, 3)])


def _batches(pattern: str, world: int) -> list:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(world * MICRO, D_IN, generator=g), 5 * torch.randn(world * MICRO, D_OUT, generator=g))
            for _ in range(pattern.count("b"))]


def _engine_run(rank: int, world: int, gas: int, pattern: str, stage: int, overlap: bool,
                offload: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Toy()
    zero = {"stage": stage, "overlap_comm": overlap, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "zero_optimization": zero})
    batches = iter(_batches(pattern, world))
    sl = slice(rank * MICRO, (rank + 1) * MICRO)
    for op in pattern:
        if op == "b":
            x, y = next(batches)
            engine.backward(engine(x[sl], y[sl]))
        else:
            engine.step()
    return engine.full_state_dict()


def _all_runs(rank: int, world: int) -> dict:
    return {(name, s): _engine_run(rank, world, *PATTERNS[name], *s) for name in PATTERNS for s in SETTINGS}


@functools.cache
def engine_runs(world: int) -> dict:
    return run_ranks(_all_runs, world)[0]


def reference(name: str, world: int) -> dict[str, torch.Tensor]:
    gas, pattern = PATTERNS[name]
    torch.manual_seed(0)
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches, since_update = iter(_batches(pattern, world)), 0
    for op in pattern:
        if op == "b":
            (model(*next(batches)) / gas).backward()
            since_update += 1
        elif since_update >= gas:
            opt.step()
            opt.zero_grad(set_to_none=True)
            since_update = 0
    return model.state_dict()


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world={w}")
@pytest.mark.parametrize("setting", SETTINGS,
                         ids=lambda s: f"stage={s[0]}-overlap={s[1]}" + ("-offload" if s[2] else ""))
@pytest.mark.parametrize("name", list(PATTERNS))
def test_backward_step_pattern_matches_pytorch_accumulate_then_step(name, setting, world):
    ours, ref = engine_runs(world)[(name, setting)], reference(name, world)
    assert ours.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")


STATE_RUNS = {  # (stage, gradient_accumulation_steps): what "bbs" goes through
    # full buckets: summed locally, reduced at the boundary, reopened by a further backward
    (1, 2): [("ACCUMULATE", "EMPTY", "SUMMED"), ("REDUCE", "SUMMED", "REDUCED"), (None, None, "EMPTY")],
    (1, 1): [("REDUCE", "EMPTY", "REDUCED"), ("REDUCE", "SUMMED", "REDUCED"), (None, None, "EMPTY")],
    # sharded gradients: every backward reduces, the shards hold the sum
    (2, 2): [("REDUCE", "EMPTY", "SUMMED"), ("REDUCE", "SUMMED", "SUMMED"), (None, None, "EMPTY")],
}


def _states_run(rank: int, world: int) -> dict:
    """Per setting and op of "bbs": (the reducer's Pass and Window during the backward, its Window after)."""
    out = {}
    for stage, gas in STATE_RUNS:
        torch.manual_seed(0)
        model = Toy()
        engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage}})
        reducer, seen = inside(engine).training.reducer, []
        model.register_full_backward_pre_hook(
            lambda *_: seen.append((reducer.backward_pass.name, reducer.window.name)))
        x, y = _batches("bb", world)[0]
        ops = []
        for op in "bbs":
            seen.clear()
            if op == "b":
                engine.backward(engine(x[:MICRO], y[:MICRO]))
            else:
                engine.step()
            assert reducer.backward_pass.name == "IDLE"
            ops.append((*(seen[0] if seen else (None, None)), reducer.window.name))
        out[stage, gas] = ops
    return out


def test_reducer_states_follow_backward_and_step():
    for ours in run_ranks(_states_run, 2):
        assert ours == STATE_RUNS
