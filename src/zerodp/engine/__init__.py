"""One training step, sharded: the engine (engine.py) and the pieces it ties together, each named as
in the ZeRO paper. spec.py decides the engine's facts once (EngineSpec), by a check local to each
rank. flat.py lays parameters out in flat padded buffers and partitions them, and layout.py holds that
layout once, with this rank's shard, for everything that reads it; reducer.py
buckets gradients and reduce-scatters them during backward; optimizer.py steps the user's optimizer on
the fp32 master shard and all-gathers the result (whole_over_tp.py: a shape-aware optimizer's tp-sharded
matrix gathered whole over tp for its step); units.py and stage3.py choose stage 3's units and
gather them before use, release them after, and gathered_state.py gathers them for module.state_dict();
precision.py and non_finite.py hold the loss scale and
the skipped step; unused.py, forward_order.py and buffers.py handle parameters a step leaves unused,
the gather order of the next forward, and floating buffers. At set-up, setup/ fills the buffers bucket
by bucket from a ParameterSource (read top to bottom: setup/source.py, setup/initialisers.py for a
model built on meta, setup/fill.py; its docstring lists every reader and writer of weight files);
weights.py streams them back out, one bucket at a time, for export. memory.py measures what all of it
holds; summary.py says what runs."""
