"""Per-rank memory: DESIGN.md's formula, and the engine's measured bytes as rank 0 of 8 and 64 ranks
(fake process group, one subprocess per world size and stage)."""

from __future__ import annotations

import functools

import pytest
from in_process import children_here

from zerodp.plan import estimate

from zerodp.plan import measure
from zerodp.plan import units

from zerodp.plan import formulas
from zerodp.engine.stepping.reducer import POOL_BUFFERS
from zerodp.plan.models import PlanModel
from zerodp.plan.tables import size

# A GPT of about 3.3 million parameters.
MODEL = dict(n_layer=4, n_head=4, n_embd=256, vocab_size=512, block_size=64)
BUCKET = 2 ** 18  # elements
# Every stage at N = 8; N = 64 at stage 3 only, on the device and offloaded: the stage whose every part
# (working parameters and buckets too) is 1/N, so the formula's scaling in N is checked where it reaches
# most; stages 1 and 2 count the same 1/N shards through the same code (engine/memory.py's report).
WORLD_STAGES = [(8, 1), (8, 2), (8, 3), (64, 3)]
OFFLOAD_WORLD_STAGES = [(8, 2), (8, 3), (64, 3)]
RUNS = ([(world, stage, 1) for world, stage in WORLD_STAGES] + [(8, 2, 2)]
        + [(world, stage, 1, "offload") for world, stage in OFFLOAD_WORLD_STAGES]
        + [(8, 2, 1, "", optimizer) for optimizer in ("Muon", "Adafactor")])


def spec(world: int, stage: int, gas: int, offload: str = "", optimizer: str = "AdamW") -> dict:
    # One sequence of 8 tokens (was 2 of 32: 7.6 -> 3.4 s of CPU for the runs, their bf16 matmuls slow on this
    # CPU): the report counts the engine's model states and buckets, which no batch size changes; the
    # activations' bytes are test_fake_tensor_peak_adds_activations'.
    return {"world": world, "stage": stage, "gas": gas, "model": MODEL, "micro_batch": 1, "seq": 8,
            "dtype": "bf16", "checkpointing": False, "reduce_bucket_size": BUCKET,
            "offload": offload == "offload", "optimizer": optimizer}


@functools.cache
def measured() -> dict:
    # Every run in this process (a fresh fake process group each; in_process.py): the CLI test below runs
    # the measuring subprocess as `--measure real` does, one per run.
    with children_here():
        return dict(zip(RUNS, measure.measure_many([spec(*r) for r in RUNS], timeout=300)))


# ---- formula ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage, expected", [(0, 16_000), (1, 4_000 + 1_200), (2, 2_000 + 1_400), (3, 1_600)])
def test_formula_is_designs_table_in_bf16(stage, expected):
    assert formulas.formula(1000, 10, stage) == expected


def test_formula_in_fp32_has_no_separate_master():
    # 4-byte params and grads; Adam's m and v are the only other states: 16Ψ at stage 0 still.
    assert formulas.formula(1000, 10, 0, dtype="fp32") == 16_000
    assert formulas.formula(1000, 10, 2, dtype="fp32") == 4_000 + 1_200


def test_formula_accumulating_gradients_are_fp32():
    assert formulas.formula(1000, 10, 2, gradient_accumulation_steps=4) == 2_000 + 1_600
    assert formulas.formula(1000, 10, 1, gradient_accumulation_steps=4) == 6_000 + 1_200


def test_formula_rejects_unknown_names():
    with pytest.raises(ValueError, match="optimizer 'lion'"):
        formulas.formula(10, 1, 1, optimizer="lion")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        formulas.formula(10, 1, 1, dtype="int8")


# ---- measured as rank 0 of N --------------------------------------------------------------------
@pytest.mark.parametrize("world,stage", WORLD_STAGES, ids=lambda v: str(v))
def test_model_states_per_rank_match_the_formula_bf16_adam(stage, world):
    r = measured()[(world, stage, 1)]
    psi, rep = r["num_params"], r["report"]
    expected = formulas.formula(psi, world, stage)
    assert rep["model_states"] == pytest.approx(expected, rel=0.05), rep
    assert rep["model_states"] >= expected  # padding only ever adds
    # the reduce bucket pool is beside the model states: at most POOL_BUFFERS bf16 buckets in stage 2;
    # in stage 3 a bucket is whole units, small ones coalesced up to the bucket size: the largest is a block
    bucket = {1: 0, 2: BUCKET, 3: max(BUCKET, max(_padded(u, world) for u in _units()))}[stage]
    assert rep["reduce_buckets"] <= POOL_BUFFERS * bucket * 2
    assert rep["fp32_master"] == pytest.approx(4 * psi / world, rel=0.05)
    assert rep["optimizer_states"] == pytest.approx(8 * psi / world, rel=0.05)


@pytest.mark.parametrize("optimizer", ["Muon", "Adafactor"])
def test_whole_parameter_state_shares_are_reported_beside_one_nth(optimizer):
    """Stepped whole, a rank's share of the states is whole parameters: reported beside 1/N, with the worst
    rank's excess (a 3.3M GPT at N = 8: 16 hidden matrices of 0.07-0.26M and a 0.13M embedding)."""
    rep, adamw = measured()[(8, 2, 1, "", optimizer)]["report"], measured()[(8, 2, 1)]["report"]
    assert rep["state_bytes_this_rank"] == rep["fp32_master"] + rep["optimizer_states"]
    assert 0 < rep["state_bytes_worst_rank_excess"] <= 0.5 * rep["state_bytes_one_nth"]
    # Muon keeps one momentum per hidden matrix (AdamW two moments for the rest); Adafactor row and column factors
    assert rep["optimizer_states"] < (0.8 if optimizer == "Muon" else 0.01) * adamw["optimizer_states"]
    assert "state_bytes_this_rank" not in adamw  # flat shards: every rank holds 1/N exactly


@pytest.mark.parametrize("world", [8, 64], ids=lambda w: f"world={w}")
def test_stage3_holds_a_shard_of_the_working_params_and_only_small_buckets_whole(world):
    r = measured()[(world, 3, 1)]
    psi, rep = r["num_params"], r["report"]
    assert rep["working_params"] == pytest.approx(2 * psi / world, rel=0.05)
    # only units under stage3_param_persistence_threshold (1e5 elements) stay gathered: here none (each
    # block has 0.8M elements; the model's own unit, the embeddings and the last norm, 0.15M)
    small = [u for u in _units() if sum(u) < 100_000]
    assert rep["gathered_params"] == 2 * sum(_padded(u, world) for u in small) == 0


def _units():
    """Each stage-3 unit's parameters (engine/layout/units.py's default: the blocks, the model for the rest)."""
    import torch
    from zerodp.engine.layout.units import find_units
    from zerodp.models.gpt import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL))
    units = find_units(model, "blocks")
    sizes: dict[int, list[int]] = {}
    for p in model.parameters():
        sizes.setdefault(units.of_param[id(p)], []).append(p.numel())
    return list(sizes.values())


def _padded(sizes: list[int], world: int) -> int:
    align = lambda n, k: -(-n // k) * k  # noqa: E731
    end = 0
    for n in sizes:
        end = align(end, 64) + n
    return align(end, 64 * world)


@pytest.mark.parametrize("world,stage", OFFLOAD_WORLD_STAGES, ids=lambda v: str(v))
def test_offload_leaves_only_working_params_and_gradients_on_the_device(stage, world):
    r = measured()[(world, stage, 1, "offload")]
    psi, rep = r["num_params"], r["report"]
    working = 2 * psi if stage == 2 else 2 * psi / world
    assert rep["device_model_states"] == pytest.approx(working + 2 * psi / world, rel=0.05)
    assert rep["device_model_states"] == rep["working_params"] + rep["gradients"] + rep["frozen_params_and_buffers"]
    # master, m, v, grad copy, and the bf16 staging shard the device<->host copies go through
    assert rep["host_model_states"] == pytest.approx(18 * psi / world, rel=0.05)


@pytest.mark.parametrize("world,stage", OFFLOAD_WORLD_STAGES, ids=lambda v: str(v))
def test_placed_splits_device_and_host_memory_as_the_offloading_engine_does(stage, world):
    # estimate's host rows: formulas.placed against what the engine holds where, rank 0 of N
    r = measured()[(world, stage, 1, "offload")]
    rep, split = r["report"], formulas.placed(r["num_params"], world, stage, offload_optimizer=True)
    assert rep["device_model_states"] == pytest.approx(split["device"], rel=0.05)
    assert rep["host_model_states"] == pytest.approx(split["host"], rel=0.05)
    plain = measured()[(world, stage, 1)]["report"]
    assert split["device"] + split["host"] - formulas.formula(r["num_params"], world, stage) == \
        pytest.approx(rep["offload_gradients"] + rep["offload_staging"], rel=0.05)  # the fp32 gradient copy, staging
    assert plain["model_states"] == pytest.approx(formulas.placed(r["num_params"], world, stage)["device"], rel=0.05)


@pytest.mark.parametrize("world,stage", [ws for ws in WORLD_STAGES if ws[1] > 1], ids=lambda v: str(v))
def test_bucket_estimate_bounds_the_reduce_pool_the_engine_held(stage, world):
    r = measured()[(world, stage, 1)]
    largest = PlanModel("gpt", "test", {**PlanModel.parse("tiny").fields, **MODEL}).largest_module()
    estimate_ = formulas.bucket_estimate(r["num_params"], world, stage, "bf16", BUCKET, largest)
    assert r["report"]["reduce_buckets"] <= estimate_ * 1.05  # padding
    assert r["report"]["reduce_buckets"] >= estimate_ / POOL_BUFFERS  # at least one bucket


def test_placed_moves_the_parameter_shard_to_the_host_with_offload_param():
    split = formulas.placed(1000, 10, 3, offload_optimizer=True, offload_param=True)
    # grads 2Ψ/N stay; master, m, v, grad copy, bf16 staging, params
    assert split == {"device": 200, "host": 1600 + 200 + 200}
    assert formulas.placed(1000, 10, 3, "fp32", offload_optimizer=True)["host"] == 1600  # fp32: no staging


def test_placed_counts_the_pinned_blocks_rounding_to_a_power_of_two(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    # bf16: master 4 + gradient 4 + staging 2 bytes per element pinned, 10Ψ/N = 1000 -> 1024
    unpinned = formulas.placed(1000, 10, 2, offload_optimizer=True)
    pinned = formulas.placed(1000, 10, 2, offload_optimizer=True, pin_memory=True)
    assert pinned["host"] - unpinned["host"] == 24 and pinned["device"] == unpinned["device"]
    assert formulas.placed(1000, 10, 2, pin_memory=True) == formulas.placed(1000, 10, 2)  # no offload, no block
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        formulas.placed(1000, 10, 2, offload_param=True)


@pytest.mark.parametrize("world", [8], ids=lambda w: f"world={w}")
def test_stage2_keeps_a_bf16_gradient_shard_and_makes_an_fp32_copy_at_the_step(world):
    r = measured()[(world, 2, 1)]
    psi, rep = r["num_params"], r["report"]
    assert rep["gradients"] == pytest.approx(2 * psi / world, rel=0.05)
    assert rep["step_transient"] == pytest.approx(4 * psi / world, rel=0.05)


def test_stage1_keeps_full_bf16_gradients():
    r = measured()[(8, 1, 1)]
    assert r["report"]["gradients"] == pytest.approx(2 * r["num_params"], rel=0.05)


def test_stage2_accumulates_in_fp32_with_more_than_one_micro_step():
    r = measured()[(8, 2, 2)]
    psi, rep = r["num_params"], r["report"]
    assert rep["gradients"] == pytest.approx(4 * psi / 8, rel=0.05)
    assert rep["step_transient"] == 0  # already fp32: the optimizer uses the shard itself
    assert rep["model_states"] == pytest.approx(formulas.formula(psi, 8, 2, gradient_accumulation_steps=2), rel=0.05)


# ---- the CLI ------------------------------------------------------------------------------------
def test_estimate_prints_formula_and_measured_table(capsys):
    # The command as a user runs it, its measuring child a subprocess (plan/measure.py's __main__, the
    # process's own peak RSS): the one test that keeps it (the others run the child's function here).
    from zerodp.cli import main
    main(["estimate", "--model", "tiny", "--world", "4", "--stage", "2", "--seq", "16", "--measure", "real"])
    out = capsys.readouterr().out
    assert "measured on this machine" in out and "states " in out
    psi = PlanModel.parse("tiny").num_params()
    assert size(formulas.formula(psi, 4, 2)) in out


def test_estimate_fit_answers_a_micro_batch_and_the_largest_of_the_family(capsys):
    estimate.main(["--fit", "80GiB", "--model", "125M", "--world", "8", "--stage", "2"])
    out = capsys.readouterr().out
    assert "largest micro-batch" in out and "largest of the family" in out
    estimate.main(["--fit", "80GiB", "--world", "1", "64", "--stage", "0", "2"])  # the 125M family
    rows = {tuple(line.split()[:2]): line for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["1"], ["64"])}
    # 13B at N=64, stage 2: 2Ψ + 14Ψ/64 ≈ 29 GiB; at N=1, stage 0 16Ψ: 80 GiB holds about 4-5B
    assert float(rows[("64", "2")].split()[3].rstrip("B")) >= 13
    assert 3 <= float(rows[("1", "0")].split()[3].rstrip("B")) <= 5.4


def test_human_picks_a_readable_unit():
    assert units.human(3 * 2 ** 30) == "3.00 GiB"
    assert units.human(1536) == "1.50 KiB"
    assert units.human(12) == "12 B"
    # the same rule at each table's precision: --comm's, the memory table's and its crowded cells'
    assert units.human(1536, ".1f") == "1.5 KiB"
    assert units.human(29.74 * 2 ** 30, ".3g") == "29.7 GiB"
    assert units.human(29.74 * 2 ** 30, ".3g", compact=True) == "29.7G"
    assert units.human(12, ".3g", compact=True) == "12B"


def test_parse_bytes_reads_units():
    assert units.parse_bytes("80GiB") == 80 * 2 ** 30
    assert units.parse_bytes("16GB") == 16 * 10 ** 9
    assert units.parse_bytes("1.5e9") == 1_500_000_000


# ---- peak of a step on fake tensors (zerodp.plan.peak) -----------------------------------------------
# Fake tensors cost the same at any size; this one is small for the run on real tensors beside them.
PEAK_MODEL = dict(n_layer=2, n_head=2, n_embd=128, vocab_size=256, block_size=64)
PEAK_RUNS = {(mode, stage): {"mode": mode, "stage": stage, "world": 8, "model": PEAK_MODEL, "micro_batch": 2,
                             "seq": 32, "dtype": "bf16", "checkpointing": True, "reduce_bucket_size": BUCKET}
             for mode, stage in [("zerodp", 1), ("zerodp", 2), ("zerodp", 3), ("fsdp2", 0), ("plain", 0)]}
PEAK_RUNS[("plain", 0)]["world"] = 1
PEAK_RUNS[("real", 2)] = {**PEAK_RUNS[("zerodp", 2)], "fake": False}  # real CPU tensors, same step


@functools.cache
def peaks() -> dict:
    from zerodp.plan.peak import measure_peaks
    with children_here():  # in this process (in_process.py): test_estimate.py keeps one run of the child
        return dict(zip(PEAK_RUNS, measure_peaks(list(PEAK_RUNS.values()), timeout=300)))


def test_fake_tensors_count_the_same_bytes_as_real_ones():
    fake, real = peaks()[("zerodp", 2)], peaks()[("real", 2)]
    assert fake["peak"] == real["peak"]
    assert fake["at_peak"] == real["at_peak"]
    assert fake["after_step"] == real["after_step"]


@pytest.mark.parametrize("stage", [1, 2, 3], ids=lambda s: f"stage={s}")
def test_fake_tensor_step_holds_designs_model_states_bf16_adamw(stage):
    r = peaks()[("zerodp", stage)]
    psi, held = r["num_params"], r["after_step"]
    n = 8
    close = lambda v, expected: v == pytest.approx(expected, rel=0.03) and v >= expected  # noqa: E731
    assert close(held["params"], {1: 2 * psi, 2: 2 * psi, 3: 2 * psi / n}[stage]), held
    # Gradients are freed by the step (set_to_none), as PyTorch's zero_grad does by default.
    assert held["grads"] == 0, held
    assert close(held["master"], 4 * psi / n), held
    # AdamW's m and v, plus one 4-byte step counter per bucket
    assert close(held["optimizer"], 8 * psi / n), held
    states = sum(held[k] for k in ("params", "master", "optimizer"))
    grads = {1: 2 * psi, 2: 2 * psi / n, 3: 2 * psi / n}[stage]
    assert close(states, formulas.formula(psi, n, stage) - grads)


def test_fake_tensor_peak_adds_activations_and_the_stage2_bucket_pool():
    r = peaks()[("zerodp", 2)]
    psi, at = r["num_params"], r["at_peak"]
    assert r["peak"] == sum(at.values())
    assert r["peak"] > formulas.formula(psi, 8, 2) + at["buckets"]
    assert 0 < at["buckets"] <= POOL_BUFFERS * BUCKET * 2
    assert at["activations"] > 0 and r["peak_at"].startswith(("forward", "backward", "step"))


def test_fsdp2_on_fake_tensors_holds_fp32_shards_and_adamw_states_only():
    r = peaks()[("fsdp2", 0)]
    psi, held, at = r["num_params"], r["after_step"], r["at_peak"]
    # fp32 parameter shards (its master) and AdamW's m and v: 12Ψ/N between steps, padding aside
    assert held["params"] == pytest.approx(4 * psi / 8, rel=0.03)
    assert held["optimizer"] == pytest.approx(8 * psi / 8, rel=0.03)
    # DTensor's sharding propagation (global-shape fake tensors) is not counted: 16Ψ would be
    assert at["optimizer"] == held["optimizer"] and r["peak"] < 6 * psi
    assert at["gathered"] > 0


def test_plain_pytorch_on_fake_tensors_holds_fp32_params_and_adamw_states():
    r = peaks()[("plain", 0)]
    psi, held = r["num_params"], r["after_step"]
    assert held["params"] == pytest.approx(4 * psi, rel=0.01)
    assert held["optimizer"] == pytest.approx(8 * psi, rel=0.01)
    assert held["grads"] == 0  # zero_grad(set_to_none=True)
    assert r["peak"] >= 16 * psi  # fp32 gradients of every parameter exist before the step


def test_estimate_fake_tensors_prints_the_peak_and_its_parts(capsys):
    with children_here():
        estimate.main(["--model", "tiny", "--world", "8", "--stage", "2", "--fsdp2", "--plain", "--seq", "16"])
    out = capsys.readouterr().out
    assert "zerodp 2" in out and "FSDP2 no reshard" in out and "PyTorch AMP" in out and "optim " in out
    psi = PlanModel.parse("tiny").num_params()
    assert size(formulas.formula(psi, 8, 2)) in out
    assert max(len(line) for line in out.splitlines()) <= 100
