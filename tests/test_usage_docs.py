"""The documentation's code runs as written: every ```python block of docs/USAGE.md on 2 gloo ranks, as
`torchrun --nproc-per-node 2 train.py` runs it."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

from spawn import run_ranks

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(name: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / name).read_text(), flags=re.S | re.M)


def _run_usage(rank: int, world: int, workdir: str) -> str:
    os.chdir(workdir)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in python_blocks("USAGE.md"):
            exec(compile(block, "docs/USAGE.md", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_usage_script_runs_as_written_on_two_ranks(tmp_path):
    assert python_blocks("USAGE.md"), "docs/USAGE.md has no python block"
    outputs = run_ranks(_run_usage, 2, str(tmp_path))
    assert outputs[1] == ""  # only rank 0 prints
    assert re.findall(r"epoch (\d): loss [\d.]+, (\d+) steps on 2 rank\(s\)", outputs[0]) == [("0", "32"), ("1", "64")]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step64"
