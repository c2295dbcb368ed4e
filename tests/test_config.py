"""Specification of zerodp.config: DeepSpeed keys load, every mistake names its key."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from zerodp.config import (BatchSizes, Config, ConfigError, OptimizerConfig, SchedulerConfig,
                           load_config)

DATA = Path(__file__).parent / "data"


def error_of(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    return str(info.value)


# ---- loading ---------------------------------------------------------------------------------

def test_deepspeed_zero2_example_file_loads():
    config = load_config(DATA / "ds_config_zero2.json")
    assert config.zero_optimization.stage == 2
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(config.zero_optimization.allgather_bucket_size, int)
    assert config.dtype == torch.float16
    assert config.optimizer.type == "Adam" and config.scheduler.type == "WarmupLR"
    assert config.batch(world_size=4) == BatchSizes(16, 2, 2)


def test_none_gives_defaults_and_config_is_returned_as_is():
    assert load_config(None) == Config()
    config = Config(seed=3)
    assert load_config(config) is config
    assert Config().dtype == torch.float32
    assert load_config({"bf16": {"enabled": True}}).dtype == torch.bfloat16


def test_integral_float_sizes_are_accepted_as_ints():
    zero = load_config({"zero_optimization": {"reduce_bucket_size": 5e8, "sub_group_size": 1e9}})
    assert zero.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(zero.zero_optimization.sub_group_size) is int


def test_fractional_size_is_rejected_naming_key_and_value():
    message = error_of({"zero_optimization": {"reduce_bucket_size": 5.5}})
    assert "'zero_optimization.reduce_bucket_size' = 5.5" in message
    assert "integer" in message


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        load_config(path)


def test_invalid_json_names_path_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {enabled: true}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert "bad.json" in str(info.value)
    assert "line 3 column 12" in str(info.value)


def test_file_problems_name_the_file(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"zero_optimization": {"stge": 2}}))
    with pytest.raises(ConfigError, match=r"typo\.json(.|\n)*zero_optimization\.stge"):
        load_config(path)


def test_non_object_config_is_an_error(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(path)


# ---- readable errors -------------------------------------------------------------------------

def test_unknown_key_suggests_closest():
    message = error_of({"zero_optimization": {"stge": 2}})
    assert message == "unknown config key 'zero_optimization.stge'; did you mean 'stage'?"


def test_unknown_key_without_close_match_lists_section_keys():
    message = error_of({"fp16": {"xyzzy": 1}})
    assert "unknown config key 'fp16.xyzzy'" in message
    assert "initial_scale_power" in message and "loss_scale_window" in message


def test_unknown_top_level_key_suggests_closest():
    assert "did you mean 'gradient_clipping'?" in error_of({"gradient_cliping": 1.0})


def test_out_of_range_value_names_key_value_and_bound():
    message = error_of({"zero_optimization": {"stage": 7}})
    assert message == "config key 'zero_optimization.stage' = 7: expected less than or equal to 3"


def test_wrong_type_names_key_and_expected_form():
    message = error_of({"fp16": {"loss_scale_window": "often"}})
    assert "'fp16.loss_scale_window' = \"often\"" in message and "integer" in message


WRONG_TYPES = [
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled", '"yes"', "true or false"),
    ({"bf16": {"enabled": 1}}, "bf16.enabled", "1", "true or false"),
    ({"zero_optimization": {"overlap_comm": "false"}}, "zero_optimization.overlap_comm", '"false"', "true or false"),
    ({"zero_optimization": {"offload_optimizer": {"pin_memory": "no"}}},
     "zero_optimization.offload_optimizer.pin_memory", '"no"', "true or false"),
    ({"broadcast_buffers": "true"}, "broadcast_buffers", '"true"', "true or false"),
    ({"train_batch_size": True}, "train_batch_size", "true", "an integer"),
    ({"train_micro_batch_size_per_gpu": "4"}, "train_micro_batch_size_per_gpu", '"4"', "an integer"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage", '"2"', "an integer"),
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, "zero_optimization.reduce_bucket_size", '"5e8"',
     "an integer"),
    ({"activation_checkpointing": {"number_checkpoints": True}}, "activation_checkpointing.number_checkpoints",
     "true", "an integer"),
    ({"gradient_clipping": "1e-3"}, "gradient_clipping", '"1e-3"', "a number"),
    ({"fp16": {"min_loss_scale": True}}, "fp16.min_loss_scale", "true", "a number"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "100"}}},
     "scheduler.params.warmup_num_steps", '"100"', "an integer"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2,
                                                         "cos_min_ratio": "0.1"}}},
     "scheduler.params.cos_min_ratio", '"0.1"', "a number"),
]


@pytest.mark.parametrize("config, path, shown, expected", WRONG_TYPES,
                         ids=[f"{path}={shown}" for _, path, shown, _ in WRONG_TYPES])
def test_value_of_another_json_type_is_rejected_naming_key_value_and_form(config, path, shown, expected):
    assert error_of(config).startswith(f"config key '{path}' = {shown}: expected {expected}")


def test_whole_floats_are_integers_and_integers_are_numbers_in_every_section():
    config = load_config({
        "train_batch_size": 32.0, "gradient_clipping": 1, "fp16": {"loss_scale_window": 1e3, "loss_scale": 0},
        "activation_checkpointing": {"number_checkpoints": 4.0},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1e4, "warmup_max_lr": 1}}})
    assert type(config.train_batch_size) is int and config.train_batch_size == 32
    assert type(config.fp16.loss_scale_window) is int
    assert type(config.activation_checkpointing.number_checkpoints) is int
    assert config.gradient_clipping == 1.0 and type(config.gradient_clipping) is float
    assert config.scheduler._parsed_params().total_num_steps == 10_000


def test_optimizer_params_of_the_wrong_type_are_rejected_naming_the_key():
    assert "config key 'optimizer.params.lr' = \"1e-3\": expected a finite number" in error_of(
        {"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}})


def test_every_problem_gets_its_own_line():
    message = error_of({"steps_per_print": 0, "fp16": {"hysteresis": 0}})
    lines = message.splitlines()
    assert len(lines) == 2
    assert any("'steps_per_print' = 0" in line for line in lines)
    assert any("'fp16.hysteresis' = 0" in line for line in lines)


@pytest.mark.parametrize("key, section, expected", [
    ("train_batch_size", None, "give a number"),
    ("enabled", "fp16", "give a boolean"),
])
def test_hf_auto_placeholder_is_explained(key, section, expected):
    config = {section: {key: "auto"}} if section else {key: "auto"}
    message = error_of(config)
    path = f"{section}.{key}" if section else key
    assert f"'{path}' = \"auto\"" in message
    assert "placeholder the Hugging Face Trainer fills in" in message and expected in message


def test_nvme_offload_of_the_optimizer_needs_a_path():
    message = error_of({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    assert 'offload_optimizer.device "nvme" needs offload_optimizer.nvme_path' in message


def test_nvme_offload_of_parameters_without_a_path_is_refused_naming_the_key():
    message = error_of({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert 'offload_param.device "nvme" needs offload_param.nvme_path' in message


def test_unknown_offload_device_lists_choices():
    message = error_of({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    assert "'zero_optimization.offload_optimizer.device' = \"gpu\"" in message
    assert "'none', 'cpu' or 'nvme'" in message


def test_partition_activations_is_refused_explaining_why():
    message = error_of({"activation_checkpointing": {"partition_activations": True}})
    assert "'activation_checkpointing.partition_activations' = true" in message
    assert "model-parallel (tensor-parallel) group" in message and "cpu_checkpointing" in message


def test_contiguous_memory_optimization_requires_number_checkpoints():
    message = error_of({"activation_checkpointing": {"contiguous_memory_optimization": True}})
    assert "contiguous_memory_optimization" in message and "number_checkpoints" in message
    assert "activation_checkpointing" in message
    ok = {"contiguous_memory_optimization": True, "number_checkpoints": 4}
    assert load_config({"activation_checkpointing": ok}).activation_checkpointing.number_checkpoints == 4


def test_fp16_and_bf16_together_is_an_error_naming_both():
    message = error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled" in message and "bf16.enabled" in message


def test_section_of_wrong_type_names_the_section():
    assert "'fp16' = 3" in error_of({"fp16": 3})


# ---- batch sizes: train = micro × accumulation × world ----------------------------------------

@pytest.mark.parametrize("given, world, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_micro_batch_size_per_gpu": 4}, 8, (32, 4, 1)),
    ({"train_batch_size": 32}, 8, (32, 4, 1)),
])
def test_batch_sizes_follow_deepspeed_rule(given, world, expected):
    assert load_config(given).batch(world) == BatchSizes(*expected)


def test_inconsistent_batch_triple_shows_the_arithmetic():
    config = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError) as info:
        config.batch(2)
    assert str(info.value) == ("train_batch_size 32 != train_micro_batch_size_per_gpu 4 × "
                               "gradient_accumulation_steps 2 × world size 2 = 16; train_batch_size 16 would work, "
                               "or leave one of the three out and it is derived from the other two")


@pytest.mark.parametrize("given, world, shown", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2,
     "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 × world size 2 = 8"),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2,
     "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 × world size 2 = 8"),
    ({"train_batch_size": 10}, 4,
     "train_batch_size 10 is not divisible by gradient_accumulation_steps 1 × world size 4 = 4"),
])
def test_indivisible_batch_shows_the_arithmetic(given, world, shown):
    with pytest.raises(ConfigError, match=shown):
        load_config(given).batch(world)


@pytest.mark.parametrize("given, world, works", [
    ({"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2}, 2, "; train_batch_size 8 or 12 would work "
     "(a multiple of 4)"),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2, "; train_batch_size 24 or 32 would work (a "
     "multiple of 8), or gradient_accumulation_steps 1, 3, 5, 15 (the divisors of train_batch_size / world size = 15)"),
    ({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 8}, 4, "; train_batch_size 32 would work (a "
     "multiple of 32)"),
])
def test_indivisible_batch_says_which_values_would_work(given, world, works):
    with pytest.raises(ConfigError) as info:
        load_config(given).batch(world)
    assert str(info.value).endswith(works)


@pytest.mark.parametrize("given", [{}, {"gradient_accumulation_steps": 4}])
def test_batch_needs_train_or_micro_batch_size(given):
    with pytest.raises(ConfigError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        load_config(given).batch(2)


def test_batch_rejects_world_size_below_one():
    with pytest.raises(ConfigError, match="world size"):
        load_config({"train_batch_size": 8}).batch(0)


# ---- optimizer -------------------------------------------------------------------------------

def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("given, expected", [
    ({"type": "Adam", "params": {"weight_decay": 0.01}}, torch.optim.AdamW),  # DeepSpeed's default
    ({"type": "Adam", "params": {"adam_w_mode": False, "torch_adam": True}}, torch.optim.Adam),
    ({"type": "adamw", "params": {"adam_w_mode": False}}, torch.optim.AdamW),  # the name wins
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, torch.optim.SGD),
    ({"type": "adagrad"}, torch.optim.Adagrad),
    ({"type": "RMSPROP"}, torch.optim.RMSprop),
    ({"type": "Adamax"}, torch.optim.Adamax),
    ({"type": "NAdam"}, torch.optim.NAdam),
    ({"type": "RAdam"}, torch.optim.RAdam),
    ({"type": "Adadelta"}, torch.optim.Adadelta),
    ({"type": "ASGD"}, torch.optim.ASGD),
    ({"type": "Rprop"}, torch.optim.Rprop),
    ({"type": "Adafactor"}, torch.optim.Adafactor),
    ({"type": "Adam", "params": {"bias_correction": True}}, torch.optim.AdamW),  # FusedAdam's default
])
def test_optimizer_builds_the_torch_class(given, expected):
    optimizer = load_config({"optimizer": given}).optimizer.build(params())
    assert type(optimizer) is expected


def test_optimizer_hyperparameters_reach_torch():
    config = load_config(DATA / "ds_config_zero2.json")
    group = config.optimizer.build(params()).param_groups[0]
    assert group["lr"] == 0.00015 and group["weight_decay"] == 0.01 and tuple(group["betas"]) == (0.9, 0.999)


def test_unknown_optimizer_lists_supported_ones():
    message = error_of({"optimizer": {"type": "Sophia"}})
    assert "'optimizer.type' = \"Sophia\"" in message
    assert "Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam" in message


@pytest.mark.parametrize("name, reason", [
    ("Lamb", "DeepSpeed's own CUDA kernel"), ("OneBitAdam", "compresses DeepSpeed's gradient all-reduce"),
    ("ZeroOneAdam", "compresses"), ("OneBitLamb", "compresses"), ("Lion", "not in torch.optim"),
    ("MuAdam", "mup package"), ("MuAdamW", "mup package"), ("MuSGD", "mup package"),
    ("FusedAdam", "write \"Adam\""), ("CPUAdam", "offload_optimizer"), ("SparseAdam", "dense"),
    ("LBFGS", "closure"),
])
def test_deepspeed_only_optimizers_are_refused_with_reason_and_alternative(name, reason):
    message = error_of({"optimizer": {"type": name}})
    assert f"'optimizer.type' = \"{name}\"" in message and "not supported by zerodp" in message
    assert reason in message and ("AdamW" in message or "Adam" in message or "SGD" in message)


def test_deepspeed_muon_maps_onto_torch_muon_on_hidden_matrices_and_adamw_on_the_rest():
    config = Config.model_validate({"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "Muon", "params": {"lr": 0.02, "momentum": 0.9, "betas": [0.9, 0.95], "adam_lr": 3e-4}}})

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 8)
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
            self.lm_head = torch.nn.Linear(8, 11, bias=False)

    model = LM()
    muon, adamw = config.optimizer.for_model(model)
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    assert muon.param_groups[0]["params"] == [model.block[0].weight]
    assert muon.param_groups[0]["lr"] == 0.02 and muon.param_groups[0]["momentum"] == 0.9
    assert {id(p) for p in adamw.param_groups[0]["params"]} == {
        id(p) for p in model.parameters() if p is not model.block[0].weight}
    assert adamw.param_groups[0]["lr"] == 3e-4 and adamw.param_groups[0]["betas"] == (0.9, 0.95)
    model.lm_head.weight.use_muon = True  # DeepSpeed's tag wins
    assert len(config.optimizer.for_model(model)[0].param_groups[0]["params"]) == 2


def test_adam_without_bias_correction_is_refused():
    message = error_of({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}})
    assert "'optimizer.params.bias_correction' = false is not supported" in message


def test_unknown_optimizer_param_names_it_and_the_optimizer():
    message = error_of({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentom": 0.9}}})
    assert "'optimizer.params.momentom'" in message and "did you mean 'momentum'?" in message
    assert "SGD" in message


def test_optimizer_param_value_is_checked_by_torch_at_load():
    message = error_of({"optimizer": {"type": "Adam", "params": {"lr": -1.0}}})
    assert "'optimizer.params.lr' = -1.0 rejected by torch.optim.AdamW" in message and "learning rate" in message


def test_max_grad_norm_points_to_gradient_clipping():
    message = error_of({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})
    assert "optimizer.params.max_grad_norm" in message and "gradient_clipping" in message


def test_auto_optimizer_param_is_explained():
    message = error_of({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert "'optimizer.params.lr' = \"auto\"" in message and "Hugging Face Trainer" in message


def test_optimizer_type_is_required():
    assert "'optimizer.type' is required" in error_of({"optimizer": {"params": {}}})


# ---- learning-rate schedule ------------------------------------------------------------------

def lrs(scheduler_config: dict, steps: int, lr: float = 0.1) -> list[float]:
    """The lr the optimizer uses at each of `steps` optimizer steps."""
    optimizer = torch.optim.SGD(params(), lr=lr)
    scheduler = SchedulerConfig.model_validate(scheduler_config).build(optimizer)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_warmup_lr_log_follows_deepspeed_formula_then_holds():
    warmup, low, high = 10, 0.001, 0.01
    seen = lrs({"type": "WarmupLR", "params": {"warmup_min_lr": low, "warmup_max_lr": high,
                                               "warmup_num_steps": warmup}}, 15)
    # step t runs at DeepSpeed's get_lr(t - 1): the warmup's first value twice, as DeepSpeed's engine
    expected = [low] + [low + (high - low) * math.log(t + 1) / math.log(warmup) for t in range(warmup)]
    assert seen[:warmup + 1] == pytest.approx(expected, rel=1e-12)
    assert seen[warmup + 1:] == pytest.approx([high] * 4, rel=1e-12)


def test_warmup_lr_linear_and_default_peak_is_optimizer_lr():
    seen = lrs({"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}, 6, lr=0.2)
    assert seen == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.15, 0.2])


def test_warmup_decay_lr_decays_linearly_to_zero():
    seen = lrs({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear",
                                                    "warmup_max_lr": 0.4, "total_num_steps": 8}}, 10)
    assert seen == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.3, 0.2, 0.1, 0.0])


def test_warmup_cosine_lr_scales_optimizer_lr_and_ends_at_min_ratio():
    config = {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5,
                                                   "warmup_type": "linear", "cos_min_ratio": 0.1}}
    seen = lrs(config, 25, lr=0.5)[1:]  # step 0 runs at DeepSpeed's constructor value, 0
    assert seen[:5] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert seen[4] < seen[5] and seen[5] == pytest.approx(0.5 * (0.1 + 0.9 * (1 + math.cos(math.pi / 15)) / 2))
    decay = seen[5:20]
    assert all(a > b for a, b in zip(decay, decay[1:]))  # monotone cosine decay
    assert seen[19:] == pytest.approx([0.05] * 5)  # min ratio × optimizer lr, held after the end


def test_unknown_scheduler_param_suggests_closest():
    message = error_of({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})
    assert message == "unknown config key 'scheduler.params.warmup_num_step'; did you mean 'warmup_num_steps'?"


def test_unknown_scheduler_type_lists_supported_ones():
    message = error_of({"scheduler": {"type": "CosineAnnealing"}})
    assert "'scheduler.type' = \"CosineAnnealing\"" in message and "WarmupCosineLR" in message
    assert "OneCycle" in message and "LRRangeTest" in message


def test_scheduler_needs_total_num_steps_after_warmup():
    assert "'scheduler.params.total_num_steps' is required" in error_of(
        {"scheduler": {"type": "WarmupDecayLR", "params": {}}})
    message = error_of({"scheduler": {"type": "WarmupCosineLR",
                                      "params": {"total_num_steps": 10, "warmup_num_steps": 10}}})
    assert "'scheduler.params.total_num_steps' = 10" in message and "warmup_num_steps" in message


def test_auto_scheduler_param_is_explained():
    message = error_of({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}})
    assert "'scheduler.params.warmup_num_steps' = \"auto\"" in message and "placeholder" in message


def test_optimizer_and_scheduler_sections_validate_standalone():
    assert OptimizerConfig(type="sgd").type == "SGD"
    assert SchedulerConfig(type="warmuplr").type == "WarmupLR"


INF = float("inf")
_OPT = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
_SCHED = {**_OPT, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}


def _with_opt(**params):
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}}}


@pytest.mark.parametrize("config,key", [
    (_with_opt(weight_decay=INF), "optimizer.params.weight_decay"),
    (_with_opt(lr=INF), "optimizer.params.lr"),
    (_with_opt(eps=INF), "optimizer.params.eps"),
    (_with_opt(lr=True), "optimizer.params.lr"),
    (_with_opt(betas=[0.9]), "optimizer.params.betas"),
    (_with_opt(betas={"beta1": 0.9, "beta2": 0.99}), "optimizer.params.betas"),
    (_with_opt(amsgrad=1), "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "AdamW", "params": [1e-3]}}, "optimizer.params"),
    ({**_SCHED, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": INF}}}, "scheduler.params.warmup_max_lr"),
    ({**_SCHED, "scheduler": {"type": "WarmupLR", "params": [1e-3]}}, "scheduler.params"),
    ({"gradient_clipping": INF}, "gradient_clipping"),
    ({"fp16": {"enabled": True, "loss_scale": INF}}, "fp16.loss_scale"),
    ({"fp16": {"enabled": True, "min_loss_scale": INF}}, "fp16.min_loss_scale"),
    ({"comm_timeout_s": 1e30}, "comm_timeout_s"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_hyperparameters_that_cannot_be_right_are_refused_naming_the_key(config, key):
    with pytest.raises(ConfigError, match=f"config key '{re.escape(key)}' = "):
        load_config(config)


def test_torch_rejecting_one_optimizer_value_names_its_key():
    message = error_of(_with_opt(betas=[0.9, 1.5], eps=1e-8))
    assert "'optimizer.params.betas' = [0.9, 1.5] rejected by torch.optim.AdamW" in message


# ---- typed overlays: a framework's or a job's settings over the user's config ----------------------------

def test_under_framework_fills_what_the_config_left_unset_and_keeps_the_rest():
    user = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000},
                        "bf16": {"enabled": True, "immediate_grad_update": True}})
    from zerodp.config import Said
    config = user.under_framework(gradient_accumulation_steps=Said(4, "accumulate_grad_batches says 4"),
                                  gradient_clipping=Said(0.5, "gradient_clip_val says 0.5"),
                                  dtype=Said("bf16", "the precision is 'bf16-mixed'"), micro_batch_size=3)
    assert (config.gradient_accumulation_steps, config.gradient_clipping, config.train_micro_batch_size_per_gpu) == (
        4, 0.5, 3)
    assert config.bf16.enabled and config.bf16.immediate_grad_update and not config.fp16.enabled
    assert (config.zero_optimization.stage, config.zero_optimization.reduce_bucket_size) == (3, 1000)
    assert user.gradient_accumulation_steps is None  # the user's config is left alone
    # a batch size the config gives is the config's: the framework's loader size only fills an absent one
    assert load_config({"train_batch_size": 8}).under_framework(micro_batch_size=3).train_micro_batch_size_per_gpu is None
    assert load_config({"train_micro_batch_size_per_gpu": 2}).under_framework(
        micro_batch_size=3).train_micro_batch_size_per_gpu == 2


@pytest.mark.parametrize("given, said, words", [
    ({"gradient_accumulation_steps": 2}, {"gradient_accumulation_steps": (3, "accumulate_grad_batches says 3")},
     "the zerodp config has gradient_accumulation_steps=2 but accumulate_grad_batches says 3; give it in one place"),
    ({"gradient_clipping": 1.0}, {"gradient_clipping": (0.5, "gradient_clip_val says 0.5")},
     "the zerodp config has gradient_clipping=1.0 but gradient_clip_val says 0.5; give it in one place"),
    ({"fp16": {"enabled": True}}, {"dtype": ("bf16", "the precision is 'bf16-mixed'")},
     "the zerodp config enables fp16 but the precision is 'bf16-mixed'"),
    ({"bf16": {"enabled": True}}, {"dtype": ("fp32", "the precision is '32-true'")},
     "the zerodp config enables bf16 but the precision is '32-true'"),
])
def test_under_framework_refuses_a_config_that_contradicts_the_framework_naming_both(given, said, words):
    from zerodp.config import Said
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(given).under_framework(**{k: Said(*v) for k, v in said.items()})
    load_config(given).under_framework(**{k: Said(given.get(k, v[0]), v[1]) for k, v in said.items()
                                          if k != "dtype"})  # the same value repeated is no conflict


def test_for_job_puts_the_jobs_settled_options_over_the_file_and_drops_what_the_job_builds():
    ds = load_config({"train_batch_size": 32, "gradient_clipping": 2.0, "steps_per_print": 5,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                      "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                            "reduce_bucket_size": 1000}})
    config = ds.for_job(stage=2, offload_optimizer="none", nvme_path=None, dtype="bf16", micro_batch_size=4,
                        gradient_accumulation_steps=2, gradient_clipping=1.0, comm_timeout_s=30.0,
                        non_finite_policy="skip")
    assert (config.train_batch_size, config.optimizer, config.scheduler) == (None, None, None)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 2)
    assert (config.gradient_clipping, config.comm_timeout_s, config.non_finite.policy) == (1.0, 30.0, "skip")
    assert config.bf16.enabled and not config.fp16.enabled and config.steps_per_print == 5
    zero = config.zero_optimization
    assert (zero.stage, zero.offload_optimizer.device, zero.offload_optimizer.pin_memory) == (2, "none", True)
    assert zero.reduce_bucket_size == 1000
