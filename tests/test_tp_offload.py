"""ZeRO-Offload and the large-model set-up (a model on `meta`, weights= a file of the whole model) on a
tensor-parallel model (issue 26). The runs join tests/test_tensor_parallel.py's one 4-rank launch
(tests/tp_offload.py), whose oracle (test_tp_x_dp_matches_one_process_on_the_whole_batch and the norm
test, parametrized over tp_offload.RUNS) checks losses, norms and whole weights against one process
training the model built with its values."""

from __future__ import annotations

import math

import pytest
import torch

from test_tensor_parallel import _results
from tp_offload import RUNS


@pytest.mark.parametrize("run", [r for r in RUNS if "offload" in r])
def test_tp_offload_runs_really_offload(run):
    # (optimizer steps on the host, parameter shards in host memory): the oracle's equality means nothing
    # about offload if the config did not reach the engine.
    want = (True, "stage 3" in run)
    for rank, result in enumerate(_results()):
        assert result[run]["offloaded"] == want, (run, rank, result[run]["offloaded"])


@pytest.mark.parametrize("run", [r for r in RUNS if "weights" in r])
def test_tp_weights_reads_only_each_ranks_local_shard(run):
    for rank, result in enumerate(_results()):
        read, sizes = result[run]["read"], result[run]["sizes"]
        assert set(read) <= set(sizes) and read, (rank, read)
        for name, (local, whole) in sizes.items():
            if local < whole:  # a tp shard: its whole tensor is never read
                assert read.get(name, 0) < whole, (run, rank, name, read.get(name), whole)
        if "stage 2" in run:  # each rank's working copy: its local shard, every element once
            assert read == {n: local for n, (local, _) in sizes.items()}, (rank, read)
        else:  # stage 3: its dp shard of each bucket, less than one row more at each end of a range
            assert sum(read.values()) < 0.75 * sum(local for local, _ in sizes.values()), (rank, read)


def test_tp_frozen_shards_on_meta_read_from_weights():
    for result in _results():
        assert result["frozen tp shards from weights"] == {"blocks.0.fc1.weight": (True, True),
                                                            "blocks.0.fc2.weight": (True, True)}


def test_tp_on_meta_refused_with_an_mpu():
    for result in _results():
        text = result["mpu on meta"]
        assert "TensorParallelUnsupported" in text and "mpu" in text and "device_mesh=" in text, text


class _Whole:
    """A source of whole tensors that counts the elements it hands out; `boxed` adds read_box."""

    def __init__(self, tensors: dict, boxed: bool):
        self.tensors, self.elements = tensors, 0
        if boxed:
            self.read_box = lambda name, index: self._count(self.tensors[name][index])

    def read(self, name, start, stop):
        return self._count(self.tensors[name].reshape(-1)[start:stop])

    def _count(self, t):
        self.elements += t.numel()
        return t


@pytest.mark.parametrize("boxed", [True, False], ids=["read_box", "a read per run"])
def test_read_local_gives_the_local_shard_of_the_whole_tensor(boxed):
    from zerodp.engine.setup.tp_shards import Box, read_local

    cube, matrix = torch.arange(5 * 7 * 3.0).view(5, 7, 3), torch.arange(6 * 4.0).view(6, 4)
    # Shard(1), Shard(0) and Shard(2) of a 3-D tensor (torch.chunk's sizes: a last shard short), Shard(1) of a 2-D one
    cases = [(cube, (0, 2, 0), (5, 3, 3)), (cube, (2, 0, 0), (3, 7, 3)), (cube, (0, 0, 2), (5, 7, 1)),
             (cube, (0, 6, 0), (5, 1, 3)), (matrix, (0, 2), (6, 2))]
    for whole, offset, shape in cases:
        box = Box(tuple(whole.shape), shape, offset)
        want = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))].reshape(-1)
        for start in range(want.numel()):
            for stop in range(start + 1, want.numel() + 1):
                source = _Whole({"w": whole}, boxed)
                got = read_local(source, "w", box, start, stop)
                assert torch.equal(got, want[start:stop]), (offset, shape, start, stop)
                row = math.prod(shape[1:])  # less than one local row more than asked at either end
                assert source.elements < stop - start + 2 * row, (offset, shape, start, stop, source.elements)
