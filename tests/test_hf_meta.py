"""A Hugging Face model that the user builds on meta and hands to zerodp.initialize with its folder's
weights, exactly as a script does it:

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    engine = zerodp.initialize(model, optimizer, config, weights=folder)

No param_init_fn: the parameters come from the files, and what no file holds (Llama's rotary tables,
non-persistent buffers) is computed by the model's own `_init_weights`. One 2-rank launch serves every
case (Llama and GPT-2, stages 2 and 3).
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers")
from spawn import run_ranks  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import zerodp  # noqa: E402
from zerodp.models import hf_folder  # noqa: E402

CASES = [(family, stage) for family in ("llama", "gpt2") for stage in (3, 2)]


def _user_script(rank: int, world: int, folders: dict[str, str]) -> dict:
    """Each case as a user writes it; {(family, stage): (full_state_dict, buffers)} on rank 0."""
    out = {}
    for family, stage in CASES:
        cfg = AutoConfig.from_pretrained(folders[family])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()),
                                   {"train_batch_size": world, "zero_optimization": {"stage": stage}},
                                   weights=folders[family])
        state = engine.full_state_dict()
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        if rank == 0:
            out[family, stage] = (state, buffers)
        del engine
    return out


@pytest.fixture(scope="module")
def engines(hf_folders) -> dict:
    return run_ranks(_user_script, 2, {k: str(v) for k, v in hf_folders.items()})[0]


@pytest.mark.parametrize("family,stage", CASES)
def test_meta_built_hf_model_takes_the_folder_weights_and_computes_what_no_file_holds(engines, hf_folders,
                                                                                       family, stage):
    state, buffers = engines[family, stage]
    reference = AutoModelForCausalLM.from_pretrained(hf_folders[family])
    expected = reference.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    # Non-persistent buffers (Llama's rotary inv_freq, original_inv_freq): computed as from_pretrained does.
    assert buffers.keys() == dict(reference.named_buffers()).keys()
    assert all(torch.equal(buffers[n], b) for n, b in reference.named_buffers())
    if family == "llama":
        assert "model.rotary_emb.inv_freq" in buffers


def test_hf_initialiser_is_none_for_a_model_that_is_not_hugging_faces_or_not_on_meta(hf_folders, monkeypatch):
    with torch.device("meta"):
        on_meta = torch.nn.Linear(2, 2)
        llama = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_folders["llama"]))
    assert hf_folder.init_fn(on_meta) is None  # its reset_parameters() stays the initialiser
    assert hf_folder.init_fn(AutoModelForCausalLM.from_pretrained(hf_folders["llama"])) is None  # nothing on meta
    assert callable(hf_folder.init_fn(llama))
    # Only what is imported is looked at: a process whose models are not transformers' never imports it.
    monkeypatch.delitem(sys.modules, "transformers.modeling_utils")
    assert hf_folder.init_fn(llama) is None and "transformers.modeling_utils" not in sys.modules


def test_hf_initialiser_dispatches_each_module_to_its_enclosing_model_and_others_to_reset_parameters(hf_folders):
    cfg = AutoConfig.from_pretrained(hf_folders["llama"])
    with torch.device("meta"):
        wrapped = torch.nn.ModuleDict({"hf": AutoModelForCausalLM.from_config(cfg), "head": torch.nn.Linear(4, 4)})
    init = hf_folder.init_fn(wrapped)
    rotary = wrapped["hf"].model.rotary_emb
    rotary.inv_freq = torch.empty_like(rotary.inv_freq, device="cpu")
    rotary.original_inv_freq = torch.empty_like(rotary.original_inv_freq, device="cpu")
    init(rotary)
    expected, _ = rotary.compute_default_rope_parameters(cfg)
    assert torch.equal(rotary.inv_freq, expected) and torch.equal(rotary.original_inv_freq, expected)
    head = wrapped["head"].to_empty(device="cpu")
    torch.manual_seed(0)
    init(head)
    torch.manual_seed(0)
    assert torch.equal(head.weight, torch.nn.Linear(4, 4).weight)  # torch's own reset_parameters
