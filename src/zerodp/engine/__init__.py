"""A model sharded (sharding/module.py's ShardedModule), with training added where something trains
(stepping/training.py), tied into the engine users hold (engine.py); rooms by concern, each importing only the
rooms below it (tests/test_house.py checks): layout < tensor_parallel < setup < sharding < stepping < this root.

  layout/           what the engine is and where every element lives: EngineSpec, flat buckets, stage 3's
                    units, the Layout.
  tensor_parallel/  a tp parameter's placement, its gradient's partial sums, a whole matrix for the step.
  setup/            where a model's values come from (a source, initialisers on meta), filled bucket by bucket.
  sharding/         the sharded module that trains nothing: its buckets filled, gathered per unit and released
                    (stage 3), state_dict gathered, buffers kept equal, weights streamed out, bytes measured.
  stepping/         training added to it: the reducer, the partitioned optimizer, offload, loss scale,
                    non-finite and unused steps, the forward order, the step settled on one path.
  engine.py         `wrap` (a ShardedModule, or an Engine where something trains), `Engine` (the face users
                    hold: DeepSpeed's methods), `inside` (the one internal object the layers above read).
  decide.py         `local_check`: the engine's facts decided once, on each rank alone, before any collective;
                    `agreed_set_up`: that check agreed by every rank, then the checks that need the others.
  summary.py        the set-up line: which stage, offload and dtype a job runs, said once on rank 0.
  faces.py          the engine as a framework's model, optimizer and scheduler (torch's interfaces), and the one
                    answer to a loop's no_sync: what the HF Trainer, Lightning and the DeepSpeed shim hand out.
"""
