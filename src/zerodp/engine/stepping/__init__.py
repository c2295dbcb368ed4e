"""Training added to a sharded module: gradients reduced, the user's optimizer stepped on shards, precision
and skips.

  training.py        `Training`: backward, step (decided on the host or the device, settled on one path),
                     no_sync, the counters, and the model states checkpoint/ reads (masters, step counts).

  reducer.py         `Reducer`: gradients into buckets during backward, reduced (-scattered) per bucket.
  optimizer.py       `PartitionedOptimizer`: the user's optimizer on this rank's fp32 master shards, and the
                     all-gather of the result.
  optimizer_view.py  what an optimizer may see (`view_of`, `refusal`), `OptimizerLike`, `Optimizers` (a list
                     stepped as one).
  torch_state.py     `TorchFormat`: optimizer.state_dict() / load_state_dict() in a plain optimizer's format over
                     the model's parameters (gathered from every rank; cut into shards on load).
  low_precision.py   bf16 masters (the working value + an int16 remainder, exact) and bf16 optimizer states
                     (stochastically rounded): `OptimizerPrecision`, `StateRounding`.
  offload.py         ZeRO-Offload's host side: `HostShards`, the fused CPU kernel, `pinned_bytes`.
  disk.py            ZeRO-Infinity's disk tier (offload_optimizer "nvme"): `DiskTier`, the masters and states in
                     a scratch file streamed through a bounded pool of host buffers.
  precision.py       `LossScaler`: fp16's dynamic loss scale.
  non_finite.py      a step with a non-finite gradient norm or loss: skip, log or raise, on host or device.
  unused.py          `UsedParameters`: only the parameters that got a gradient are stepped.
  forward_order.py   `ForwardOrder`: overlap_param_gather's gather order of the next forward.
  cpu_bf16.py        `warn_if_slow_bf16`: bf16 on a CPU without fast bf16 kernels, said once.
"""
