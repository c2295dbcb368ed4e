"""Tensor parallelism inside the engine (a (dp, tp) mesh or an mpu): placements, gradients, whole matrices.

  placements.py  a parameter's placement over tp (`shard_dim`) and the set-up check of a tp model (`check`).
  grads.py       `GradPlacements`: a gradient entered in its parameter's placement, partial sums over tp.
  whole.py       `WholeOverTp`: a shape-aware optimizer's tp-sharded matrix gathered whole for its step, and
                 the `refusal` of a shard that cannot be.
"""
