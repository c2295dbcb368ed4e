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
