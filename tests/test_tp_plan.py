"""`zerodp estimate --tp T`: ZeRO over the data-parallel dimension of a tensor-parallel model, planned by
the formulas of plan/tensor_parallel.py (the seed's 100B and 170B runs: 16-way tp inside a node)."""

from __future__ import annotations

import pytest

from zerodp.plan import estimate
from zerodp.plan.models import PlanModel
from zerodp.plan.tensor_parallel import plan, smallest_fitting_tp, tp_sizes


@pytest.mark.parametrize("size", ["100B", "170B"])
def test_stage2_model_states_per_gpu_are_2psi_plus_14psi_over_dp_all_over_tp(size):
    model = PlanModel.parse(size)
    psi = model.num_params()
    p = plan(psi, model.shape(), world=400, tp=16, stage=2, dtype="bf16")
    assert p.dp == 25
    assert p.model_states == pytest.approx((2 * psi + 14 * psi / 25) / 16, rel=1e-9)
    assert psi == pytest.approx(float(size[:-1]) * 1e9, rel=0.02)  # the paper's sizes


def test_stage3_partitions_everything_and_stage0_is_tensor_parallelism_alone():
    psi = 10**9
    assert plan(psi, None, 64, 8, 3).model_states == pytest.approx(16 * psi / 8 / 8, rel=1e-9)
    assert plan(psi, None, 64, 8, 0).model_states == pytest.approx(16 * psi / 8, rel=1e-9)


def test_tp_traffic_is_four_all_reduces_per_layer_and_stays_in_a_node_up_to_its_size():
    shape = PlanModel.parse("1.3B").shape()
    sbh_bytes = 1024 * 4 * shape.n_embd * 2
    p = plan(10**9, shape, 64, 8, 2, micro_batch=4, seq=1024, gpus_per_node=8)
    assert p.tp_bytes == pytest.approx(4 * shape.n_layer * 2 * 7 / 8 * sbh_bytes)
    assert p.tp_inside_node and not plan(10**9, shape, 64, 16, 2, gpus_per_node=8).tp_inside_node
    checkpointed = plan(10**9, shape, 64, 8, 2, micro_batch=4, seq=1024, checkpointing=True)
    assert checkpointed.tp_bytes == pytest.approx(1.5 * p.tp_bytes)  # the recompute's forward again
    assert plan(10**9, shape, 64, 1, 2).tp_bytes == 0


def test_tensor_parallelism_alone_needs_more_gpus_per_model_than_a_node_holds_for_100b():
    model = PlanModel.parse("100B")
    kw = dict(checkpointing=True)  # without it, no split of its 64 heads fits (the next test)
    fit = smallest_fitting_tp(model.num_params(), model.shape(), 400, 32 * 2**30, **kw)
    assert fit == 64  # across nodes, where ZeRO-2 + tp 16 fits inside one
    assert plan(model.num_params(), model.shape(), 400, 16, 2).total <= 32 * 2**30


def test_tensor_parallel_sizes_divide_the_heads_and_never_exceed_the_world():
    assert tp_sizes(PlanModel.parse("100B").shape(), 400) == [1, 2, 4, 8, 16, 32, 64]
    assert tp_sizes(PlanModel.parse("125M").shape(), 8) == [1, 2, 3, 4, 6]  # 12 heads
    assert tp_sizes(None, 100) == [1, 2, 4, 8, 16, 32, 64]  # a factory: heads unknown, powers of two


def _rows(out: str, worlds=("400", "384")) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.strip().startswith(worlds)]


def test_estimate_prints_the_seeds_100b_setup_beside_tensor_parallelism_alone(capsys):
    estimate.main(["--model", "100B", "--tp", "16", "--world", "400", "--stage", "2"])
    out = capsys.readouterr().out
    assert "100B (125 layers x 8192 wide) with tensor parallelism" in out and "16 GPUs per node" in out
    rows = _rows(out)
    assert [r[1:3] + r[3:6] for r in rows][0] == ["zerodp", "2", "25", "x", "16"]
    assert any(r[1:3] == ["tp", "alone"] and r[3:6] == ["25", "x", "16"] for r in rows)
    assert rows[0][-6:-3] == ["yes", "14.6G", "NVLink"]  # ZeRO-2 + tp 16 fits a 32 GiB V100, tp inside a node
    # tp alone at the largest split of the 64 heads (never 128 or 256), on the 384 GPUs that 64 divides, said so
    assert rows[-1][:6] == ["384", "tp", "alone", "6", "x", "64"] and rows[-1][-6] == "no" and rows[-1][-4] == "IB"
    assert rows[-1][8] == "33.7G"  # docs/DESIGN.md quotes it
    text = " ".join(out.split())
    assert "fits 32.00 GiB at no T that divides its 64 attention heads; the largest, T = 64, is shown" in text
    assert "N = 384: 400 GPUs are not a multiple of T = 64; tensor parallelism alone runs on 384 of them" in text


def test_estimate_plans_tensor_parallelism_alone_on_the_world_asked_when_t_divides_it(capsys):
    estimate.main(["--model", "100B", "--tp", "16", "--world", "512", "--stage", "2", "--checkpointing"])
    out = capsys.readouterr().out
    assert _rows(out, ("512",))[-1][:6] == ["512", "tp", "alone", "8", "x", "64"]
    assert "not a multiple" not in out


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3", "--world", "400"], "--tp 3 must divide every --world (not 400)"),
    (["--tp", "2", "--world", "8", "--measure", "fake"], "measures zerodp's step on a model without tensor"),
    (["--tp", "8", "--world", "64"], "--tp 8 does not divide the model's 12 attention heads"),
    (["--tp", "2", "--world", "8", "--fit", "80GiB"], "--fit is not planned with --tp"),
    (["--tp", "0"], "--tp must be at least 1"),
])
def test_bad_tp_flags_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        estimate.main(["--model", "125M", *argv])
    assert message in capsys.readouterr().err


def test_help_names_every_gpt_size_and_no_stale_tp_claim():
    text = " ".join(estimate.build_parser().format_help().split())
    assert "100B" in text and "170B" in text and "does not train" not in text
    import zerodp.plan.tensor_parallel as tp_module
    assert "does not yet train" not in tp_module.__doc__ and "does not train" not in tp_module.__doc__
