"""Sharded parameters in use: gathered for compute, released after, kept equal, streamed out.

  gather.py          `Gatherer`: stage 3's per-unit all-gather before use and release after, with prefetch
                     and a bounded wait (`BucketState`).
  gathered_state.py  `GatheredStateDict`: module.state_dict() at stage 3, its parameters gathered.
  buffers.py         `BufferSync`: rank 0's floating buffers broadcast before each forward.
  weights.py         `engine_weights`: the engine's values as a stream, one bucket at a time, for export.
"""
