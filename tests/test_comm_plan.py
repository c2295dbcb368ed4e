"""comm_plan.py: the bytes, links and step time `zerodp estimate --comm` prints. The byte counts are
checked against gloo runs in test_comm_volume.py; here, the links, the time model and the command."""

from __future__ import annotations

import pytest

from zerodp.plan import communication as comm_plan

from zerodp.plan import estimate
from zerodp.plan.communication import Job, Links, step_time, transfers

PSI = 1_000_000_000


def by_key(job: Job) -> dict:
    return {(x.group, x.op): x for x in transfers(job)}


def test_flat_stage2_sends_2psi_bytes_over_infiniband_when_the_world_spans_nodes():
    xs = by_key(Job(PSI, 64, 2))
    assert xs[("world", "reduce_scatter")].bytes == xs[("world", "all_gather")].bytes == pytest.approx(2 * PSI * 63 / 64)
    assert {x.link for x in xs.values()} == {"inter"}


def test_shard_groups_of_one_node_keep_the_gathers_inside_it_and_send_a_shard_across():
    xs = by_key(Job(PSI, 64, 2, shard_size=8))
    assert xs[("shard", "reduce_scatter")].link == xs[("shard", "all_gather")].link == "intra"
    assert xs[("replica", "all_reduce")].link == "inter"
    assert xs[("replica", "all_reduce")].bytes == pytest.approx(2 * (2 * PSI / 8) * 7 / 8)
    assert xs[("shard", "all_gather")].bytes == pytest.approx(2 * PSI * 7 / 8)


def test_a_shard_group_larger_than_a_node_is_inter_node():
    assert by_key(Job(PSI, 64, 2, shard_size=16))[("shard", "reduce_scatter")].link == "inter"


def test_within_one_node_everything_is_intra_node():
    assert {x.link for x in transfers(Job(PSI, 8, 3))} == {"intra"}


def test_stage1_and_stage0_reduce_fp32_gradients_when_they_accumulate():
    one = by_key(Job(PSI, 8, 1, gas=4))[("world", "reduce_scatter")]
    two = by_key(Job(PSI, 8, 2, gas=4))[("world", "reduce_scatter")]
    assert one.bytes == pytest.approx(4 * PSI * 7 / 8) and one.calls == 1
    assert two.bytes == pytest.approx(4 * 2 * PSI * 7 / 8) and two.calls == 4  # every micro-step


def test_shard_size_must_divide_the_world():
    with pytest.raises(ValueError, match="divide"):
        transfers(Job(PSI, 64, 2, shard_size=7))


def test_time_is_latency_per_hop_plus_bytes_over_bandwidth():
    x = by_key(Job(PSI, 16, 2, buckets=10))[("world", "all_gather")]
    links = Links(inter_gbs=10, inter_us=5)
    assert x.seconds(links) == pytest.approx(10 * 15 * 5e-6 + 2 * PSI * 15 / 16 / 10e9)


def test_stage2_exposes_its_parameter_gather_and_hides_the_reduction_behind_backward():
    job = Job(PSI, 64, 2, shard_size=8)
    t = step_time(job, compute_s=10.0)
    assert t.exposed == pytest.approx(t.gather) and t.hidden
    assert step_time(job, compute_s=0.01).exposed == pytest.approx(t.reduce + t.gather - 2 / 3 * 0.01)


def test_estimate_prints_bytes_by_collective_and_link_and_the_step_time(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    estimate.main(["--model", "tiny", "--no-measure", "--world", "16", "--stage", "2", "--comm",
                   "--shard-size", "0", "8", "--gpus-per-node", "8", "--compute-s", "0.5"])
    out = capsys.readouterr().out
    assert "Bytes each rank sends per step" in out and "Step time: compute 500.0 ms" in out
    assert "replica" in out and "inter" in out and "intra" in out
    assert comm_plan.Links().intra_gbs > comm_plan.Links().inter_gbs


def test_stage3_plan_gathers_frozen_parameters_and_reduces_the_trained_ones_alone():
    """As the engine lays them out (layout.Layout.frozen): frozen weights are gathered, never reduced."""
    import torch
    from torch import nn

    from zerodp.plan.communication import jobs_for
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    for layer in model:
        layer.weight.requires_grad_(False)
    job = jobs_for(model, 2, 3, 2, 2, 50_000_000, 1, 8, persistence=0)
    assert (job.buckets, job.numel) == (1, 256)  # the biases, one bucket padded to 2 x 64 x 2
    # the frozen weights' bucket and the biases', each once: the last unit's stay gathered into the backward
    assert job.gathered == (2, 3 * 64 * 64 + 256)
    assert torch.is_grad_enabled()
