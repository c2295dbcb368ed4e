"""Stage 3's units (engine/layout/units.py): blocks by default, per module or by a rule on request; the oracle
holds for each, and a step costs at most three collectives per unit (a gather in the forward, one in
the backward, a reduce-scatter) plus the norm."""

from __future__ import annotations

import contextlib
import functools
import io

import oracle
import pytest
import torch
from spawn import run_ranks
from torch import nn

import zerodp
from zerodp.engine.engine import inside
from zerodp.activations import checkpoint_blocks
from zerodp.config import ConfigError
from zerodp.engine.layout.units import find_units
from zerodp.engine.sharding.gather import BucketState, planned_gathers
from zerodp.models.gpt import GPT, Block, GPTConfig, gpt_config

# zero_optimization keys of each way of choosing units ("blocks", the default, runs in test_engine.py).
MODES = {
    "module,no_coalescing": {"stage3_unit": "module", "stage3_prefetch_bucket_size": 0},  # one bucket per module
    # nested in the model's unit; small units coalesced, and prefetched
    "linears": {"stage3_unit": ["Linear"], "stage3_prefetch_bucket_size": 1500},
}
# A parameter read by code outside its unit before the unit runs is not gathered (stage3.py): with the
# Toy's own units (blocks: the whole Toy is the model's unit) it is; with these it is not.
CASES = [c for c in oracle.CASES if c != "used_by_parent"]
WORLDS = [1, 2, 4]
MODE_WORLDS = {"module,no_coalescing": WORLDS, "linears": [2]}
# At world 4 the cases whose shards differ with 3+ owners (a parameter over several ranks, padding-only
# ranks, tied/frozen/unused parameters); the gather/release of a unit does not depend on the world size,
# so checkpointed, module_called_twice and the optimizer-only cases run per module on 1 and 2 ranks.
WORLD4_CASES = ["plain", "frozen", "unused", "tied", "indivisible", "tiny_group"]
JOBS = [(case, mode, world) for case in CASES for mode in MODES for world in MODE_WORLDS[mode]
        if world < 4 or case in WORLD4_CASES]


def _jobs(rank: int, world: int) -> dict:
    """Every oracle run of this world; at world 2 the GPT's and the attention's too (one launch a world)."""
    out = {(name, mode): oracle.train_engine(rank, world, name, 3, **MODES[mode])
           for name, mode, w in JOBS if w == world}
    if world == 2:
        out["gpt"], out["attention"] = _gpt_jobs(rank, world), _attention_losses(rank, world)
    return out


@functools.cache
def all_ranks(world: int) -> list[dict]:
    return run_ranks(_jobs, world)


def oracle_runs(world: int) -> dict:
    return all_ranks(world)[0]


@functools.cache
def reference(case: str, world: int) -> dict:
    return oracle.train_reference(case, world)


@pytest.mark.parametrize("case,mode,world", JOBS, ids=lambda v: f"world={v}" if isinstance(v, int) else v)
def test_stage3_units_match_single_process_fp32(case, mode, world):
    ours, ref = oracle_runs(world)[(case, mode)], reference(case, world)
    for k in ref["state"]:
        torch.testing.assert_close(ours["state"][k], ref["state"][k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert ours["norms"] == pytest.approx(ref["norms"], rel=1e-5)


# ---- a GPT: blocks against stage 2, and the collectives of a step ----------------------------------
GPT_MODEL = {"n_layer": 4, "n_head": 2, "n_embd": 64, "vocab_size": 256, "block_size": 32}
STEPS, MICRO, SEQ = 3, 2, 16
GPT_RUNS = {"stage2": (2, {}),
            "blocks": (3, {"stage3_prefetch_bucket_size": 0}),  # a bucket per unit, nothing prefetched
            "blocks,prefetch": (3, {"stage3_prefetch_bucket_size": 20_000, "reduce_bucket_size": 10**9}),
            "blocks,coalesced": (3, {}),                       # the defaults: every block in one bucket
            "module": (3, {"stage3_unit": "module", "stage3_prefetch_bucket_size": 0})}


def _gpt(rank: int, world: int, name: str, checkpointing: bool = False, frozen: bool = False) -> dict:
    """frozen: only the layer norms train (a fine-tune of a frozen base): stage 3 shards the rest too."""
    stage, zero = GPT_RUNS[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_MODEL))
    if checkpointing:
        checkpoint_blocks(model, (Block,))
    for n, p in model.named_parameters():
        p.requires_grad_(not frozen or ".ln_" in n)
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}})
    frozen_held, frozen_peak = set(), [0]  # stage 3's frozen buckets gathered at once, at most

    def watch(b, state):
        if b.index >= len(inside(engine).layout.buckets):
            (frozen_held.discard if state == BucketState.RELEASED else frozen_held.add)(b.index)
            frozen_peak[0] = max(frozen_peak[0], len(frozen_held))
    if stage == 3:
        inside(engine).sharded.watch_gathers(watch)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(STEPS + 1):
        if step == 1:  # the first step learns the forward's order; count the ones after it
            inside(engine).comm.traffic.reset()
        tokens = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"losses": losses, "calls": dict(inside(engine).comm.traffic.calls), "frozen_peak": frozen_peak[0],
           "frozen_buckets": len(inside(engine).layout.frozen_buckets)}
    out["state"] = engine.full_state_dict()  # (its gathers are not the steps')
    if stage == 3:
        out["units"] = sum(1 for used in inside(engine).spec.units.uses if used)
        out["buckets"] = len(inside(engine).layout.buckets)  # reduced: the trained ones
        out["planned"] = planned_gathers(inside(engine).spec.units, inside(engine).layout.gathered, inside(engine).sharded.gatherer.last_unit)
    return out


def _gpt_jobs(rank: int, world: int) -> dict:
    out = {name: _gpt(rank, world, name) for name in GPT_RUNS}
    out["blocks,checkpointed"] = _gpt(rank, world, "blocks", checkpointing=True)
    for name, ckpt in FROZEN_GPT_RUNS.items():
        out[name] = _gpt(rank, world, name.split(",")[0], checkpointing=ckpt, frozen=True)
    try:
        lin = nn.Linear(4, 4)
        zerodp.initialize(lin, torch.optim.SGD(lin.parameters(), lr=0.1),
                          {"train_micro_batch_size_per_gpu": 1,
                           "zero_optimization": {"stage": 3, "stage3_unit": ["NoSuchBlock"]}})
        out["bad_name"] = None
    except ConfigError as e:
        out["bad_name"] = str(e)
    out["nothing_partitioned"] = {threshold: _set_up_lines(threshold) for threshold in (None, 0)}
    return out


def _set_up_lines(threshold: int | None) -> str:
    """What rank's stderr says at initialize for a model whose every unit is small (Linear(4, 4): 20
    elements), at the default persistence threshold (None) or a given one."""
    zero = {"stage": 3} if threshold is None else {"stage": 3, "stage3_param_persistence_threshold": threshold}
    lin = nn.Linear(4, 4)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        zerodp.initialize(lin, torch.optim.SGD(lin.parameters(), lr=0.1),
                          {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    return err.getvalue()


FROZEN_GPT_RUNS = {"stage2,frozen": False, "blocks,frozen": False, "blocks,frozen,checkpointed": True}


def gpt_runs() -> list[dict]:
    return [ranks["gpt"] for ranks in all_ranks(2)]


@pytest.mark.parametrize("name", [n for n in GPT_RUNS if n != "stage2"] + ["blocks,checkpointed"])
def test_stage3_blocks_train_a_gpt_as_stage2_does_fp32_world2(name):
    run = gpt_runs()[0]
    ref = run["stage2"]  # (recomputing a block's forward repeats the same arithmetic)
    assert run[name]["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for k, v in ref["state"].items():
        torch.testing.assert_close(run[name]["state"][k], v, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name", ["blocks,frozen", "blocks,frozen,checkpointed"])
def test_stage3_shards_a_frozen_base_and_trains_as_stage2_releasing_each_block_after_its_backward(name):
    """Only the norms train: stage 3 shards the frozen matrices too, and the backward releases each
    block's frozen buckets once it has gone through the block (the gradient of its input), so at most the
    model's own unit, the block kept for the backward and the one running are gathered, not all."""
    run = gpt_runs()[0]
    ref = run["stage2,frozen"]
    assert run[name]["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for k, v in ref["state"].items():
        torch.testing.assert_close(run[name]["state"][k], v, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    # a bucket per block, and the model's own unit's (the embeddings, and what comes after the blocks)
    assert run[name]["frozen_buckets"] >= GPT_MODEL["n_layer"] + 1
    # a step: the planned gathers of trained and frozen buckets, a reduce_scatter per trained bucket, the norm
    gathers, _ = run[name]["planned"]
    assert run[name]["calls"] == {"all_gather": STEPS * gathers, "reduce_scatter": STEPS * run[name]["buckets"],
                                  "all_reduce": STEPS}
    assert run[name]["frozen_peak"] <= run[name]["frozen_buckets"] - GPT_MODEL["n_layer"] + 2, run[name]["frozen_peak"]


@pytest.mark.parametrize("name", [n for n in GPT_RUNS if n != "stage2"])
def test_stage3_step_costs_at_most_three_collectives_per_unit_and_the_norm(name):
    run = gpt_runs()[0][name]
    gathers, _ = run["planned"]
    calls = run["calls"]
    # Per step: the planned gathers, one reduce_scatter per bucket, one all_reduce (norm and flags).
    assert calls == {"all_gather": STEPS * gathers, "reduce_scatter": STEPS * run["buckets"], "all_reduce": STEPS}
    # The model's own unit is two buckets (the embeddings before the blocks, the last norm after them).
    assert sum(calls.values()) <= STEPS * (3 * run["units"] + 3)
    if name.startswith("blocks"):  # 4 blocks and the model's unit, whatever the model's module count
        assert run["units"] == GPT_MODEL["n_layer"] + 1


def test_blocks_take_fewer_collectives_than_modules():
    runs = gpt_runs()[0]
    blocks, module = (sum(runs[n]["calls"].values()) for n in ("blocks", "module"))
    assert 3 * blocks < module, (blocks, module)


def test_stage3_that_would_partition_nothing_says_so_once_on_rank_0_naming_the_threshold():
    said = [ranks["gpt"]["nothing_partitioned"] for ranks in all_ranks(2)]
    line = [x for x in said[0][None].splitlines() if "partitions no parameter" in x]
    assert len(line) == 1, said[0][None]
    assert "stage3_param_persistence_threshold=100000" in line[0] and "lower (0 partitions every unit)" in line[0]
    assert "partitions no parameter" not in said[1][None]  # rank 0 says it for all
    assert "partitions no parameter" not in said[0][0]  # a threshold of 0 partitions the unit: nothing to say


def test_a_unit_name_the_model_lacks_is_an_error_naming_it_on_every_rank():
    for rank in gpt_runs():
        assert "stage3_unit names 'NoSuchBlock'" in rank["bad_name"] and "Linear" in rank["bad_name"]


# ---- which modules are units --------------------------------------------------------------------
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.LayerNorm(4)


class Named(nn.Module):
    """Blocks a Hugging Face model lists in _no_split_modules, outside any ModuleList."""
    _no_split_modules = ("Layer",)

    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = Layer(), Layer(), nn.Linear(4, 2)


def _roots(model: nn.Module, rule) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(r)] for r in find_units(model, rule).roots]


def test_blocks_are_the_repeated_children_and_the_model_is_the_rest():
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    assert _roots(model, "blocks") == ["", "blocks.0", "blocks.1"]
    units = find_units(model, "blocks")
    assert units.of_param[id(model.blocks[1].mlp.c_fc.weight)] == 2
    assert units.of_param[id(model.lm_head.weight)] == units.of_param[id(model.wte.weight)] == units.outer == 0
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    assert _roots(seq, "blocks") == ["", "0", "1", "2"]  # the model itself is the repeated list


def test_no_split_modules_name_blocks_and_rules_choose_roots():
    model = Named()
    assert _roots(model, "blocks") == ["", "first", "second"]
    assert _roots(model, "module") == ["first.a", "first.b", "second.a", "second.b", "head"]
    assert _roots(model, [nn.LayerNorm, "head"]) == ["", "first.b", "second.b", "head"]
    assert _roots(model, lambda m: isinstance(m, nn.Linear)) == ["", "first.a", "second.a", "head"]
    with pytest.raises(ConfigError, match="'Missing', which is neither"):
        find_units(model, ["Missing"])
    with pytest.raises(ConfigError, match="is not a unit rule"):
        find_units(model, [])


# ---- torch's MultiheadAttention reads out_proj's weight without calling out_proj -------------------
class _AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(16), nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks, self.head = nn.ModuleList(_AttentionBlock() for _ in range(2)), nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _attention_losses(rank: int, world: int) -> dict:
    out = {}
    for name, stage, zero in (("stage2", 2, {}), ("blocks", 3, {}), ("module", 3, {"stage3_unit": "module"})):
        torch.manual_seed(0)
        model = _Attention()
        engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}})
        g = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(3):
            loss = engine(torch.randn(2, 5, 16, generator=g))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = losses
    return out


def test_multihead_attention_trains_at_stage3_as_at_stage2_world2():
    run = oracle_runs(2)["attention"]
    for name in ("blocks", "module"):
        assert run[name] == pytest.approx(run["stage2"], rel=1e-6), name
