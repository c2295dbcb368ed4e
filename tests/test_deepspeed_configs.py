"""Real DeepSpeed configs (tests/data/configs: DeepSpeedExamples' and Hugging Face's docs') load after
"auto" resolution and train 2 steps through zerodp.deepspeed (world of one, in-process)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import zerodp.deepspeed as deepspeed
from zerodp.config import ConfigError, load_config
from oracle import D_IN, D_OUT, Toy

CONFIGS = Path(__file__).parent / "data" / "configs"
# What Hugging Face's Trainer would fill the "auto" values with (its defaults, Toy's width 37).
TRAINER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "warmup_min_lr": 0.0,
           "warmup_num_steps": 1, "total_num_steps": 2, "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": 1, "world_size": 1, "gradient_clipping": 1.0,
           "fp16": False, "bf16": False, "hidden_size": 37}


CASES = ["dse_imagenet_fp16_zero1.json", "dse_megatron_fp16_zero3.json", "dse_alpaca_lora_fp16_zero3_offload.json",
         "hf_zero2.json", "hf_zero3.json", "dsc_step1_fp16_zero2_offload.json", "dsc_step1_bf16_zero3.json"]
# Real configs that DeepSpeed 0.19.8 itself would not run as written, or that ask for what zerodp does
# not do: each fails at load, naming the key and why.
REFUSED_CASES = {
    # DeepSpeed 0.19.8's bf16 section forbids loss-scaling keys too (bf16 needs no loss scale).
    "dse_cifar_zero0_bf16.json": "unknown config key 'bf16.loss_scale'",
    # fp16 master weights: zerodp always keeps fp32 masters.
    "dse_cifar_fp16_zero2_offload.json": "'fp16.fp16_master_weights_and_grads' = true is not supported",
}


@pytest.mark.parametrize("name", sorted(REFUSED_CASES))
def test_real_config_zerodp_cannot_run_as_written_is_refused_naming_the_key(name):
    raw = deepspeed.resolve_auto(json.loads((CONFIGS / name).read_text()), TRAINER)
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert REFUSED_CASES[name] in str(info.value)


@pytest.mark.parametrize("name", CASES)
def test_real_config_loads_after_auto_resolution_and_trains_two_steps(name):
    raw = deepspeed.resolve_auto(json.loads((CONFIGS / name).read_text()), TRAINER)
    torch.manual_seed(0)
    model = Toy()
    # DeepSpeedExamples' Megatron configs leave the optimizer to the script.
    optimizer = None if "optimizer" in raw else torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=raw)
    micro = engine.train_micro_batch_size_per_gpu()
    g = torch.Generator().manual_seed(0)
    for _ in range(2 * engine.gradient_accumulation_steps()):
        loss = engine(torch.randn(micro, D_IN, generator=g), torch.randn(micro, D_OUT, generator=g))
        engine.backward(loss)
        engine.step()
        assert math.isfinite(loss.item())
    assert engine.global_steps == 2
