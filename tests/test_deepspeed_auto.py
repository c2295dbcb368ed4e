""""auto" in a DeepSpeed config is filled from what is known, or fails naming the key."""

from __future__ import annotations

import pytest
import torch

import zerodp
import zerodp.deepspeed as deepspeed
from oracle import Toy
from zerodp.deepspeed import resolve_auto

AUTO = "auto"
HF_LIKE = {
    "optimizer": {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                      "warmup_num_steps": AUTO, "total_num_steps": AUTO}},
    "train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO,
    "gradient_clipping": AUTO, "fp16": {"enabled": AUTO}, "bf16": {"enabled": AUTO},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": AUTO, "stage3_prefetch_bucket_size": AUTO,
                          "stage3_param_persistence_threshold": AUTO},
}
KNOWN = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1, "warmup_num_steps": 10,
         "total_num_steps": 100, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
         "world_size": 8, "gradient_clipping": 1.0, "fp16": False, "bf16": True, "hidden_size": 64}


def test_every_auto_of_a_trainer_config_is_filled_as_hugging_face_fills_it():
    out = resolve_auto(HF_LIKE, KNOWN)
    assert out["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                          "warmup_num_steps": 10, "total_num_steps": 100}
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) \
        == (64, 4, 2)
    assert out["gradient_clipping"] == 1.0 and out["fp16"]["enabled"] is False and out["bf16"]["enabled"] is True
    assert out["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 64 * 64,
                                        "stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
                                        "stage3_param_persistence_threshold": 640}
    assert HF_LIKE["gradient_clipping"] == AUTO  # the input is not changed
    zerodp.load_config(out)


def test_bucket_sizes_without_a_known_width_take_zerodps_defaults():
    out = resolve_auto({"zero_optimization": HF_LIKE["zero_optimization"]}, {})
    assert out["zero_optimization"] == {"stage": 3}


def test_batch_sizes_not_known_are_derived_from_the_others_by_deepspeeds_rule():
    out = resolve_auto({"train_batch_size": 32, "train_micro_batch_size_per_gpu": AUTO,
                        "gradient_accumulation_steps": AUTO}, {})
    assert out == {"train_batch_size": 32}
    assert zerodp.load_config(out).batch(4).micro_batch_size == 8


@pytest.mark.parametrize("config, key", [
    ({"gradient_clipping": AUTO}, "gradient_clipping"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": AUTO}}}, "optimizer.params.lr"),
    ({"train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO}, "train_batch_size"),
    ({"zero_optimization": {"stage": AUTO}}, "zero_optimization.stage"),
    ({"fp16": {"enabled": True, "loss_scale": AUTO}}, "fp16.loss_scale"),
])
def test_an_auto_that_nothing_knows_fails_naming_the_key(config, key):
    with pytest.raises(zerodp.ConfigError, match=rf"'{key}' = \"auto\": nothing here knows its value"):
        resolve_auto(config, {})


def test_initialize_fills_auto_from_the_optimizer_and_model_it_is_given():
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.8, 0.9), weight_decay=0.3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": AUTO, "bf16": {"enabled": AUTO},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": AUTO, "warmup_num_steps": 5}}})
    assert engine.gradient_accumulation_steps() == 1 and not engine.bfloat16_enabled()
    assert engine.lr_scheduler is not None
    with pytest.raises(zerodp.ConfigError, match=r"'optimizer.params.lr' = \"auto\""):
        deepspeed.initialize(model=Toy(), config={"train_micro_batch_size_per_gpu": 2,
                                                  "optimizer": {"type": "AdamW", "params": {"lr": AUTO}}})


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
@pytest.mark.parametrize("params", [[0.9, 0.999], "lr=1e-3"])
def test_params_of_another_json_type_fail_naming_the_key_not_inside_auto(section, params):
    # Found by seeded config mutations: resolve_auto read every section's params as a dict.
    sections = {"optimizer": {"type": "AdamW", "params": params},
                "scheduler": {"type": "WarmupLR", "params": params}}
    model = Toy()
    optimizer = None if section == "optimizer" else torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(zerodp.ConfigError, match=rf"config key '{section}.params' = .*expected a valid dictionary"):
        deepspeed.initialize(model=model, optimizer=optimizer,
                             config={"train_micro_batch_size_per_gpu": 2, section: sections[section]})
