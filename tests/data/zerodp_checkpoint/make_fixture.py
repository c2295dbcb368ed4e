"""Writes the checkpoint that test_checkpoint.py's test_reads_a_checkpoint_saved_before reads: the toy
model of test_checkpoint.py on 2 ranks, stage 2, bf16, saved after 2 steps as tag `step2`, with every
rank's full fp32 weights then and one step later (expected.pt).

Made with zerodp at commit fa94421 (before the bucket layout became engine/layout.py), from the
repository root:
  PYTHONPATH=<that checkout>/src:tests python tests/data/zerodp_checkpoint/make_fixture.py
Run it again only to replace the fixture on purpose: the test's point is that checkpoints saved by
older code still load the same.
"""

from __future__ import annotations

import os
import shutil

import torch

from spawn import run_ranks
from test_checkpoint import SAVE_AT, make_engine, train

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD, STAGE, DTYPE, TAG = 2, 2, "bf16", "step2"


def _save(rank: int, world: int, out: str) -> dict:
    engine = make_engine(world, STAGE, DTYPE)
    train(engine, rank, world, range(SAVE_AT))
    engine.save_checkpoint(out, TAG)
    saved = engine.full_state_dict()
    train(engine, rank, world, range(SAVE_AT, SAVE_AT + 1))
    return {"saved": saved, "after": engine.full_state_dict()}


if __name__ == "__main__":
    out = os.path.join(HERE, "ckpt")
    shutil.rmtree(out, ignore_errors=True)
    first, _ = run_ranks(_save, WORLD, out)
    torch.save(first, os.path.join(HERE, "expected.pt"))
