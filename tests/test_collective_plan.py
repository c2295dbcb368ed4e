"""distributed/plan.py: the collective plan (which implementation each sharding collective runs, chosen by a
probe on gloo), and, on two gloo ranks, that both implementations give the same values and every rank runs
the same one."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import zerodp
from spawn import run_ranks
from zerodp.config import ConfigError, load_config
from zerodp.distributed import plan
from zerodp.distributed.comm import Comm
from zerodp.engine.engine import inside
from zerodp.models.gpt import GPT, gpt_config


def _times(fast: dict[tuple[str, int], str]) -> dict[tuple[str, int, str], float]:
    """Planted probe results: at each (op, numel), `fast` is the implementation that took 1 ms, the other 3."""
    return {(op, n, impl): 0.001 if impl == winner else 0.003
            for (op, n), winner in fast.items() for impl in plan.IMPLEMENTATIONS}


def test_a_planted_probe_result_picks_the_planted_winner_at_each_size():
    chosen = plan.pick("gloo", _times({("reduce_scatter", 1024): "native", ("reduce_scatter", 1 << 20): "all_reduce",
                                       ("all_gather", 1024): "all_reduce", ("all_gather", 1 << 20): "native"}))
    assert chosen.implementation("reduce_scatter", 1000) == "native"
    assert chosen.implementation("reduce_scatter", 4 << 20) == "all_reduce"  # past the largest probed size
    assert chosen.implementation("all_gather", 512) == "all_reduce"
    assert chosen.implementation("all_gather", 300_000) == "native"  # nearer 1M than 1K on a log scale
    assert chosen.describe() == ("collectives on gloo: reduce-scatter by size (1K: native, 1M: all_reduce), "
                                 "all-gather by size (1K: all_reduce, 1M: native) (measured at set-up)")


def test_a_tie_keeps_the_native_op():
    times = {("all_gather", 64, impl): 0.002 for impl in plan.IMPLEMENTATIONS}
    assert plan.pick("gloo", times).implementation("all_gather", 64) == "native"


def test_nccl_keeps_its_own_ops_without_a_probe():
    chosen = plan.without_probe("nccl", "auto", 8, False, 1 << 20)
    assert chosen is not None  # no probe
    assert {chosen.implementation(op, 1 << 20) for op in plan.OPS} == {"native"}
    assert "nccl's own ops" in chosen.describe()
    assert plan.without_probe("gloo", "auto", 2, False, 1 << 20) is None  # gloo measures


def test_nothing_to_choose_is_not_said():
    for args in (("gloo", "auto", 1, False, 100), ("fake", "auto", 4, True, 100), ("gloo", "auto", 2, False, 0)):
        chosen = plan.without_probe(*args)
        assert chosen.describe() == "" and chosen.implementation("reduce_scatter", 100) == "native"


@pytest.mark.parametrize("implementation", plan.IMPLEMENTATIONS)
def test_a_forced_choice_is_honoured_at_every_size_and_on_every_backend(implementation):
    for backend in ("gloo", "nccl"):
        chosen = plan.without_probe(backend, implementation, 2, False, 100)
        assert {chosen.implementation(op, n) for op in plan.OPS for n in (1, 1000, 1 << 30)} == {implementation}


def test_a_value_zerodp_cannot_honour_is_refused():
    with pytest.raises(ConfigError, match="'collectives' = \"ring\": expected 'auto', 'native' or 'all_reduce'"):
        load_config({"collectives": "ring"})
    with pytest.raises(ValueError, match="collectives='ring': expected one of auto, native, all_reduce"):
        plan.forced("gloo", "ring")


def test_the_whole_bucket_a_reduction_as_all_reduce_holds_is_stated():
    chosen = plan.forced("gloo", "all_reduce")
    assert chosen.whole_bucket_bytes([1000, 4000], 2, 4) == 3000 * 2  # the largest bucket, less its own shard
    assert plan.forced("gloo", "native").whole_bucket_bytes([1000, 4000], 2, 4) == 0


# ---- two gloo ranks ---------------------------------------------------------------------------------------
def _collectives(comm: Comm, rank: int, dtype: torch.dtype) -> dict:
    """Each implementation's reduce-scatter and all-gather of rank-dependent values, sync and async, into a
    separate output and in place."""
    out = {}
    for impl in plan.IMPLEMENTATIONS:
        comm.plan = plan.forced("gloo", impl)
        g = torch.Generator().manual_seed(rank)
        for async_op in (False, True):
            for in_place in (False, True):
                bucket = torch.randn(2 * 7, generator=g).to(dtype)
                shard = bucket.view(2, -1)[rank] if in_place else torch.empty(7, dtype=dtype)
                work = comm.reduce_scatter(shard, bucket, async_op=async_op)
                if work is not None:
                    work.wait()
                gathered = torch.full((14,), float("nan"), dtype=dtype)  # every element must be written
                source = torch.randn(7, generator=g).to(dtype)
                if in_place:
                    gathered.view(2, -1)[rank].copy_(source)
                    source = gathered.view(2, -1)[rank]
                work = comm.all_gather(gathered, source, async_op=async_op)
                if work is not None:
                    work.wait()
                out[impl, str(dtype), async_op, in_place] = (shard.clone(), gathered)
    return out


def _engine_run(rank: int, choice: str, stage: int) -> tuple[torch.Tensor, str, dict]:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "collectives": choice,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    inside(engine).comm.traffic.reset()
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        tokens = torch.randint(0, 256, (2, 17), generator=g)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    return (torch.cat([p.detach().flatten().clone() for p in model.parameters()]), inside(engine).comm.plan.describe(),
            dict(inside(engine).comm.traffic.bytes))


def _agreement(rank: int) -> tuple:
    """Each rank's probe planted with opposite winners: the plan is rank 0's on both."""
    comm = Comm()
    sizes = (2 * 64,)
    winner = "all_reduce" if rank == 0 else "native"
    plan._PROBED[("gloo", (0, 1), sizes)] = _times({(op, sizes[0]): winner for op in plan.OPS})
    chosen = comm.choose_collectives("auto", 2 * 64)  # a model smaller than PROBE_SIZES: probed at its size
    return chosen, comm.shard.plan is chosen


def _raw_words(comm: Comm, rank: int) -> dict:
    """Each implementation's all-gather of words that are not numbers: bf16 storage of packed bytes (NaN payloads,
    -0.0, subnormals: every 16-bit pattern), and fp32 alike; what arrives, as its bits."""
    out = {}
    for impl in plan.IMPLEMENTATIONS:
        comm.plan = plan.forced("gloo", impl)
        for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
            words = _words(rank, bits).view(dtype)
            gathered = torch.empty(2 * words.numel(), dtype=dtype)
            comm.all_gather(gathered, words)
            out[impl, str(dtype)] = gathered.view(bits)
    return out


def _words(rank: int, bits: torch.dtype) -> torch.Tensor:
    info = torch.iinfo(bits)
    g = torch.Generator().manual_seed(10 + rank)
    words = torch.randint(info.min, info.max, (256,), generator=g, dtype=torch.int64).to(bits)
    words[:2] = torch.tensor([info.min, -1], dtype=bits)  # -0.0 and an all-ones NaN
    return words


class _Clock:
    """A clock under which the j-th run probe times takes 100 - j seconds: later runs are faster."""

    def __init__(self):
        self.now, self.runs, self.started = 0.0, 0, False

    def __call__(self) -> float:
        if self.started:
            self.now += 100 - self.runs
            self.runs += 1
        self.started = not self.started
        return self.now


def _probed(comm: Comm) -> dict:
    return plan.probe(comm.group, (2 * 64,), repeats=5, clock=_Clock())


def _two_ranks(rank: int, world: int) -> dict:
    comm = Comm()
    out = {"collectives": {**_collectives(comm, rank, torch.float32), **_collectives(comm, rank, torch.bfloat16)},
           "raw": _raw_words(comm, rank), "agreed": _agreement(rank), "probed": _probed(comm)}
    out["engines"] = {(choice, stage): _engine_run(rank, choice, stage)
                      for stage in (2, 3) for choice in ("native", "all_reduce", "auto")}
    return out


@functools.cache
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2)


def test_both_implementations_give_the_same_values_on_two_ranks():
    for rank, result in enumerate(two_ranks()):
        got = result["collectives"]
        for (impl, dtype, async_op, in_place), (shard, gathered) in got.items():
            native_shard, native_gathered = got["native", dtype, async_op, in_place]
            assert not gathered.isnan().any(), (rank, impl, dtype, async_op, in_place)
            assert torch.equal(shard, native_shard) and torch.equal(gathered, native_gathered), \
                (rank, impl, dtype, async_op, in_place)
    # and they are the sum and the concatenation: each rank's first draws, as _collectives made them
    draws = [(torch.randn(14, generator=g), torch.randn(7, generator=g))
             for g in (torch.Generator().manual_seed(r) for r in range(2))]
    total, sources = draws[0][0] + draws[1][0], torch.cat([draws[0][1], draws[1][1]])
    for rank, result in enumerate(two_ranks()):
        shard, gathered = result["collectives"]["all_reduce", "torch.float32", False, False]
        assert torch.equal(shard, total.view(2, -1)[rank]) and torch.equal(gathered, sources)


def test_the_all_gather_as_all_reduce_carries_every_bit_of_words_that_are_not_numbers():
    """Packed 4-bit words stored as bf16 read as NaNs, -0.0 and subnormals: a float sum would rewrite them."""
    for result in two_ranks():
        for (impl, dtype), got in result["raw"].items():
            bits = torch.int16 if dtype == "torch.bfloat16" else torch.int32
            assert torch.equal(got, torch.cat([_words(0, bits), _words(1, bits)])), (impl, dtype)


def test_the_probe_takes_turns_round_by_round_and_keeps_each_implementations_fastest_run():
    """4 implementations x 6 rounds, run j taking 100 - j s: taking turns, each one's fastest is its run in the
    last round, 100 - (5 x 4 + its place); one after another (A A B B) or a median would give other times."""
    order = [(op, 128, impl) for op in plan.OPS for impl in plan.IMPLEMENTATIONS]
    for result in two_ranks():
        assert result["probed"] == {key: 100 - (5 * 4 + k) for k, key in enumerate(order)}


def test_every_rank_runs_rank_0s_choice():
    plans = [r["agreed"] for r in two_ranks()]
    assert plans[0] == plans[1] and all(shared for _, shared in plans)
    assert {plans[1][0].implementation(op, 128) for op in plan.OPS} == {"all_reduce"}  # rank 0's winner


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_trains_to_the_same_weights_with_either_implementation(stage):
    for rank, result in enumerate(two_ranks()):
        runs = result["engines"]
        native, _, native_bytes = runs["native", stage]
        for choice in ("all_reduce", "auto"):
            weights, _, _ = runs[choice, stage]
            assert torch.equal(weights, native), (rank, choice, stage)
        forced_bytes = runs["all_reduce", stage][2]  # the same collectives, each moving an all-reduce's bytes
        for op in plan.OPS:
            assert forced_bytes[op] == 2 * native_bytes[op] > 0, (op, forced_bytes, native_bytes)
        assert "reduce-scatter all_reduce, all-gather all_reduce (forced" in runs["all_reduce", stage][1]
        assert runs["auto", stage][1] == two_ranks()[0]["engines"]["auto", stage][1]  # every rank the same plan
        assert "(measured at set-up)" in runs["auto", stage][1]


def test_the_set_up_line_says_the_plan_and_says_nothing_when_there_was_nothing_to_choose():
    from zerodp.engine.summary import set_up_line
    config = load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    said = plan.forced("gloo", "all_reduce").describe()
    assert set_up_line(config, 2, 2, collectives=said).endswith(
        "= 4; collectives on gloo: reduce-scatter all_reduce, all-gather all_reduce (forced by the config key "
        "'collectives')")
    silent = plan.without_probe("gloo", "auto", 1, False, 100).describe()
    assert set_up_line(config, 1, 1, collectives=silent).endswith("x 1 ranks = 2")
