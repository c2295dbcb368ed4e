import gc
import os
import sys

import pytest

# Spawned ranks import the test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    """In-process tests run torch on one thread: their models are tiny, and a second thread's OpenMP spin-wait
    only takes a core from the ranks and children the suite runs (12 in-process files: 52-58 s on one
    thread, 61-65 s on two). Tests that need another count set it and restore it."""
    import torch

    torch.set_num_threads(1)


def pytest_collection_finish(session):
    """The test modules' imports (torch, transformers, Lightning, TRL: ~500k objects) live as long as this
    process: frozen, the garbage collector's full passes (~0.5 s each) no longer walk them."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def frozen_heap():
    """For modules whose libraries make a large heap (transformers, TRL, Lightning), marked with it: what is alive
    as the module starts (~450k objects) is left out of every later collection. accelerate's free_memory() runs
    gc.collect() at each Trainer's set-up and end, Lightning's loops collect often: ~0.5 CPU s each over that
    heap, ~1 ms without it (the TRL runs on 2 ranks: 19 -> 9 s of wall time). What the tests make is collected
    as before. Not unfrozen after: that would also unfreeze what pytest_collection_finish froze, for every
    later test. Ranks forked later (spawn.py) freeze again before the fork."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    """Tiny GPT-2 and Llama save_pretrained folders with a tokenizer (tests/hf_tiny.py), made once."""
    pytest.importorskip("transformers")
    from hf_tiny import make_folders

    return make_folders(tmp_path_factory.mktemp("hf"))


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """An in-process test may leave zerodp's world-1 process group (initialize creates one when there
    is none); the next test's forked ranks (spawn.run_ranks) would inherit it. Tear it down."""
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
