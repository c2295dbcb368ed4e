"""ZeRO-Offload on a tensor-parallel model (issue 26): the runs join tests/test_tensor_parallel.py's one
4-rank launch (tests/tp_offload.py), whose oracle (test_tp_x_dp_matches_one_process_on_the_whole_batch,
parametrized over tp_offload.RUNS) checks losses, norms and whole weights against one process."""

from __future__ import annotations

import pytest

from test_tensor_parallel import _results
from tp_offload import RUNS


@pytest.mark.parametrize("run", RUNS)
def test_tp_offload_runs_really_offload(run):
    # (optimizer steps on the host, parameter shards in host memory): the oracle's equality means nothing
    # about offload if the config did not reach the engine.
    want = (True, "stage 3" in run)
    for rank, result in enumerate(_results()):
        assert result[run]["offloaded"] == want, (run, rank, result[run]["offloaded"])
