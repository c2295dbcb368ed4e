"""A stage-3 model is saved whole the ways fine-tuning scripts save one: DeepSpeed-Chat's
save_zero_three_model (gathering the parameters that carry DeepSpeed's `ds_*` attributes), its LoRA
merge inside GatheredParameters(..., modifier_rank=0), and plain `torch.save(model.state_dict())` on
every rank; each file equal to the stage-2 run's. A state_dict() called on one rank only raises
instead of hanging or returning empty tensors."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time

import pytest
import torch
from torch import nn

import zerodp
from spawn import run_ranks
from test_deepspeed_scripts import load, port

WORLD = 2
SCRIPT = "ds_chat_lora_save.py"


def _config(stage: int) -> dict:
    # DeepSpeed-Chat's zero section (get_train_ds_config): units under 1e4 elements stay whole
    # (the model's own embedding, norm and head), the blocks are partitioned.
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10,
            "zero_optimization": {"stage": stage, "overlap_comm": True, "stage3_param_persistence_threshold": 1e4,
                                  "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7}}


def _attributes(engine) -> dict:
    """What a stage-3 engine's parameters say through DeepSpeed's attributes, inside and outside gathers."""
    import zerodp.deepspeed as deepspeed
    from zerodp.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    named = dict(engine.module.named_parameters())
    partitioned = [n for n, p in named.items() if hasattr(p, "ds_id")]
    facts = {"partitioned": partitioned, "ids": sorted(named[n].ds_id for n in partitioned),
             "status": {n: named[n].ds_status for n in partitioned},
             "empty": [n for n in partitioned if named[n].numel() == 0]}
    with deepspeed.zero.GatheredParameters(list(named.values())):
        facts["status_inside"] = {n: named[n].ds_status for n in partitioned}
        facts["whole"] = {n: p.detach().clone() for n, p in named.items()}
        engine.eval()
        with torch.no_grad():  # a forward's hooks inside the block leave it gathered
            engine(torch.zeros(1, 4, dtype=torch.long))
        facts["whole_after_forward"] = all(named[n].numel() == named[n].ds_numel for n in partitioned)
    facts["status_after"] = {n: named[n].ds_status for n in partitioned}
    facts["numel_shape"] = {n: (named[n].ds_numel, tuple(named[n].ds_shape)) for n in partitioned}
    facts["shard"] = {n: named[n].ds_tensor.detach().clone() for n in partitioned}
    facts["available"], facts["not_available"] = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE
    return facts


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _state_dicts(rank: int, world: int, stage: int, timeout_s: float) -> dict:
    torch.manual_seed(0)
    model = Stack()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {"train_micro_batch_size_per_gpu": 1, "comm_timeout_s": timeout_s,
                                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    loss = engine(torch.randn(1, 16) + rank).square().sum()
    engine.backward(loss)
    engine.step()
    out = {"every_rank": {k: v.clone() for k, v in model.state_dict().items()},
           "held_as_params": all(p.numel() == 0 for p in model.parameters()) if stage == 3 else None}
    if rank == 0 and stage == 3:
        start = time.monotonic()
        try:
            model.state_dict()
        except RuntimeError as e:
            out["alone"] = (str(e), time.monotonic() - start)
    return out


def _lone_call_found(rank: int, world: int) -> dict:
    """zerodp's own API: rank 0's lone state_dict() raises as soon as rank 1 is in a gathered_parameters
    block, long before comm_timeout_s (120 s); then rank 0 joins that block."""
    torch.manual_seed(0)
    model = Stack()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {"train_micro_batch_size_per_gpu": 1, "comm_timeout_s": 120,
                                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    out = {}
    if rank == 0:
        start = time.monotonic()
        try:
            model.state_dict()
        except RuntimeError as e:
            out["alone"] = (str(e), time.monotonic() - start)
    with engine.gathered_parameters():
        out["whole"] = model.layers[0].weight.shape
    return out


def _step1(tmp: str, script, stage: int) -> tuple[float, list[str]]:
    """DeepSpeed-Chat step 1's end (only_optimize_lora, merge, rank-0-only save_hf_format, at stage 3 the
    every-rank save_zero_three_model): seconds taken, and zerodp's lines on stderr."""
    start, err = time.monotonic(), io.StringIO()
    with contextlib.redirect_stderr(err):
        script.main(["--output_dir", os.path.join(tmp, f"step1_stage{stage}"), "--zero_stage", str(stage),
                     "--only_optimize_lora", "--step1_save",
                     "--deepspeed_config", os.path.join(tmp, f"stage{stage}.json")])
    return time.monotonic() - start, [line for line in err.getvalue().splitlines() if "[zerodp]" in line]


def _run_script(rank: int, world: int, tmp: str) -> dict:
    script = load(os.path.join(tmp, SCRIPT))
    out = {"step1": {stage: _step1(tmp, script, stage) for stage in (2, 3)}, "lone": _lone_call_found(rank, world)}
    for stage in (2, 3):
        engine = script.main(["--output_dir", os.path.join(tmp, f"stage{stage}"), "--zero_stage", str(stage),
                              "--deepspeed_config", os.path.join(tmp, f"stage{stage}.json")])
        out[stage] = _attributes(engine) if stage == 3 else {"partitioned": [n for n, p in
                                                             engine.module.named_parameters() if hasattr(p, "ds_id")]}
    out["plain"] = {stage: _state_dicts(rank, world, stage, 3.0) for stage in (2, 3)}  # zerodp.initialize
    return out


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ds_chat"))
    port(SCRIPT, tmp)
    for stage in (2, 3):
        with open(os.path.join(tmp, f"stage{stage}.json"), "w") as f:
            json.dump(_config(stage), f)
    return tmp, run_ranks(_run_script, WORLD, tmp)


def _files(tmp: str, stage: int) -> tuple[dict, dict]:
    folder = os.path.join(tmp, f"stage{stage}")
    return (torch.load(os.path.join(folder, "with_lora.pt")), torch.load(os.path.join(folder, "pytorch_model.bin")))


def test_deepspeed_chat_save_at_stage_3_writes_the_stage_2_model(script_run):
    tmp, _ = script_run
    for stage2, stage3 in zip(_files(tmp, 2), _files(tmp, 3)):
        if not any("lora" in k for k in stage3):  # save_zero_three_model leaves them out at stage 3 only
            stage2 = {k: v for k, v in stage2.items() if "lora" not in k}
        assert list(stage3) == list(stage2)
        for k, v in stage2.items():
            assert stage3[k].shape == v.shape and v.numel() > 0, k
            torch.testing.assert_close(stage3[k], v, rtol=0, atol=1e-6, msg=k)
    assert os.path.getsize(os.path.join(tmp, "stage3", "pytorch_model.bin")) > 100_000  # not 6 KB of (0,)-tensors


def test_lora_merge_under_modifier_rank_0_is_what_stage_3_saves(script_run):
    tmp, _ = script_run
    lora, merged = _files(tmp, 3)
    scaling = 1 / 4
    for name in ("blocks.0.fc_in", "blocks.1.fc_out"):
        base = lora[f"{name}.weight"]
        update = scaling * lora[f"{name}.lora_left_weight"].t() @ lora[f"{name}.lora_right_weight"].t()
        assert update.abs().max() > 1e-3  # trained: the merge changes the weights
        torch.testing.assert_close(merged[f"{name}.weight"], base + update, rtol=0, atol=1e-6)
    assert not any("lora" in k for k in merged)


def test_stage_3_parameters_carry_deepspeeds_attributes_and_stage_2_ones_none(script_run):
    _, runs = script_run
    for rank, run in enumerate(runs):
        assert run[2]["partitioned"] == []  # DeepSpeed marks only partitioned parameters
        facts = run[3]
        # Every trained parameter is partitioned; outside a gather the blocks' are empty and the model's
        # own (under the persistence threshold, kept whole) are available, as DeepSpeed's persistent ones.
        assert facts["partitioned"] == list(facts["whole"])
        assert len(set(facts["ids"])) == len(facts["ids"])
        released = [n for n in facts["partitioned"] if n.startswith("blocks.")]
        assert facts["empty"] == released and len(released) == 20
        for status in (facts["status"], facts["status_after"]):
            assert {n for n, s in status.items() if s == facts["not_available"]} == set(released)
            assert {n for n, s in status.items() if s != facts["not_available"]} == \
                {n for n in facts["partitioned"] if n not in released} and facts["available"] in status.values()
        assert set(facts["status_inside"].values()) == {facts["available"]} and facts["whole_after_forward"]
        for n, (numel, shape) in facts["numel_shape"].items():
            assert (numel, shape) == (facts["whole"][n].numel(), tuple(facts["whole"][n].shape))
    for n in runs[0][3]["partitioned"]:  # each rank's ds_tensor is its part of the whole
        parts = torch.cat([run[3]["shard"][n] for run in runs])
        assert torch.equal(parts, runs[0][3]["whole"][n].reshape(-1)), n


def test_state_dict_at_stage_3_gathers_on_every_rank_and_refuses_a_call_on_one_rank(script_run):
    runs = [run["plain"] for run in script_run[1]]
    for run in runs:
        whole, sharded = run[2]["every_rank"], run[3]["every_rank"]
        assert list(sharded) == list(whole)
        for k, v in whole.items():
            torch.testing.assert_close(sharded[k], v, rtol=0, atol=1e-6, msg=k)
        assert run[3]["held_as_params"]  # state_dict() left nothing gathered
    message, seconds = runs[0][3]["alone"]
    print(f"state_dict() on rank 0 alone raised after {seconds:.1f} s (comm_timeout_s 3)")
    assert "only 1 of them called it" in message and "comm_timeout_s=3 s" in message
    assert "on every rank" in message and "engine.full_state_dict()" in message
    assert seconds < 30


def test_deepspeed_chat_step1_lora_only_rank0_save_then_zero3_save_exits_in_seconds_with_the_stage2_model(script_run):
    """DeepSpeed-Chat step 1 with only_optimize_lora: the base is frozen, so stage 3 partitions it frozen
    and gives it ds_* attributes (the merge gathers it); rank 0's lone save_hf_format state_dict() gets
    DeepSpeed's placeholders at once; save_zero_three_model then writes the stage-2 run's merged model."""
    tmp, runs = script_run
    stage2, stage3 = (torch.load(os.path.join(tmp, f"step1_stage{s}", "pytorch_model.bin")) for s in (2, 3))
    assert list(stage3) == list(stage2) and not any("lora" in k for k in stage3)
    for k, v in stage2.items():
        assert stage3[k].shape == v.shape and v.numel() > 0, k
        torch.testing.assert_close(stage3[k], v, rtol=0, atol=1e-6, msg=k)
    lora, _ = _files(tmp, 2)  # the every-rank run trains the base too: the step-1 merge must differ from it
    assert (stage2["blocks.0.fc_in.weight"] - lora["blocks.0.fc_in.weight"]).abs().max() > 1e-4
    for rank, run in enumerate(runs):
        seconds, lines = run["step1"][3]
        print(f"DeepSpeed-Chat step 1 at stage 3 took {seconds:.1f} s on rank {rank}")
        assert seconds < 60  # seconds, not comm_timeout_s (600 s)
        if rank == 0:  # one warning line, naming what saves instead
            assert len(lines) == 1 and "placeholders" in lines[0], lines
            assert "save_16bit_model" in lines[0] and "GatheredParameters" in lines[0]
        else:
            assert lines == []


def test_a_lone_state_dict_through_zerodp_raises_as_soon_as_another_rank_gathers(script_run):
    _, runs = script_run
    message, seconds = runs[0]["lone"]["alone"]
    print(f"state_dict() on rank 0 alone raised after {seconds:.1f} s (comm_timeout_s 120)")
    assert "only 1 of them called it" in message and "rank 1 is in a gathered_parameters block instead" in message
    assert seconds < 30 and all(run["lone"]["whole"] == (16, 16) for run in runs)
