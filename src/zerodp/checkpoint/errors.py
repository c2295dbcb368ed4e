"""The one checkpoint error, and the agreement that raises it on every rank at once.

Save and load check all they can before their first collective, then `agree`: every rank learns what
any rank found, so a problem on one rank is the same CheckpointError on all of them and no rank is
left waiting in a collective that the others never reach.
"""

from __future__ import annotations

from typing import Callable


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; raised on every rank, before any change."""


def agree(comm, err: str | None, payload=None) -> list:
    """Collective: gather (error, payload) from every rank; raise the first error everywhere.

    No branch for a world of one: Comm.all_gather_object is already a local [obj] there.
    """
    results = comm.all_gather_object((err, payload))
    for r, (e, _) in enumerate(results):
        if e:
            same = all(x[0] == e for x in results)
            raise CheckpointError(e if same else f"on rank {r}: {e}")
    return [p for _, p in results]


def on_rank0(comm, fn: Callable, *args) -> str | None:
    """fn(*args) on rank 0 alone; its failure becomes an error message for `agree`, not an exception."""
    if comm.rank != 0:
        return None
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
        return f"could not write the checkpoint: {type(e).__name__}: {e}"
    return None
