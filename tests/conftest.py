import os
import sys

import pytest

# Spawned ranks import the test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))


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
