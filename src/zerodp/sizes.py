"""Sizes that the engine, the config and the formulas (plan/formulas.py) share, torch-free so that
`zerodp estimate --help` loads no torch: each is the engine's fact, named once here.
"""

from __future__ import annotations

import os

# ZeroConfig.reduce_bucket_size's default (why: there).
REDUCE_BUCKET_SIZE = 50_000_000

# Bucket buffers that may exist before a new one waits for the oldest reduction in flight:
# one filling, one reducing, one spare keeps the copy stream from stalling behind comm. With
# `bucket_numel` they also hold at most POOL_BUFFERS x bucket_numel elements together, unless one
# bucket alone is larger (a stage-3 unit: a transformer block), when only that one exists.
POOL_BUFFERS = 3


def pinned_bytes(nbytes: int, pinned: bool = True) -> int:
    """Bytes torch's host allocator holds for one pinned allocation of `nbytes`: the next power of two
    (CachingHostAllocator), unless torch 2.13's PYTORCH_ALLOC_CONF pinned_max_round_threshold_mb or
    pinned_max_cached_size_mb is below it. Unpinned memory comes from malloc, unrounded."""
    if not pinned or nbytes <= 0:
        return max(nbytes, 0)
    caps = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for item in os.environ.get(var, "").split(","):
            key, _, value = (part.strip() for part in item.partition(":"))
            if key in caps and value.isdigit() and nbytes > int(value) * 2 ** 20:
                return nbytes
    return 1 << (nbytes - 1).bit_length()
