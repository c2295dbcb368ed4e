"""Hugging Face models in and out: a local save_pretrained folder is fine-tuned with its weights and
tokenizer, and the job (or `zerodp consolidate --hf`) writes an HF folder that from_pretrained loads
with HF's own key names and the trained model's exact logits.

One `zerodp train` job (2 gloo ranks, ZeRO-3, 2 steps) serves the end-to-end tests; the rest runs
in-process on the tiny folders of tests/hf_tiny.py (made once per session: conftest's hf_folders).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerodp

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from test_checkpoint import world_of_one  # noqa: E402
from test_train import corpus, train  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from zerodp.models import hf_folder  # noqa: E402
from zerodp.checkpoint import CheckpointError, main as consolidate_main, write_hf_folder  # noqa: E402
from zerodp.models.build import HFCausalLM, build_model, hf_description, weights_of  # noqa: E402
from zerodp.train.build import build_corpus  # noqa: E402
from zerodp.train.data import load_corpus  # noqa: E402
from zerodp.models.gpt import gpt_config  # noqa: E402
from zerodp.train.options import parse_options  # noqa: E402

DS_CHECKPOINT = Path(__file__).parent / "data" / "deepspeed" / "stage2_fp32"


@pytest.fixture(scope="module")
def finetuned(hf_folders, tmp_path_factory):
    """(job output dir, its stdout + stderr): the GPT-2 folder fine-tuned 2 steps with ZeRO-3 on 2 ranks."""
    tmp = tmp_path_factory.mktemp("finetune")
    (tmp / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    out = tmp / "run"
    proc = train("--model", str(hf_folders["gpt2"]), "--ds-config", str(tmp / "zero3.json"), "--nproc", "2",
                 "--steps", "2", "--micro-batch", "2", "--block-size", "32", "--eval-batches", "1",
                 "--lr", "1e-2", "--data", corpus(tmp), "--out", str(out), timeout=300)
    return out, proc.stdout + proc.stderr


def logits(model, vocab: int = 300) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.arange(40).remainder(vocab).view(2, 20)).logits


def test_train_job_writes_an_hf_folder_that_from_pretrained_loads_with_the_trained_logits(finetuned, hf_folders):
    out, _ = finetuned
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (out / "hf").iterdir()}
    # HF's own names, the tied lm_head stored as HF stores it (not at all): the source folder's keys.
    assert load_file(out / "hf" / "model.safetensors").keys() == load_file(
        hf_folders["gpt2"] / "model.safetensors").keys()
    loaded, info = AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trained = AutoModelForCausalLM.from_pretrained(hf_folders["gpt2"])
    before = logits(trained)
    final = torch.load(out / "final.pt", weights_only=True)
    trained.load_state_dict({k.removeprefix("model."): v for k, v in final.items()})
    assert not torch.equal(logits(trained), before)  # it was fine-tuned
    assert torch.equal(logits(loaded), logits(trained))


def test_train_job_reads_the_folder_tokenizer_and_prints_hf_noise_once(finetuned):
    _, output = finetuned
    assert "tokenized by" in output and "ZeRO stage 3, 2 rank(s)" in output
    assert output.count("Loading weights: 100%") <= 1  # rank 0's bar only
    assert "was set in the config but it is unrecognized" not in output
    assert "must be `None` or an integer within the vocabulary" not in output


def test_consolidate_hf_writes_the_same_folder_from_the_job_checkpoint(finetuned, tmp_path):
    out, _ = finetuned
    consolidate_main([str(out / "checkpoints"), str(tmp_path / "hf"), "--hf"])
    again, written = load_file(tmp_path / "hf" / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    assert again.keys() == written.keys()
    assert all(torch.equal(again[k], written[k]) for k in again)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (out / "hf" / "config.json").read_text())
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("def x")["input_ids"] == AutoTokenizer.from_pretrained(
        out / "hf")("def x")["input_ids"]


def test_llama_folder_is_trained_from_its_weights_on_data_read_by_its_tokenizer(hf_folders, tmp_path):
    folder = str(hf_folders["llama"])
    data = corpus(tmp_path)
    tokens = build_corpus(folder, data)
    assert tokens.vocab_size == 300 and int(tokens.train.max()) < 300
    text = load_corpus(data).train.tobytes().decode()  # the bytes a GPT would read
    assert len(tokens.train) < 0.9 * len(text)  # BPE tokens, not bytes
    assert AutoTokenizer.from_pretrained(folder).decode(tokens.train.tolist()) == text
    model, shape = build_model(folder, tokens.vocab_size, None)  # built from config.json, weights not read
    with world_of_one():  # the job's initialize reads them: the engine starts from from_pretrained's exactly
        assert all(p.is_meta for p in model.parameters())  # no rank holds the whole model
        engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), {"train_batch_size": 1},
                                   weights=weights_of(folder))
        state = engine.full_state_dict()
    source = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert all(torch.equal(state[f"model.{k}"], v) for k, v in source.items())
    assert (shape.block_size, shape.n_layer, shape.n_embd) == (64, 2, 32)  # max_position_embeddings


def test_write_folder_from_a_wrapped_untied_llama_state(hf_folders, tmp_path):
    folder = str(hf_folders["llama"])
    model = HFCausalLM(AutoModelForCausalLM.from_pretrained(folder))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state = model.state_dict()  # zerodp's wrapper: every key starts with `model.`
    assert hf_folder.write_folder(tmp_path / "hf", state, hf_description(model, folder)) == []
    assert load_file(tmp_path / "hf" / "model.safetensors").keys() == load_file(
        hf_folders["llama"] / "model.safetensors").keys()
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(logits(loaded), logits(model.model))
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_model_folder_must_embed_every_token_of_the_data(hf_folders):
    with pytest.raises(ValueError, match="300 token embeddings, fewer than the data's vocabulary of 400"):
        build_model(str(hf_folders["gpt2"]), 400, None)
    with pytest.raises(ValueError, match="--block-size 65 exceeds"):
        build_model(str(hf_folders["gpt2"]), 300, 65)


@pytest.mark.parametrize("family", ["hf-gpt2", "hf-llama"])
def test_hf_family_alone_is_the_small_shape_with_byte_ids_in_vocabulary(family, capfd):
    with torch.device("meta"):  # the config is the point, not the weights
        model, shape = build_model(family, 256, None)
    assert shape == gpt_config("small", vocab_size=256)
    assert model.model.config.bos_token_id is None and model.model.config.eos_token_id is None
    assert "within the vocabulary" not in capfd.readouterr().err
    assert parse_options(["--model", family]).model == family


def test_model_option_takes_a_folder_and_names_a_directory_that_is_not_one(hf_folders, tmp_path):
    opts = parse_options(["--model", str(hf_folders["gpt2"])])
    assert opts.out == str(Path("runs") / "gpt2-zero2")
    with pytest.raises(SystemExit, match="directory without config.json"):
        parse_options(["--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="or a local HF model folder"):
        parse_options(["--model", "hf-gpt3"])


def test_consolidate_hf_of_a_deepspeed_checkpoint_needs_the_model_config(hf_folders, tmp_path):
    with pytest.raises(CheckpointError, match="DeepSpeed checkpoint, which records no Hugging Face config: pass "
                       "--hf-config"):
        write_hf_folder(str(DS_CHECKPOINT), str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="do not fit this HF config's model"):
        write_hf_folder(str(DS_CHECKPOINT), str(tmp_path / "hf"), hf_config=str(hf_folders["gpt2"]))
    assert not (tmp_path / "hf").exists()


def test_hidden_size_is_one_rule_for_config_objects_and_config_json():
    import transformers
    gpt2 = transformers.GPT2Config(n_embd=48, n_head=4)
    assert hf_folder.hidden_size(gpt2) == hf_folder.hidden_size(gpt2.to_dict()) == 48  # n_embd in config.json
    assert hf_folder.hidden_size({"hidden_sizes": [32, 64, 160]}) == 160  # multi-stage vision models
    assert hf_folder.hidden_size({"text_config": {"d_model": 24}}) == 24  # multimodal: the text model's
    assert hf_folder.hidden_size({"vocab_size": 5}) is None and hf_folder.hidden_size(None) is None
