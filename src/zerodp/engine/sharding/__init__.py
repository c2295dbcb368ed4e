"""The sharded module: a model whose parameters live in flat buckets, gathered for compute, released after,
kept equal, streamed out; it trains nothing (stepping/ adds training).

  module.py          `ShardedModule`: set-up (cast, buckets filled, gatherer), forward, gathered_parameters and
                     writes through it (`adopted`), the weights stream, memory_report; `zerodp.shard` returns it.

  gather.py          `Gatherer`: stage 3's per-unit all-gather before use and release after, with prefetch
                     and a bounded wait; one `BucketRecord` per bucket (`BucketState`).
  pool.py            where gathered buckets get their memory: a pool of host slots allocated once
                     (`Pooled`), or storage resize_ on an accelerator (`Resized`).
  whereabouts.py     `Whereabouts`: what a stage-3 gather is for, named when one times out.
  on_disk.py         `ShardsOnDisk`: stage 3's parameter shards in a file of the rank's (offload_param "nvme"),
                     read ahead of their gathers through a few host buffers, written back after a step.
  scratch.py         `ScratchFile`: a rank's O_DIRECT scratch file under an nvme_path, and its aligned buffers
                     (both disk tiers': stepping/disk.py uses it too).
  gathered_state.py  `GatheredStateDict`: module.state_dict() at stage 3, its parameters gathered.
  buffers.py         `BufferSync`: rank 0's floating buffers broadcast before each forward.
  weights.py         `engine_weights`: the model's values as a stream, one bucket at a time, for export.
  memory.py          `memory_report`: the bytes a sharded module and its training part hold, measured.
"""
