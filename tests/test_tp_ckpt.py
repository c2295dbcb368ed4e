"""Checkpoints of a tensor-parallel x data-parallel job (issue 26): saved at (dp 2, tp 2) in
test_tensor_parallel's 4-rank launch (tp_ckpt.saves), resumed at (dp 1, tp 2) with gradient accumulation 2
in one 2-rank launch (tp_ckpt.resumes) to the same weights as the uninterrupted one-process run, and
consolidated offline into the whole tensors under the model's names."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from safetensors.torch import load_file
from spawn import run_ranks
from test_tensor_parallel import TOL, _results, build
from tp_ckpt import SAVE_AT, reference_upto, resumes

from zerodp.checkpoint import CheckpointError, consolidate, resolve
from zerodp.checkpoint import main as consolidate_main
from zerodp.checkpoint.weights import open_weights


def _root() -> str:
    """Where the 4-rank launch saved (removed when the tests end: test_tensor_parallel._results)."""
    return _results()[0]["tp ckpt"]["dir"]


@functools.lru_cache(maxsize=1)
def _resumed() -> list[dict]:
    return run_ranks(resumes, 2, _root(), timeout_s=120)


@functools.lru_cache(maxsize=1)
def _at_save() -> dict[str, torch.Tensor]:
    """The one-process run's whole weights when the checkpoints were saved."""
    return reference_upto(SAVE_AT)


def _assert_weights(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=TOL, rtol=TOL, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("run", ["dtensor2", "dtensor3", "mpu"])
def test_tp_checkpoint_resumes_on_another_dp_size_with_accumulation_to_the_uninterrupted_weights(run):
    # Saved at (dp 2, tp 2) after SAVE_AT steps, resumed at (dp 1, tp 2) with gradient accumulation 2.
    ref = _results()[0]["reference"]["weights"]
    for rank, result in enumerate(_resumed()):
        _assert_weights(result[run], ref, f"{run} resumed, rank {rank}")


@pytest.mark.parametrize("run", ["dtensor2", "dtensor3", "mpu"])
def test_consolidate_joins_the_tp_shards_under_the_models_names(run):
    state, ties = consolidate(os.path.join(_root(), run))
    assert ties == {}
    _assert_weights(state, _at_save(), f"consolidated {run}")


def test_consolidate_command_writes_the_joined_tensors(tmp_path):
    out = str(tmp_path / "whole.safetensors")
    consolidate_main([os.path.join(_root(), "dtensor2"), out])
    _assert_weights(load_file(out), _at_save(), "zerodp consolidate")


def test_consolidate_refuses_mpu_shards_whose_axis_was_not_recorded():
    with pytest.raises(CheckpointError, match="partition_dim") as e:
        consolidate(os.path.join(_root(), "mpu_no_dim"))
    assert "'blocks.0.fc2.weight'" in str(e.value) or "tensor-parallel shard" in str(e.value)


def test_only_the_worlds_rank_0_prepares_and_writes_the_manifest():
    # Each data-parallel group has a rank 0 (world ranks 0 and 2): both renaming one directory is a race.
    for rank, result in enumerate(_results()):
        writes = result["tp ckpt"]["writes"]
        assert writes == ({"prepare": 2, "finish": 2} if rank == 0 else {"prepare": 0, "finish": 0}), (rank, writes)


def test_a_save_failing_on_one_tp_rank_raises_on_every_rank_and_writes_nothing():
    for rank, result in enumerate(_results()):
        text = result["tp ckpt"]["one rank fails"]
        assert text.startswith("CheckpointError") and "client_state must be JSON-serialisable" in text, (rank, text)
        assert rank == 3 or "on rank 3" in text, (rank, text)
        assert result["tp ckpt"]["failed dir"] == [], rank


@pytest.mark.parametrize("run", ["tp 2 into tp 1", "tp 1 into tp 2"])
def test_a_checkpoint_resumes_on_another_tp_size_to_the_uninterrupted_weights(run):
    # (dp 2, tp 2) -> (dp 2) without tp -> saved there -> (dp 1, tp 2): the shards joined and cut again.
    ref = _results()[0]["reference"]["weights"]
    for rank, result in enumerate(_resumed()):
        _assert_weights(result[run], ref, f"{run}, rank {rank}")


def test_a_frozen_tp_shard_is_saved_per_tp_rank_and_loads_at_its_tp_size_and_without_tp():
    for rank, result in enumerate(_resumed()):
        assert result["frozen shard"] == {"tp 2": True, "tp 1": True}, (rank, result["frozen shard"])


def test_resuming_on_another_tp_size_needs_each_shards_axis_and_deepspeed_checkpoints_need_no_tp():
    for rank, result in enumerate(_resumed()):
        text = result["no axis into tp 1"]
        assert text.startswith("CheckpointError") and "saved with tp 2 and this job runs with tp 1" in text, text
        assert "partition_dim" in text, text
        text = result["deepspeed into tp"]
        assert text.startswith("CheckpointError") and "is a DeepSpeed checkpoint" in text and "tp 2" in text, text


def test_weights_from_a_tp_checkpoint_are_refused_naming_consolidate():
    with pytest.raises(ValueError, match=r"tensor parallelism \(tp 2\).*zerodp consolidate"):
        open_weights(os.path.join(_root(), "dtensor2"), build())


def test_manifest_records_the_tp_size_and_each_shards_axis_and_shapes():
    path, meta = resolve(os.path.join(_root(), "dtensor2"))
    model = {e["name"]: e for e in meta["model"]}
    assert meta["tp"] == 2 and meta["world_size"] == 2
    assert model["blocks.0.fc1.weight"]["tp"] == {"dim": 0, "shapes": [[16, 16], [16, 16]]}
    assert model["blocks.0.fc2.weight"]["tp"] == {"dim": 1, "shapes": [[16, 16], [16, 16]]}
    assert model["blocks.0.fc2.weight"]["shape"] == [16, 32]
    assert "tp" not in model["blocks.0.fc2.bias"] and "tp" not in model["head.weight"]  # held alike: once
    path, meta = resolve(os.path.join(_root(), "mpu"))
    model = {e["name"]: e for e in meta["model"]}
    assert model["blocks.0.attn.o.weight"]["tp"]["dim"] == 1 and model["blocks.0.attn.o.weight"]["shape"] == [16, 16]
