"""One training step, sharded: the engine (engine.py) and the pieces it ties together, each named as
in the ZeRO paper. flat.py lays parameters out in flat padded buffers and partitions them; reducer.py
buckets gradients and reduce-scatters them during backward; optimizer.py steps the user's optimizer on
the fp32 master shard and all-gathers the result; stage3.py gathers partitioned parameters before use
and releases them after; precision.py and non_finite.py hold the loss scale and the skipped step;
unused.py, forward_order.py and buffers.py handle parameters a step leaves unused, the gather order of
the next forward, and floating buffers; memory.py measures what all of it holds."""
