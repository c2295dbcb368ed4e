"""`zerodp train --tp N`: the main job's GPT split by its tensor-parallel plan (zerodp.models.gpt.parallelize),
ZeRO over the data-parallel ranks.

The plan's oracle runs in test_tensor_parallel's one 4-rank launch (tests/tp_train.py): the split GPT gives
the unsplit one's logits, loss and gradients, and zerodp training it over (dp 2, tp 2) ends where one process
training it on the whole batch ends. The job itself runs once, as a user runs it, on 4 ranks it starts.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from test_tensor_parallel import _results
from test_train import TINY, corpus, metrics, train
from tp_train import CLIP
from zerodp.checkpoint.export import write_consolidated
from zerodp.config import load_config
from zerodp.plan.formulas import activation_estimate
from zerodp.models.gpt import GPT, GPTConfig, check_tp, gpt_config
from zerodp.monitor.step import StepMonitor
from zerodp.train.options import parse_options

TOL = 2e-5
FAST = ["--lr", "3e-3", "--warmup", "2"]


def test_gpt_tp_plan_gives_the_unsplit_models_logits_loss_and_gradients():
    for rank, result in enumerate(_results()):
        same = result["gpt"]["same step"]
        assert same["logits"] < 1e-6 and same["loss"] < 1e-6, (rank, same["logits"], same["loss"])
        # The split weights are the model's own whole weights: c_attn's rows keep their q | k | v meaning.
        assert max(same["weights"].values()) == 0, same["weights"]
        worst = max(same["grads"], key=same["grads"].get)
        assert same["grads"][worst] < 1e-6, (rank, worst, same["grads"][worst])
        assert same["placements"]["blocks.0.attn.c_attn.weight"] == "(_StridedShard(dim=0, sf=3),)"
        assert same["placements"]["blocks.1.mlp.c_fc.weight"] == "(Shard(dim=0),)"
        assert "wte.weight" not in same["placements"] and "ln_f.weight" not in same["placements"]  # replicated


def test_gpt_sequence_parallel_plan_gives_the_unsplit_models_logits_loss_and_gradients():
    # --sequence-parallel: the norms on each tp rank's slice of the sequence (their gradients Partial, joined
    # here by full_tensor(), as zerodp's tp sum joins them), the sequence cut before the blocks and gathered
    # for the tied head.
    for rank, result in enumerate(_results()):
        same = result["gpt"]["same step sequence parallel"]
        assert same["logits"] < 1e-6 and same["loss"] < 1e-6, (rank, same["logits"], same["loss"])
        worst = max(same["grads"], key=same["grads"].get)
        assert same["grads"][worst] < 1e-6, (rank, worst, same["grads"][worst])
        assert same["placements"]["blocks.0.ln_1.weight"] == "(Replicate(),)", same["placements"]
        assert same["placements"]["ln_f.weight"] == "(Replicate(),)", same["placements"]


def test_tp_shards_joined_by_their_placement_and_parts_are_the_whole_tensors():
    # c_attn's shards are each rank's slice of q, k and v: joined by flat.join_tp / place_tp_shard with
    # flat.tp_parts (3), they are the model's own q | k | v (a plain concatenation would interleave them),
    # and cut from the whole by checkpoint.whole.its_shard, each rank's own shard.
    for rank, result in enumerate(_results()):
        assert result["gpt"]["same step"]["joined"] == {n: 0.0 for n in result["gpt"]["same step"]["joined"]}, rank


def test_gpt_split_and_built_on_meta_is_refused_on_every_rank():
    for rank, result in enumerate(_results()):
        text = result["gpt"]["on meta"]
        assert "'blocks.0.attn.c_attn.weight' is split part by part over tp" in text, (rank, text)
        assert "build the model with its values" in text, text


@pytest.mark.parametrize("stage", [2, 3])
def test_gpt_split_over_dp2_tp2_trains_as_one_process_on_the_whole_batch(stage):
    for rank, result in enumerate(_results()):
        ref, got = result["gpt"]["reference"], result["gpt"][f"stage {stage}"]
        assert min(ref["norms"]) > CLIP  # clipping binds on every step
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), rank
        assert got["losses"] == pytest.approx(ref["losses"], abs=TOL, rel=TOL), rank
        for name, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, atol=TOL, rtol=TOL, msg=f"rank {rank} {name}")
            # The export joins c_attn's strided shards part by part: q | k | v, not each rank's q, k, v in turn.
            torch.testing.assert_close(got["export"][name], w, atol=TOL, rtol=TOL, msg=f"export {rank} {name}")


def test_tp_job_trains_to_a_falling_loss_and_its_checkpoint_consolidates_and_resumes_without_tp(tmp_path):
    out = tmp_path / "run"
    data = corpus(tmp_path)
    # --sequence-parallel: the norms on sequence slices, their partial gradients summed over tp by zerodp; the
    # resume without tp below checks that it trains exactly.
    # --lr 3e-3 after a 2-step warmup: the validation loss falls by well over 0.3 in 8 steps.
    proc = train(*TINY, *FAST, "--steps", "8", "--eval-every", "4", "--save-every", "4", "--nproc", "4", "--tp", "2",
                 "--sequence-parallel", "--dtype", "fp32", "--data", data, "--out", str(out), timeout=300)
    lines = metrics(out)
    assert [(r["ranks"], r["tp"]) for r in lines if r["kind"] == "run"] == [(4, 2)]
    val = [r["val_loss"] for r in lines if r["kind"] == "eval"]
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [0, 4, 8]
    assert val[-1] < val[0] - 0.3, f"validation loss did not drop: {val}"
    ranks = [r for r in lines if r["kind"] == "memory"][-1]["ranks"]
    assert len(ranks) == 4
    # Each block's activations split over tp (with sequence parallelism the norms' too), the GPT's whole head
    # not: the chart's estimate says so.
    shape = gpt_config("tiny")
    assert ranks[0]["activations_estimate"] == activation_estimate(shape, 4, shape.block_size, "fp32", tp=2,
                                                                   vocab_parallel=False, sequence_parallel=True)
    assert ranks[0]["activations_estimate"] < activation_estimate(shape, 4, shape.block_size, "fp32", tp=2,
                                                                  vocab_parallel=False)
    assert proc.stdout.count("4 rank(s) (2 data-parallel x 2 tensor-parallel), fp32, global batch 8 x 64") == 1
    assert proc.stdout.count("final validation loss") == 1, proc.stdout
    final = torch.load(out / "final.pt", weights_only=True)
    assert final["blocks.0.attn.c_attn.weight"].shape == (3 * 64, 64)  # whole, not one tp rank's shard
    assert final["blocks.0.mlp.c_proj.weight"].shape == (64, 4 * 64)
    # The step-8 checkpoint, joined by `zerodp consolidate` (c_attn part by part), is final.pt.
    write_consolidated(str(out / "checkpoints"), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert whole.keys() == final.keys()
    for name, t in final.items():
        torch.testing.assert_close(whole[name], t, rtol=0, atol=0, msg=name)
    # Steps 5-8 again from the step-4 checkpoint on one rank without tp (each whole tensor joined from the
    # tp shards, --grad-accum 2 keeping the global batch): the same final weights.
    again = tmp_path / "again"
    train(*TINY, *FAST, "--steps", "8", "--eval-every", "0", "--nproc", "1", "--dtype", "fp32", "--data", data,
          "--out", str(again), "--resume-from", str(out / "checkpoints" / "global_step4"), timeout=300)
    resumed = torch.load(again / "final.pt", weights_only=True)
    for name, t in final.items():
        torch.testing.assert_close(resumed[name], t, rtol=0, atol=2e-5, msg=name)


def test_step_lines_come_from_the_worlds_rank_0_not_each_tp_ranks_dp_rank_0(caplog):
    # With tp, tp rank 1 of dp rank 0 is rank 0 of its data-parallel group, and printed every line again.
    caplog.set_level(logging.INFO, logger="zerodp")
    config = load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1})
    dp_rank0_of_tp_rank1 = SimpleNamespace(rank=0, world_size=2, everyone=SimpleNamespace(rank=1))
    monitor = StepMonitor(config, dp_rank0_of_tp_rank1, torch.device("cpu"))
    monitor.after_step(1, torch.tensor(1.0), 1, torch.tensor(2.0), lambda: 1e-3, 1.0, lambda: 0)
    assert [r for r in caplog.records if r.getMessage().startswith("zerodp step")] == []


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3", "--nproc", "4"], "--tp 3 does not divide the 4 rank(s)"),
    (["--tp", "0", "--nproc", "4"], "--tp 0: expected a positive integer"),
    (["--tp", "4", "--nproc", "4", "--model", "tiny"], "n_head=2 and n_embd=64"),
    (["--tp", "2", "--nproc", "4", "--model", "hf-gpt2:tiny"], "only zerodp's own GPT sizes have a tensor-parallel plan"),
    (["--tp", "2", "--nproc", "4", "--stage", "0"], "--stage 0 is not supported with tensor parallelism"),
    (["--sequence-parallel", "--nproc", "2"], "give --tp N with N > 1 too"),
    (["--tp", "2", "--nproc", "4", "--sequence-parallel", "--block-size", "63"], "must be divisible by 2"),
])
def test_bad_tp_fails_before_any_rank_starts(argv, message):
    with pytest.raises(SystemExit) as e:
        parse_options(argv)
    assert message in str(e.value), e.value


def test_gpt_refuses_a_tp_that_does_not_split_its_heads():
    with pytest.raises(ValueError, match="n_head=6 and n_embd=48 must be divisible by it"):
        check_tp(GPTConfig(n_head=6, n_embd=48), 4)
    check_tp(GPTConfig(n_head=6, n_embd=48), 3)


def test_the_unsplit_gpt_is_unchanged_by_the_head_count_read_from_its_output():
    # The same values as nanoGPT's fixed n_head split, for any head count (the heads are counted from
    # c_attn's output, which under tp is this rank's heads only).
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_embd=16))
    attn, x = model.blocks[0].attn, torch.randn(2, 8, 16)
    q, k, v = attn.c_attn(x).split(16, dim=2)
    q, k, v = (t.view(2, 8, 4, 4).transpose(1, 2) for t in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = attn.c_proj(y.transpose(1, 2).reshape(2, 8, 16))
    torch.testing.assert_close(attn(x), expected, rtol=0, atol=0)
