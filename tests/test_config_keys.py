"""Every config key has an effect (a named test), no effect here (config/keys.py NO_EFFECT, documented), or is
refused (keys.REFUSED): the walk below fails when a key is added without one of the three.

To add a key: give it a test and add it to EFFECTS here, or add it to NO_EFFECT / REFUSED with its reason
(and to docs/DEEPSPEED.md's "Config keys" table).
"""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from zerodp.config import Config, ConfigError, load_config
from zerodp.config.keys import NO_EFFECT, REFUSED
from zerodp.config.scheduler import PARAMS

TESTS = Path(__file__).parent
DOCS = TESTS.parent / "docs" / "DEEPSPEED.md"

# key path -> the test that shows its effect ("file.py::test_name").
EFFECTS = {
    "train_batch_size": "test_config.py::test_batch_sizes_follow_deepspeed_rule",
    "train_micro_batch_size_per_gpu": "test_config.py::test_batch_sizes_follow_deepspeed_rule",
    "gradient_accumulation_steps": "test_accumulation.py::test_backward_step_pattern_matches_pytorch_accumulate_then_step",
    "gradient_clipping": "test_engine.py::test_matches_single_process_fp32",
    "prescale_gradients": "test_reduction.py::test_where_the_division_by_the_world_happens_is_deepspeeds",
    "gradient_predivide_factor":
        "test_reduction.py::test_where_the_division_by_the_world_happens_is_deepspeeds",
    "communication_data_type": "test_reduction.py::test_bf16_gradients_reduced_in_fp32_are_closer_to_the_exact_mean",
    "seed": "test_reduction.py::test_seed_seeds_every_rank_with_seed_plus_rank",
    "broadcast_buffers": "test_buffers.py::test_broadcast_buffers_false_leaves_each_rank_its_own_running_stats",
    "collectives": "test_collective_plan.py::test_an_engine_trains_to_the_same_weights_with_either_implementation",
    "comm_timeout_s": "test_divergence.py::test_comm_timeout_s_bounds_zerodp_collectives_on_the_scripts_own_group",
    "wait_notice_s": "test_divergence.py::test_a_plain_slow_rank_gets_waiting_lines_and_no_error",
    "fp16.enabled": "test_engine.py::test_low_precision_matches_within_its_precision",
    "fp16.loss_scale": "test_non_finite.py::test_fp16_static_loss_scale_overflows_count",
    "fp16.initial_scale_power": "test_precision.py::test_dynamic_loss_scale_follows_deepspeeds_scaler",
    "fp16.loss_scale_window": "test_precision.py::test_dynamic_loss_scale_follows_deepspeeds_scaler",
    "fp16.hysteresis": "test_precision.py::test_dynamic_loss_scale_follows_deepspeeds_scaler",
    "fp16.consecutive_hysteresis": "test_precision.py::test_dynamic_loss_scale_follows_deepspeeds_scaler",
    "fp16.min_loss_scale": "test_precision.py::test_dynamic_loss_scale_follows_deepspeeds_scaler",
    "bf16.enabled": "test_initialize.py::test_bf16_engine_casts_inputs_and_keeps_fp32_masters",
    "bf16.bf16_master_weights_and_grads":
        "test_engine.py::test_bf16_masters_and_optimizer_states_match_fp32_masters_within_their_rounding",
    "bf16.bf16_optimizer_states":
        "test_engine.py::test_bf16_masters_and_optimizer_states_match_fp32_masters_within_their_rounding",
    "zero_optimization.stage": "test_engine.py::test_matches_single_process_fp32",
    "zero_optimization.reduce_bucket_size": "test_engine.py::test_bucketed_overlapped_and_single_bucket_runs_are_identical",
    "zero_optimization.allgather_bucket_size":
        "test_engine.py::test_bucketed_overlapped_and_single_bucket_runs_are_identical",
    "zero_optimization.overlap_comm": "test_engine.py::test_bucketed_overlapped_and_single_bucket_runs_are_identical",
    "zero_optimization.overlap_param_gather": "test_engine.py::test_parameter_gather_overlapped_with_next_forward_matches",
    "zero_optimization.offload_optimizer.device": "test_engine.py::test_offload_matches_single_process_fp32",
    "zero_optimization.offload_optimizer.pin_memory": "test_engine.py::test_offload_matches_single_process_fp32",
    "zero_optimization.offload_optimizer.nvme_path": "test_nvme.py::test_a_missing_nvme_path_is_a_clear_error_at_initialize",
    "zero_optimization.offload_optimizer.buffer_count":
        "test_nvme.py::test_too_few_buffers_for_the_pipeline_is_refused_naming_the_count",
    "zero_optimization.offload_optimizer.pipeline_read":
        "test_nvme.py::test_pipeline_read_and_write_overlap_the_transfers_with_the_step",
    "zero_optimization.offload_optimizer.pipeline_write":
        "test_nvme.py::test_pipeline_read_and_write_overlap_the_transfers_with_the_step",
    "zero_optimization.offload_optimizer.fast_init": "test_nvme.py::test_fast_init_writes_only_the_masters_at_initialize",
    **{f"aio.{k}": "test_nvme.py::test_aio_keys_shape_the_requests"
       for k in ("block_size", "queue_depth", "thread_count", "single_submit")},
    "zero_optimization.stage3_prefetch_bucket_size":
        "test_engine.py::test_bucketed_overlapped_and_single_bucket_runs_are_identical",
    "zero_optimization.stage3_param_persistence_threshold":
        "test_engine.py::test_bucketed_overlapped_and_single_bucket_runs_are_identical",
    "zero_optimization.stage3_unit": "test_stage3_units.py::test_blocks_take_fewer_collectives_than_modules",
    "zero_optimization.sub_group_size": "test_optimizer.py::test_step_in_sub_groups_is_the_same_step_with_a_smaller_fp32_copy",
    "activation_checkpointing.cpu_checkpointing": "test_activations.py::test_cpu_checkpointing_releases_the_device_copy",
    "activation_checkpointing.contiguous_memory_optimization":
        "test_activations.py::test_contiguous_buffer_holds_every_checkpoint_without_allocating",
    "activation_checkpointing.number_checkpoints": "test_activations.py::test_too_few_contiguous_slots_is_a_clear_error",
    "activation_checkpointing.synchronize_checkpoint_boundary":
        "test_activations.py::test_checkpointed_training_matches_plain_training_fp32",
    "non_finite.policy": "test_non_finite.py::test_skip_policy_never_raises",
    "non_finite.max_consecutive_skips": "test_non_finite.py::test_raise_policy_raises_on_every_rank_after_k_consecutive_skips",
    "non_finite.read_back": "test_host_sync.py::test_a_step_skipped_on_the_device_trains_exactly_as_one_skipped_by_the_host",
    "data_types.grad_accum_dtype": "test_reduction.py::test_grad_accum_dtype_sets_the_accumulation_dtype",
    "checkpoint.tag_validation": "test_reduction.py::test_checkpoint_tags_differing_between_ranks_fail_on_every_rank",
    "optimizer.type": "test_config.py::test_optimizer_builds_the_torch_class",
    "optimizer.params": "test_config.py::test_optimizer_hyperparameters_reach_torch",
    "scheduler.type": "test_schedules.py::test_lr_at_every_step_is_deepspeeds",
    "scheduler.params": "test_schedules.py::test_lr_at_every_step_is_deepspeeds",
    "steps_per_print": "test_monitor.py::test_steps_per_print_logs_one_line_every_n_steps_with_the_steps_numbers",
    "wall_clock_breakdown": "test_monitor.py::test_wall_clock_breakdown_times_every_phase_of_the_last_step",
    **{f"{section}.{k}": test for section, keys, test in (
        ("tensorboard", ("enabled", "output_path", "job_name"),
         "test_monitor.py::test_tensorboard_monitor_writes_scalars_tensorboard_reads"),
        ("csv_monitor", ("enabled", "output_path", "job_name"),
         "test_monitor.py::test_csv_monitor_writes_one_file_per_event_in_deepspeeds_layout"),
        ("wandb", ("enabled", "group", "team", "project"),
         "test_monitor.py::test_wandb_monitor_starts_a_run_with_the_configs_names_and_logs_each_event"),
        ("comms_logger", ("enabled", "verbose", "prof_all", "debug"),
         "test_monitor.py::test_comms_logger_counts_every_collective_with_its_message_size"),
        ("comms_logger", ("prof_ops",), "test_monitor.py::test_comms_logger_prof_ops_records_only_the_named_collectives"),
        ("comet", ("enabled",), "test_monitor.py::test_sections_zerodp_does_not_implement_are_refused_when_enabled"),
        ("flops_profiler", ("enabled",),
         "test_monitor.py::test_sections_zerodp_does_not_implement_are_refused_when_enabled"),
    ) for k in keys},
    "zero_optimization.offload_param.device":
        "test_offload_param.py::test_stage3_offload_param_keeps_the_shards_in_host_memory_and_reports_them_there",
    "zero_optimization.offload_param.pin_memory":
        "test_offload_param.py::test_stage3_offload_param_on_cuda_holds_only_gathered_windows_on_the_device",
    "zero_optimization.offload_param.nvme_path":
        "test_nvme.py::test_a_missing_nvme_path_is_a_clear_error_at_initialize",
    "zero_optimization.offload_param.buffer_count":
        "test_nvme.py::test_parameter_shards_are_read_ahead_through_buffer_count_buffers",
    "zero_optimization.offload_param.buffer_size":
        "test_nvme.py::test_a_shard_larger_than_buffer_size_is_refused_naming_the_size",
    "zero_optimization.offload_param.max_in_cpu":
        "test_nvme.py::test_max_in_cpu_elements_of_shards_stay_in_host_memory",
    "zero_optimization.cpu_offload": "test_config_keys.py::test_cpu_offload_is_deepspeeds_old_name_for_offload_optimizer",
    "zero_optimization.step_unused_parameters": "test_unused.py::test_step_unused_parameters_true_decays_them_as_deepspeed_does",
    "zero_optimization.mics_shard_size": "test_hierarchical.py::test_world4_matches_single_process",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        "test_deepspeed_api.py::test_save_16bit_model_at_stage_3_needs_the_gather_key_as_deepspeed",
}
PENDING: set[str] = set()  # keys whose effect is still to come (none now)


def _sections(annotation) -> list[type[BaseModel]]:
    args = (annotation, *typing.get_args(annotation))
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]


def walk(model: type[BaseModel], prefix: str = ""):
    """(dotted path, field) of every key of `model`, nested sections included; the optimizer's and the
    scheduler's `params` are free-form here (their keys: torch's signature and config/scheduler.py's PARAMS)."""
    for name, field in model.model_fields.items():
        path = prefix + name
        sections = _sections(field.annotation)
        if sections:
            yield from walk(sections[0], path + ".")
        else:
            yield path, field


KEYS = dict(walk(Config))


def _test_exists(ref: str) -> bool:
    file, name = ref.split("::")
    tree = ast.parse((TESTS / file).read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_key_has_an_effect_no_effect_or_refusal():
    registries = {"EFFECTS": set(EFFECTS), "NO_EFFECT": set(NO_EFFECT), "REFUSED": set(REFUSED), "PENDING": PENDING}
    unclassified = [k for k in KEYS if not any(k in r for r in registries.values())]
    assert not unclassified, f"keys with no test, no NO_EFFECT entry and no refusal: {unclassified}"
    twice = [k for k in KEYS if sum(k in r for r in registries.values()) > 1]
    assert not twice, f"keys in more than one registry: {twice}"
    stale = [k for r in registries.values() for k in r if k not in KEYS]
    assert not stale, f"registry entries that are not config keys: {stale}"


def test_every_effect_names_a_test_that_exists():
    missing = [ref for ref in set(EFFECTS.values()) if not _test_exists(ref)]
    assert not missing, missing


def test_every_scheduler_param_is_exercised_by_deepspeeds_reference_sequences():
    cases = json.loads((TESTS / "data" / "deepspeed_schedules.json").read_text())["cases"]
    for kind, params in PARAMS.items():
        given = {k for c in cases if c["type"] == kind for k in c["params"]}
        assert given == set(params.model_fields), (kind, set(params.model_fields) - given)


def _set(path: str, value) -> dict:
    config: dict = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}} if path.startswith("optimizer.") else {}
    node = config
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return config


def _other_value(path: str, avoid):
    """A JSON value of the key's type that differs from `avoid`."""
    annotation = str(KEYS[path].annotation)
    if "bool" in annotation:
        return not avoid if isinstance(avoid, bool) else True
    if "dict" in annotation:
        return {"classes": ["Block"]}
    if "str" in annotation:
        return "/local_nvme"
    if "float" in annotation:
        return 0.5 if avoid != 0.5 else 0.25
    return (avoid + 1) if isinstance(avoid, int) else 1


@pytest.mark.parametrize("path", sorted(NO_EFFECT))
def test_no_effect_keys_load_with_any_value_and_are_documented(path):
    default = KEYS[path].get_default(call_default_factory=True)
    assert load_config(_set(path, _other_value(path, default))) is not None
    assert f"`{path}`" in DOCS.read_text(), f"{path} is missing from docs/DEEPSPEED.md"


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_refused_values_name_the_key_say_why_and_the_accepted_value_loads(path):
    accepted, reason = REFUSED[path]
    with pytest.raises(ConfigError) as info:
        load_config(_set(path, _other_value(path, accepted)))
    assert f"config key '{path}' = " in str(info.value) and f"is not supported: {reason}" in str(info.value)
    if accepted is not None:
        load_config(_set(path, accepted))
    assert f"`{path}`" in DOCS.read_text(), f"{path} is missing from docs/DEEPSPEED.md"


def test_refusals_are_all_listed_one_per_line():
    message = str(pytest.raises(ConfigError, load_config, {
        "zero_optimization": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2},
        "checkpoint": {"load_universal": True}}).value)
    assert len(message.splitlines()) == 3


def test_bfloat16_is_deepspeeds_old_name_for_bf16():
    assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled
    with pytest.raises(ConfigError, match="both 'bf16' and its old name 'bfloat16'"):
        load_config({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})


def test_cpu_offload_is_deepspeeds_old_name_for_offload_optimizer():
    assert load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_optimization.offload_optimizer.device == "cpu"
    assert load_config({"zero_optimization": {"cpu_offload": False}}).zero_optimization.offload_optimizer.device == "none"
    with pytest.raises(ConfigError, match="keep only offload_optimizer"):
        load_config({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
