"""Sharded checkpoints (torch.distributed.checkpoint) that resume on any world size and stage,
and their consolidation into one full fp32 state dict.

A checkpoint is a directory `save_dir/{tag}` holding:
  - DCP files with tensors only, in a layout-free form: every trained parameter's fp32 master and
    optimizer state are stored as 1-D pieces of the flattened parameter, `master/{name}@{start}`
    and `optim/{key}/{name}@{start}`, each rank writing the pieces its shards own (rank 0 alone in
    stage 0, where every rank owns everything). Stage 3's frozen parameters are pieces of the working
    shards, each element once (`frozen/{name}@{start}`). Frozen parameters below stage 3 and buffers (`model/{name}`),
    0-dim optimizer state per param group (`optim_scalar/{group}/{key}`) and each rank's torch RNG
    (`rng/{rank}/torch`) complete them. With tensor parallelism a tp shard is saved per tp rank r,
    `master/{name}@tp{r}@{start}` (pieces.py), and every rank of the dp x tp world writes.
  - `zerodp.json`, written by rank 0 (the world's): counters, loss scaler, lr scheduler, param group
    hyperparameters, client_state, config, the model signature (names, shapes, tied aliases; each
    tp shard's axis and every tp rank's shape), the tp size, the saved layout, the python/numpy RNG
    of every rank and the size + crc32 of every file.
`save_dir/latest` names the newest tag. Each checkpoint names its run (files.py): keep_last and the
fallback past a broken `latest` choose among one run's checkpoints only.
save_dir must be a filesystem every rank sees (DCP's rule):
rank 0 renames what all ranks wrote.

One concept per file, read in this order:
  pieces.py   the layout-free view of an engine (why pieces rather than buckets)
  errors.py   CheckpointError, and the agreement that raises it on every rank before any change
  manifest.py zerodp.json's fields by type and range: one strict model for the writer and the reader
  files.py    the directory on disk: temp dir, rename, `latest`, size + crc32 of each file, no path
              out of the directory; housekeeping (stale temp dirs, keep_last of the saving run); which
              run a checkpoint belongs to (`run` in zerodp.json), and the choices among one run's
              checkpoints: keep_last, the fallback
  save.py     save_checkpoint
  read.py     finding and checking a checkpoint (and the newest intact one); the restricted
              unpickler; chunked tensor reads
  load.py     load_checkpoint: stage everything, agree, then apply
  whole.py    saved tensors made whole (pieces end to end, tp shards joined): export, and a resume on
              another tensor-parallel size
  apply.py    the second phase of every load: what was staged, written into the engine
  export.py   consolidate / write_consolidated / write_hf_folder / `zerodp consolidate` (main)
  export_engine.py  a live engine's weights written bucket by bucket (final.pt, OUT/hf, save_16bit_model)
  weights.py  weights read from files a range at a time: zerodp.initialize(..., weights=PATH)
  deepspeed.py  DeepSpeed ZeRO 1-3 checkpoints, read into the same form: load and consolidate dispatch here
  __main__.py `zerodp consolidate DIR OUT` and `python -m zerodp.checkpoint`: the command line, torch-free
"""

from zerodp.lazy import lazy_names

# Each name is imported from its module on first use (PEP 562), so that `zerodp consolidate --help`
# answers before torch loads (__main__.py, the command line, is torch-free).
_LAZY = {"CheckpointError": "errors", "consolidate": "export", "write_consolidated": "export",
         "write_hf_folder": "export", "main": "__main__",
         "load_checkpoint": "load", "local_state": "pieces", "newest_intact": "read", "resolve": "read",
         "save_checkpoint": "save"}

__all__ = ["CheckpointError", "consolidate", "load_checkpoint", "local_state", "main", "newest_intact", "resolve",
           "save_checkpoint", "write_consolidated", "write_hf_folder"]


__getattr__ = lazy_names(__name__, _LAZY)
