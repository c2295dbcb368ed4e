"""One training step, sharded: the engine (engine.py) and its rooms by concern, each importing only the
rooms below it (tests/test_house.py checks): layout < tensor_parallel < setup < sharding < stepping < this root.

  layout/           what the engine is and where every element lives: EngineSpec, flat buckets, stage 3's
                    units, the Layout.
  tensor_parallel/  a tp parameter's placement, its gradient's partial sums, a whole matrix for the step.
  setup/            where a model's values come from (a source, initialisers on meta), filled bucket by bucket.
  sharding/         parameters gathered per unit and released (stage 3), state_dict gathered, buffers kept
                    equal, weights streamed out for export.
  stepping/         the reducer, the partitioned optimizer, offload, loss scale, non-finite and unused steps,
                    the forward order.
  engine.py         `Engine`: builds the rooms' parts and drives forward, backward and step.
  decide.py         `local_check`: the engine's facts decided once, on each rank alone, before any collective.
  memory.py         `memory_report`: what the engine holds, measured.
  summary.py        the set-up line: which stage, offload and dtype a job runs, said once on rank 0.
"""
