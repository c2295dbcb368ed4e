"""Fine-tunes of a frozen base at stage 3, which shards the base too (issue 32):
  * PEFT as people use it: a tiny Hugging Face Llama wrapped by peft.get_peft_model(model, LoraConfig(...))
    trains on 2 ranks as on one process; `save_pretrained` of the PEFT model writes adapter files that
    PeftModel.from_pretrained loads to the trained logits; a checkpoint resumes on 1 rank;
  * a frozen reference model as a zerodp engine of its own (no optimizer: forward only) beside a trained
    policy, with a DPO loss written here: equal to one process; through zerodp.deepspeed too, as TRL builds it.
  * the big-model path: the base built on meta, wrapped by get_peft_model, its values read from the base's
    Hugging Face folder with weights= (PEFT's names mapped to the folder's, the LoRA initialised as PEFT
    does, bit for bit): trains on 2 ranks as the same PEFT model of from_pretrained on one process, and
    each rank reads only its share of the base.
One 2-rank launch runs every case; the references run in this process.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn.functional as F

import zerodp
from adam_rounding import AdamSlack, assert_close_after_adam
from spawn import run_ranks

peft = pytest.importorskip("peft")  # the `test` extra pins it
transformers = pytest.importorskip("transformers")

MICRO, STEPS, SAVE_AT, SEQ, BETA, SEED = 2, 4, 2, 12, 0.1, 5
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def llama(seed: int = 0):
    """tests/hf_tiny.py's Llama (untied head), built from its config."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False))


def lora_model(seed: int = 0):
    model = peft.get_peft_model(llama(seed), peft.LoraConfig(**LORA))
    torch.manual_seed(seed + 100)  # LoRA's B starts at zero: give it values, so that the base matters at once
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def base_folder() -> str:
    """The base model's Hugging Face folder (save_pretrained's), written once: what weights= reads."""
    path = os.path.join(work(), "base")
    if not os.path.isdir(path):
        llama().save_pretrained(path)
    return path


def meta_lora(folder: str, low_cpu_mem_usage: bool = True, **lora):
    """The big-model path as a user writes it: the base on meta, wrapped by PEFT (which with
    low_cpu_mem_usage=True builds the adapter on meta too, drawing nothing); weights= then fills it."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    return peft.get_peft_model(base, peft.LoraConfig(**{**LORA, **lora}), low_cpu_mem_usage=low_cpu_mem_usage)


def whole_lora(folder: str, **lora):
    """The same PEFT model built whole, as on one GPU, from the same seed."""
    torch.manual_seed(SEED)
    return peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                               peft.LoraConfig(**{**LORA, **lora}))


def batches(world: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (world * MICRO, SEQ), generator=g) for _ in range(STEPS)]


def config(world: int, stage: int = 3) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2 // world,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


PROBE = torch.arange(SEQ).view(1, SEQ) * 7 % 300


# ---- on the ranks ---------------------------------------------------------------------------------
def _lora_run(rank: int, world: int, work: str) -> dict:
    model = lora_model()
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # (empty at stage 3 after)
    engine = zerodp.initialize(model, torch.optim.AdamW(trainable(model), lr=1e-2), config(world))
    losses = []
    for step, ids in enumerate(batches()):
        ids = ids[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step + 1 == SAVE_AT:
            engine.save_checkpoint(os.path.join(work, "ckpt"))
    model.save_pretrained(os.path.join(work, "adapter"), is_main_process=rank == 0)  # every rank: it gathers
    with torch.no_grad():
        logits = engine(input_ids=PROBE).logits
    return {"losses": losses, "state": engine.full_state_dict(), "logits": logits,
            "frozen_bytes": engine.memory_report()["frozen_params"], "base_numel": base}


def _lora_resume(rank: int, world: int, work: str) -> dict:
    """One rank, other initial weights (the base too), from the 2-rank checkpoint to the end."""
    model = lora_model(seed=1)
    engine = zerodp.initialize(model, torch.optim.AdamW(trainable(model), lr=1e-2), config(world))
    engine.load_checkpoint(os.path.join(work, "ckpt"))
    for ids in batches()[SAVE_AT:]:
        for k in range(2):  # the 2 ranks' micro-batches, accumulated
            part = ids[k * MICRO:(k + 1) * MICRO]
            engine.backward(engine(input_ids=part, labels=part).loss)
            engine.step()
    return {"state": engine.full_state_dict()}


def _meta_run(rank: int, world: int, work: str) -> dict:
    """The PEFT model on meta, its base from the folder at stage 3; every range read from the files counted."""
    from zerodp.checkpoint.weights import SafetensorsSource

    read, original = [], SafetensorsSource.read_key

    def counted(self, key: str, start: int, stop: int) -> torch.Tensor:
        read.append(stop - start)
        return original(self, key, start, stop)
    SafetensorsSource.read_key = counted
    try:
        model = meta_lora(os.path.join(work, "base"))
        engine = zerodp.initialize(model, torch.optim.AdamW(trainable(model), lr=1e-2), config(world),
                                   weights=os.path.join(work, "base"))
    finally:
        SafetensorsSource.read_key = original
    losses = []
    for ids in batches():
        ids = ids[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": engine.full_state_dict(), "read": sum(read),
            "frozen_bytes": engine.memory_report()["frozen_params"]}


def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed log-probability of its own tokens."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loss(policy, reference, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """DPO (Rafailov et al. 2023), chosen and rejected in one forward as TRL's concatenated_forward."""
    both = torch.cat([chosen, rejected])
    with torch.no_grad():
        ref_c, ref_r = log_probs(reference, both).chunk(2)
    pol_c, pol_r = log_probs(policy, both).chunk(2)
    return -F.logsigmoid(BETA * ((pol_c - ref_c) - (pol_r - ref_r))).mean()


def _dpo_run(rank: int, world: int) -> dict:
    policy, reference = llama(), llama().requires_grad_(False)
    engine = zerodp.initialize(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), config(world))
    ref = zerodp.initialize(reference, None, {"zero_optimization": {"stage": 3,
                                                                     "stage3_param_persistence_threshold": 0}})
    losses, data = [], batches()
    for step in range(STEPS - 1):
        chosen, rejected = (d[rank * MICRO:(rank + 1) * MICRO] for d in (data[step], data[step + 1]))
        loss = dpo_loss(engine, ref, chosen, rejected)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    refused = []
    for call in (lambda: ref.backward(loss), ref.step):
        try:
            call()
        except RuntimeError as e:
            refused.append(str(e))
    # TRL's reference model: deepspeed.initialize(model=..., config=...), no optimizer, requires_grad left on
    import zerodp.deepspeed as deepspeed
    ds_ref, optimizer, _, _ = deepspeed.initialize(model=llama(), config={
        "train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3}})
    with torch.no_grad():
        ds_logits, ref_logits = ds_ref(input_ids=PROBE).logits, ref(input_ids=PROBE).logits
    return {"losses": losses, "state": engine.full_state_dict(), "refused": refused,
            "frozen_bytes": ref.memory_report()["frozen_params"], "ds_optimizer": optimizer,
            "ds_ids": all(hasattr(p, "ds_id") for p in ds_ref.module.parameters()),
            "ds_logits": ds_logits, "ref_logits": ref_logits}


def _jobs(rank: int, world: int, work: str) -> dict:
    return {"lora": _lora_run(rank, world, work), "dpo": _dpo_run(rank, world), "meta": _meta_run(rank, world, work)}


@functools.cache
def work() -> str:
    path = tempfile.mkdtemp(prefix="zerodp-peft-")
    import atexit
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def runs() -> list[dict]:
    base_folder()
    return run_ranks(_jobs, 2, work())


# ---- one process ------------------------------------------------------------------------------------
def _trained_on_one_process(model: torch.nn.Module) -> dict:
    """The PEFT model trained on the whole batch of each step by one process: losses and final state."""
    opt = torch.optim.AdamW(trainable(model), lr=1e-2)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@functools.cache
def lora_reference() -> dict:
    return _trained_on_one_process(lora_model())


def _close(ours: dict, theirs: dict) -> None:
    """To 1e-6: unlike the DPO case, the LoRA cases' Adam meets no gradient near zero: tests/adam_rounding.py's
    slack stays under 5e-7 at every element (4e-9 at the rounding measured there)."""
    assert ours.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_peft_lora_trains_at_stage3_on_2_ranks_as_on_one_process_with_the_base_sharded():
    ours, ref = runs(), lora_reference()
    per_step = [sum(r["lora"]["losses"][s] for r in ours) / 2 for s in range(STEPS)]
    assert per_step == pytest.approx(ref["losses"], rel=1e-6, abs=1e-6)
    _close(ours[0]["lora"]["state"], ref["state"])
    base = ours[0]["lora"]["base_numel"]
    for r in ours:  # each rank holds half of the frozen base (fp32), plus alignment padding
        assert base * 4 / 2 <= r["lora"]["frozen_bytes"] < base * 4 / 2 * 1.1


def test_peft_adapter_saved_from_stage3_loads_with_from_pretrained_to_the_trained_logits():
    ours = runs()[0]["lora"]
    loaded = peft.PeftModel.from_pretrained(llama(), os.path.join(work(), "adapter"))
    with torch.no_grad():
        logits = loaded(input_ids=PROBE).logits
    torch.testing.assert_close(logits, ours["logits"], rtol=1e-5, atol=1e-5)
    untrained = lora_model()(input_ids=PROBE).logits.detach()
    assert (untrained - logits).abs().max() > 1e-3, "training must have changed the adapter's logits"


def test_peft_lora_stage3_checkpoint_resumes_on_one_rank_base_included():
    runs()
    resumed = run_ranks(_lora_resume, 1, work())[0]
    _close(resumed["state"], runs()[0]["lora"]["state"])


@functools.cache
def dpo_reference() -> dict:
    policy, reference = llama(), llama().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    log = AdamSlack(policy, opt)
    losses, data = [], batches()
    for step in range(STEPS - 1):
        loss = dpo_loss(policy, reference, data[step], data[step + 1])
        loss.backward()
        log.record()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in policy.state_dict().items()},
            "slack": log.slack}


def test_dpo_with_a_frozen_reference_engine_beside_the_policy_equals_one_process():
    ours, ref = runs(), dpo_reference()
    per_step = [sum(r["dpo"]["losses"][s] for r in ours) / 2 for s in range(STEPS - 1)]
    assert per_step == pytest.approx(ref["losses"], rel=1e-6, abs=1e-6)
    # Adam where a gradient meets zero: tests/adam_rounding.py (lm_head[207, 31] moved 1.2e-6 on AVX-512)
    assert_close_after_adam(ours[0]["dpo"]["state"], ref["state"], ref["slack"])
    numel = sum(p.numel() for p in llama().parameters())
    for r in ours:  # the reference model is sharded too: half of it on each rank
        assert numel * 4 / 2 <= r["dpo"]["frozen_bytes"] < numel * 4 / 2 * 1.1


def test_a_reference_engine_refuses_backward_and_step_by_name():
    for r in runs():
        assert len(r["dpo"]["refused"]) == 2
        assert all("nothing to train" in m and "forward only" in m for m in r["dpo"]["refused"])


def test_trl_style_deepspeed_initialize_without_optimizer_gives_a_sharded_reference_engine():
    for r in runs():
        assert r["dpo"]["ds_optimizer"] is None and r["dpo"]["ds_ids"]
        torch.testing.assert_close(r["dpo"]["ds_logits"], r["dpo"]["ref_logits"], rtol=0, atol=0)


# ---- the big-model path: the base on meta, read from its folder ------------------------------------
@functools.cache
def meta_reference() -> dict:
    return _trained_on_one_process(whole_lora(base_folder()))


def test_peft_model_on_meta_with_the_base_folder_as_weights_trains_on_2_ranks_as_from_pretrained_on_one():
    ours, ref = runs(), meta_reference()
    per_step = [sum(r["meta"]["losses"][s] for r in ours) / 2 for s in range(STEPS)]
    assert per_step == pytest.approx(ref["losses"], rel=1e-6, abs=1e-6)
    _close(ours[0]["meta"]["state"], ref["state"])  # the trained adapter, and the base unchanged
    assert any("lora_A" in k for k in ref["state"])
    base = sum(v.numel() for k, v in ref["state"].items() if "lora_" not in k)
    # No rank reads, or holds, the whole base: each reads its half of the files, and keeps it sharded.
    assert ours[0]["meta"]["read"] + ours[1]["meta"]["read"] == base
    for r in ours:
        assert 0.4 * base < r["meta"]["read"] < 0.6 * base
        assert base * 4 / 2 <= r["meta"]["frozen_bytes"] < base * 4 / 2 * 1.1


def _materialised(model, folder: str) -> tuple[dict, torch.Tensor]:
    engine = zerodp.initialize(model, torch.optim.AdamW(trainable(model)), config(1), weights=folder)
    rng = torch.get_rng_state()
    with engine.gathered_parameters():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, rng


@pytest.mark.parametrize("lora", [{}, {"init_lora_weights": "gaussian", "modules_to_save": ["lm_head"]},
                                  {"init_lora_weights": False, "lora_bias": True}],
                         ids=["default", "gaussian+modules_to_save", "no-init+lora_bias"])
def test_peft_model_on_meta_materialises_bit_for_bit_as_get_peft_model_of_from_pretrained(lora):
    whole = whole_lora(base_folder(), **lora)
    rng = torch.get_rng_state()
    expected = whole.state_dict()
    got, got_rng = _materialised(meta_lora(base_folder(), **lora), base_folder())
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert torch.equal(got_rng, rng)  # the random state left where the whole build leaves it
    if lora.get("init_lora_weights", True) is not False:  # the untrained adapter adds nothing
        assert all(not got[k].any() for k in got if "lora_B" in k)


def test_peft_default_build_on_meta_draws_the_adapter_again_with_lora_B_zero():
    """get_peft_model's default on a meta base draws the adapter on CPU and drops it to meta: zerodp draws it
    again, as PEFT does, from the state after (not the whole build's numbers, which are gone)."""
    expected = whole_lora(base_folder()).state_dict()
    got, _ = _materialised(meta_lora(base_folder(), low_cpu_mem_usage=False), base_folder())
    for k, v in expected.items():
        if "lora_B" in k:
            assert not got[k].any()
        elif "lora_A" in k:
            assert 0 < got[k].abs().max() <= 1 / math.sqrt(v.shape[1]) and not torch.equal(got[k], v)
        else:
            assert torch.equal(got[k], v), k


def test_peft_initialiser_that_reads_the_base_is_refused_on_meta_by_name():
    with pytest.raises(ValueError, match=r"lora_A\.default\.weight.*init_lora_weights='pissa'"):
        _materialised(meta_lora(base_folder(), init_lora_weights="pissa"), base_folder())


def _config_md_block() -> str:
    """docs/CONFIG.md's python block of the big-model path."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md").read_text()
    return next(b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M) if "get_peft_model" in b)


def _whole_trained_as_the_block(folder: str) -> dict:
    """The block's job as one process runs it without zerodp: the PEFT model of from_pretrained, its steps."""
    torch.manual_seed(SEED)
    whole = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW(trainable(whole), lr=1e-4)
    for step in range(4):
        ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(step))
        whole(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return whole.state_dict()


def test_config_md_peft_on_meta_runs_as_written_saves_its_adapter_and_a_checkpoint_of_it_is_read(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink(base_folder(), tmp_path / "base")  # the block's folder = "base"
    scope = {"__name__": "__main__"}
    torch.manual_seed(SEED)
    exec(compile(_config_md_block(), "docs/CONFIG.md", "exec"), scope)  # the documented code, as written
    engine, trained = scope["engine"], scope["engine"].full_state_dict()
    whole = _whole_trained_as_the_block(base_folder())
    assert trained.keys() == whole.keys()
    for k, v in whole.items():  # one rank sums as one process does: no rounding apart
        torch.testing.assert_close(trained[k], v, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert any(v.any() for k, v in trained.items() if "lora_B" in k)  # trained away from PEFT's zero
    # The adapter it saved is the trained one, as PEFT loads it onto the base.
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_folder()),
                                            str(tmp_path / "adapter"))
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    again = meta_lora(base_folder(), r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    read = zerodp.initialize(again, torch.optim.AdamW(trainable(again)), config(1), weights=str(tmp_path / "ckpt"))
    assert all(torch.equal(v, trained[k]) for k, v in read.full_state_dict().items())  # the adapter read, not drawn
