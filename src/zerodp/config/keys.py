"""Which config keys do nothing here, and which values zerodp refuses: the one place that says so.

Every key of the config model either has an effect (tested; tests/test_config_keys.py names the test),
or is listed in NO_EFFECT (it tunes a DeepSpeed internal that has no counterpart in zerodp: accepted so
that DeepSpeed configs load, and documented in docs/DEEPSPEED.md), or is listed in REFUSED with the one
value zerodp accepts (DeepSpeed's default) and, for any other value, why not and what to use instead.
tests/test_config_keys.py walks the model and fails when a key is in none of these.
"""

from __future__ import annotations

import json
from typing import Any

# key path -> why it has no effect in zerodp.
NO_EFFECT: dict[str, str] = {
    "zero_allow_untested_optimizer": "zerodp's ZeRO steps any torch.optim optimizer on its flat shards; "
                                     "there is no list of tested optimizers to allow beyond",
    "zero_force_ds_cpu_optimizer": "with offload_optimizer the torch optimizer itself steps on the CPU "
                                   "(fused Adam); there is no DeepSpeed CPUAdam to force",
    "cuda_visible_devices": "DeepSpeed does not read it either (its launcher's --include / --exclude pick "
                            "devices); set CUDA_VISIBLE_DEVICES in the environment",
    "dump_state": "DeepSpeed's debug print of its engine's settings at start-up; zerodp prints nothing",
    "disable_allgather": "a DeepSpeed stage-0 switch between all-gather and broadcast for replicated "
                         "parameters; zerodp's stage 0 gathers nothing",
    "optimizer.legacy_fusion": "a choice among DeepSpeed's fp16 optimizer kernels; torch's optimizer is the "
                               "only one here",
    "fp16.auto_cast": "the engine always casts floating inputs to the working precision",
    "bf16.immediate_grad_update": "a DeepSpeed bf16-optimizer scheduling detail; gradients are reduced in "
                                  "buckets during backward as always",
    "bf16.check_grad_overflow": "every step checks the global gradient norm for inf/nan in every precision "
                                "(see the non_finite section)",
    "zero_optimization.contiguous_gradients": "gradients are always copied into contiguous buckets",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter and stage 0 all-reduces; "
                                        "DeepSpeed's all-reduce alternative gives the same values",
    "zero_optimization.allgather_partitions": "updated shards are always all-gathered into the flat buffers",
    "zero_optimization.use_multi_rank_bucket_allreduce": "a DeepSpeed mixture-of-experts all-reduce detail",
    "zero_optimization.compute_grad_norm": "the global gradient norm is always computed (clipping, the "
                                          "non-finite check and engine.grad_norm need it)",
    "zero_optimization.round_robin_gradients": "each bucket is split evenly across ranks, so gradient copies "
                                               "are already balanced without DeepSpeed's round-robin order",
    "zero_optimization.elastic_checkpoint": "zerodp's checkpoints always load on any world size",
    "zero_optimization.parameter_alignment": "every parameter is always aligned to 64 elements in its bucket",
    "zero_optimization.memory_efficient_linear": "a DeepSpeed stage-3 replacement of nn.Linear's autograd; "
                                                 "zerodp leaves the model's modules unchanged",
    "zero_optimization.stage3_max_live_parameters": "stage 3 frees each unit's gathered parameters after "
                                                    "its backward; what is live is bounded by "
                                                    "stage3_prefetch_bucket_size, not by this count",
    "zero_optimization.stage3_max_reuse_distance": "stage 3 frees each unit's gathered parameters after its "
                                                   "backward; there is no reuse-distance cache",
    "zero_optimization.stage3_module_granularity_threshold": "stage 3 gathers per unit, which stage3_unit "
                                                             "chooses (blocks by default), not by this ratio",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "parameters are fetched with all-gather; "
                                                                "DeepSpeed's all-reduce gives the same values",
    "zero_optimization.stage3_allgather_sequential": "a DeepSpeed stage-3 launch-order detail",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "the old name of "
                                                                  "stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.override_module_apply": "a DeepSpeed zero.Init detail; zerodp partitions after the "
                                               "model is built",
    "zero_optimization.log_trace_cache_warnings": "DeepSpeed's stage-3 trace cache does not exist here",
    "zero_optimization.enable_sanity_checks": "a DeepSpeed stage-3 debugging switch",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "sizes DeepSpeed's CPUAdam thread pool; the "
                                                              "torch optimizer uses torch's threads "
                                                              "(torch.set_num_threads)",
    **{f"comet.{k}": "the comet section is refused when enabled (zerodp has no Comet monitor)"
       for k in ("samples_log_interval", "project", "workspace", "api_key", "experiment_name", "experiment_key",
                 "online", "mode")},
    **{f"flops_profiler.{k}": "the flops_profiler section is refused when enabled (use "
                              "torch.utils.flop_counter.FlopCounterMode)"
       for k in ("recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed", "output_file")},
    **{f"hybrid_engine.{k}": "the hybrid_engine section is refused when enabled (zerodp has no inference "
                             "engine to switch to)"
       for k in ("max_out_tokens", "inference_tp_size", "release_inference_cache", "pin_parameters",
                 "tp_gather_partition_size", "enable_cuda_graph")},
    "activation_checkpointing.profile": "DeepSpeed's timing print of checkpointed forwards",
    "checkpoint.parallel_write.pipeline_stage": "pipeline parallelism does not exist in zerodp; every rank "
                                                "writes its own shard files already",
}

_ZPP = ("ZeRO++ quantized communication is not implemented; set communication_data_type to \"bf16\" "
        "to halve the gradient traffic instead")

# key path -> (the one accepted value, why another is refused and what to use instead).
REFUSED: dict[str, tuple[Any, str]] = {
    "sparse_gradients": (False, "gradients are reduced in dense buckets; use nn.Embedding(sparse=False)"),
    "fp16.fp16_master_weights_and_grads": (False, "fp16 masters would lose fp32's range and the updates "
                                                  "below fp16's precision (fp32 does not split into an fp16 "
                                                  "half and a 16-bit remainder as it does for bf16); use bf16 "
                                                  "with bf16.bf16_master_weights_and_grads, or remove the key"),
    "zero_optimization.load_from_fp32_weights": (True, "zerodp always restores the fp32 masters from the "
                                                       "checkpoint's fp32 weights; remove the key"),
    "zero_optimization.ignore_unused_parameters": (True, "a parameter without a gradient is always allowed "
                                                         "(DeepSpeed's true): it is not stepped, as in PyTorch "
                                                         "(step_unused_parameters: true steps it with a zero "
                                                         "gradient, as DeepSpeed does); remove the key"),
    "zero_optimization.legacy_stage1": (False, "DeepSpeed's old stage-1 code path; use stage 1"),
    "zero_optimization.cpu_offload_use_pin_memory": (False, "DeepSpeed's old key; use "
                                                           "zero_optimization.offload_optimizer.pin_memory"),
    "zero_optimization.cpu_offload_params": (False, "DeepSpeed's old key; use zero_optimization.offload_param"),
    "zero_optimization.stage3_model_persistence_threshold": (
        None, "zerodp has no model-wide cap on persistent parameters; lower "
              "stage3_param_persistence_threshold to keep fewer parameters gathered"),
    "zero_optimization.zero_hpz_partition_size": (
        1, "ZeRO++'s secondary copy of the stage-3 parameters is not implemented; use mics_shard_size (the "
           "same intra-node gathers, with every model state sharded within the group)"),
    "zero_optimization.mics_hierarchical_params_gather": (
        False, "zerodp all-gathers parameters inside the shard group in one collective; the two-hop "
               "(inter-node, then intra-node) gather is not implemented: keep mics_shard_size within a node"),
    "zero_optimization.zero_quantized_weights": (False, _ZPP),
    "zero_optimization.zero_quantized_nontrainable_weights": (False, _ZPP),
    "zero_optimization.zero_quantized_gradients": (False, _ZPP),
    "zero_optimization.pipeline_loading_checkpoint": (False, "pipeline parallelism does not exist in zerodp"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (False, "Muon's momentum is the optimizer state of "
                                                                     "the rank that owns each matrix whole"),
    "zero_optimization.leaf_module": (None, "stage 3 gathers per unit; name the units' classes or modules "
                                            "in zero_optimization.stage3_unit instead"),
    "zero_optimization.zenflow": (None, "DeepSpeed's ZenFlow (asynchronous offloaded updates) is not "
                                        "implemented; use offload_optimizer"),
    "zero_optimization.offload_optimizer.ratio": (1.0, "partial offload is not implemented: the whole "
                                                       "optimizer is offloaded; remove the key"),
    "zero_optimization.offload_optimizer.super_offload": (False, "DeepSpeed's SuperOffload is not "
                                                                 "implemented; use offload_optimizer"),
    "activation_checkpointing.partition_activations": (
        False, "partitioning activations only has meaning with a model-parallel (tensor-parallel) group, "
               "which zerodp's plain data parallelism does not have, so activations are not partitioned; "
               "use cpu_checkpointing to move them off the accelerator"),
    "hybrid_engine.enabled": (False, "DeepSpeed's hybrid engine swaps the training model into DeepSpeed's "
                                     "inference kernels (with their own tensor parallelism) to generate, "
                                     "which zerodp does not have; generate with the module itself "
                                     "(engine.module in eval mode, under torch.no_grad()) and set it to false"),
    "aio.overlap_events": (True, "the disk tier's requests always complete while others are submitted (a "
                                 "thread pool); pipeline_read and pipeline_write choose what overlaps the step"),
    "checkpoint.load_universal": (False, "zerodp's own checkpoints load on any world size without "
                                         "conversion, and DeepSpeed ZeRO checkpoints are read directly "
                                         "(engine.load_checkpoint); load one of those instead"),
    "checkpoint.use_node_local_storage": (False, "checkpoints are written to one shared directory; "
                                                 "point save_dir at node-local storage yourself if you "
                                                 "need it (every rank must read every shard on resume)"),
}


def _value_at(config: Any, path: str) -> tuple[bool, Any]:
    """(found, value) of the dotted `path` in a Config; not found when a section on the way is None."""
    node = config
    for part in path.split("."):
        if node is None or not hasattr(node, part):
            return False, None
        node = getattr(node, part)
    return True, node


def refusals(config: Any) -> list[str]:
    """One line for each refused key set to a value other than the one accepted."""
    lines = []
    for path, (accepted, reason) in REFUSED.items():
        found, value = _value_at(config, path)
        if found and value != accepted:
            shown = json.dumps(value, default=str)
            lines.append(f"config key {path!r} = {shown} is not supported: {reason}")
    return lines
