"""Set-up: where a model's values come from, read top to bottom in the order the engine runs it.

  source.py        `ParameterSource`, the contract: a reader of parameter values by name that is asked
                   for element ranges, never for a whole model (`check` the names and shapes, `read`
                   elements [start, stop)).
  initialisers.py  `ModuleInit`, the source for a model built on `meta`: each module's own initialiser
                   (`reset_parameters()` or `param_init_fn`) run on CPU stand-ins, one module at a time,
                   from rank 0's random state.
  tp_shards.py     a tensor-parallel parameter's local shard (`Box`) read out of a source that holds the
                   whole tensor (`read_local`: its rows, and of Shard(1) only its columns).
  fill.py          the steps, each named once:
                   `filling_for`  local, no collective: every tensor on meta has a source (a ModuleInit,
                                  or weights the caller gave), and the source has every parameter, but
                                  those it leaves to the initialisers (`initialised`: an adapter added
                                  to a pretrained base), whose modules alone the ModuleInit runs;
                   `move_to`      the module's real tensors onto the device (meta ones have no values);
                   `start`        one broadcast of rank 0's random state (`ModuleInit.seed`), then every
                                  tensor outside the flat buffers (frozen parameters, buffers) whole;
                   `fill`         the flat buffers bucket by bucket (`FlatGroup.allocate` takes each
                                  bucket's values as they are read: this rank's shard at stage 3, the
                                  whole bucket at stages 0-2), then `ModuleInit.finish` leaves the random
                                  state where a whole build leaves it.

Everything that reads or writes weight files (this package reads through a source, it opens no file):
  read    zerodp/checkpoint/weights.py  `open_weights`: the ParameterSource over an HF folder, a
                                        .safetensors file, a zerodp or a DeepSpeed checkpoint;
          zerodp/models/hf_folder.py    `model_from_config` (the model a folder describes, built for
                                        `weights=folder`) and `init_fn` (HF's initialiser on meta).
  write   zerodp/engine/sharding/weights.py      `engine_weights`: a trained engine's values as a stream, one
                                        bucket at a time;
          zerodp/models/weight_files.py `SafetensorsFile`, `TorchSaveFile`: files written a tensor at a
                                        time as the stream arrives;
          zerodp/models/hf_folder.py    `write_folder`: an HF folder from that stream.
"""
