"""Faults injected on one rank reach every rank as one clear error; nothing hangs, nothing is lost.

Set-up errors (a config error, a model on 'meta') on one rank only, a checkpoint save that runs out of
disk on one rank only, and the process-group timeout. The failing rank stays alive after its error, as
in a notebook: the other rank must raise anyway, promptly, rather than wait in a collective.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch
import torch.distributed as dist

import zerodp
from oracle import D_IN, D_OUT, Toy, one_group
from spawn import run_ranks

CFG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
PROMPT_S = 5.0  # "promptly": far below the spawned group's 30 s timeout, which is what main waits for


def _initialize_on_every_rank(rank: int, fault: str) -> tuple[str, str, float]:
    """zerodp.initialize with `fault` on rank 1 only; (error class, message, seconds until it raised)."""
    torch.manual_seed(0)
    model, cfg = Toy(), dict(CFG)
    if rank == 1 and fault == "config":
        cfg["zero_optimization"] = {"stge": 2}
    if rank == 1 and fault == "meta":
        model = model.to("meta")
    t0 = time.monotonic()
    try:
        zerodp.initialize(model, one_group(model), cfg)
        result = ("no error", "", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the test records what each rank raised
        result = (type(e).__name__, str(e), time.monotonic() - t0)
    if rank == 1:
        time.sleep(1.0)  # the failing rank stays alive after its error and takes no part in anything
    return result


def _save_runs_out_of_disk_on_rank1(rank: int, world: int, d: str) -> dict:
    """Save at step 1; at step 2 rank 1's file writes fail with ENOSPC; then load what is there."""
    import torch.distributed.checkpoint.filesystem as fs
    torch.manual_seed(0)
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), {**CFG, "optimizer": {"type": "AdamW", "params": {}}})
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        x, y = torch.randn(4, D_IN, generator=g), torch.randn(4, D_OUT, generator=g)
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()

    step()
    engine.save_checkpoint(d)
    saved = {k: v.clone() for k, v in engine.full_state_dict().items()}
    step()
    write_item = fs._write_item
    if rank == 1:
        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fs._write_item = full_disk
    try:
        engine.save_checkpoint(d)
        error = "no error"
    except zerodp.checkpoint.CheckpointError as e:
        error = str(e)
    finally:
        fs._write_item = write_item
    dist.barrier()  # rank 0 has cleaned up before anyone lists the directory
    listing = sorted(os.listdir(d))
    engine.load_checkpoint(d)
    same = all(torch.equal(v, saved[k]) for k, v in engine.full_state_dict().items())
    return {"error": error, "listing": listing, "steps": engine.global_steps, "restored": same}


def _faults(rank: int, world: int, d: str) -> dict:
    zerodp.initialize(Toy(), None, {**CFG, "optimizer": {"type": "AdamW"}})  # warm: imports, connections
    out = {fault: _initialize_on_every_rank(rank, fault) for fault in ("config", "meta")}
    out["enospc"] = _save_runs_out_of_disk_on_rank1(rank, world, d)
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """One pair of spawned ranks runs every fault in turn (one spawn: each costs seconds)."""
    d = str(tmp_path_factory.mktemp("faults") / "ckpt")
    return run_ranks(_faults, 2, d, timeout_s=30)


def test_config_error_on_one_rank_raises_on_every_rank_while_the_failing_rank_stays_alive(faults):
    (kind0, msg0, seconds0), (kind1, msg1, _) = faults[0]["config"], faults[1]["config"]
    assert kind1 == "ConfigError" and "zero_optimization.stge" in msg1  # its own error, unchanged
    assert kind0 == "ConfigError", msg0  # the same class on the rank that had nothing wrong
    assert "failed on rank 1" in msg0 and "zero_optimization.stge" in msg0
    assert seconds0 < PROMPT_S


def test_model_on_meta_on_one_rank_raises_on_every_rank(faults):
    (kind0, msg0, seconds0), (kind1, msg1, _) = faults[0]["meta"], faults[1]["meta"]
    assert kind1 == "ValueError" and "'meta' device" in msg1
    assert kind0 == "ValueError" and "failed on rank 1" in msg0 and "'meta' device" in msg0
    assert seconds0 < PROMPT_S


def test_enospc_on_one_rank_is_the_same_checkpoint_error_everywhere_and_loses_nothing(faults):
    r0, r1 = faults[0]["enospc"], faults[1]["enospc"]
    assert r0["error"] == r1["error"], (r0["error"], r1["error"])
    assert "no space left on device" in r0["error"] and "bytes needed at" in r0["error"]
    assert ".tmp.global_step2" in r0["error"]
    assert r0["listing"] == ["global_step1", "latest"]  # the temp dir is gone, `latest` unchanged
    assert r0["steps"] == r1["steps"] == 1 and r0["restored"] and r1["restored"]


def test_comm_timeout_is_a_strict_positive_number():
    assert zerodp.load_config({}).comm_timeout_s == 600
    assert zerodp.load_config({"comm_timeout_s": 10}).comm_timeout_s == 10
    for bad in ("10", True, 0, -1.5):
        with pytest.raises(zerodp.ConfigError, match="comm_timeout_s"):
            zerodp.load_config({"comm_timeout_s": bad})
