"""The layout (the lowest room of the engine): what the engine is and where every element lives.

  spec.py     `EngineSpec`, the engine's facts named once (stage, batch, shard size, dtype, device, units,
              each param group's `OptimizerView`); decided by engine/decide.py, read everywhere after.
  flat.py     flat padded buffers: `Bucket`, `Slot`, `FlatGroup`, `lay_out` (parameters into buckets,
              partitioned over the shard group) and the tp helpers a slot needs (`tp_parts`, `tp_duplicate`).
  units.py    stage 3's units (`find_units`, `unit_rule`) and their buckets (`layout`).
  layout.py   `Layout`, the bucket layout made once with this rank's shard, for everything that reads it
              (stage 3's frozen parameters in one group per storage dtype).
  formats.py  the parameter storage formats carried exactly (plain, DTensor, bitsandbytes' Params4bit) and
              the refusal, by name, of the others (`check`); `keep_packing` (no CPU repack of 4-bit words);
              `block_state` (a quantized weight's per-block state, laid out beside it at stage 3).
"""
