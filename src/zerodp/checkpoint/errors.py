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

    Comm.agree is the one agreement; a checkpoint's rule on top: every rank raises the same
    CheckpointError, its message alone when every rank failed alike, else prefixed by the rank. Under
    tensor parallelism the agreement is the world's (Comm.everyone), and so are the ranks named.
    """
    def same_everywhere(failures) -> CheckpointError:
        e = failures[0]
        alike = len(failures) == comm.everyone.world_size and all(f.message == e.message for f in failures)
        return CheckpointError(e.message if alike else f"on rank {e.rank}: {e.message}")

    return comm.agree(CheckpointError(err) if err else None, "checkpoint", payload, raise_for=same_everywhere)


def failure_text(e: BaseException) -> str:
    """What went wrong, for a CheckpointError: torch.distributed.checkpoint wraps each rank's error in a
    CheckpointException (a BaseException) whose text is a traceback dump; name the first cause."""
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items())
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"{type(cause).__name__} on rank {rank}: {cause}"
    return f"{type(e).__name__}: {e}"


def root_oserror(e: BaseException) -> OSError | None:
    """The OSError behind `e` (its cause chain, or a DCP CheckpointException's per-rank failures)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        todo += [x.__cause__, x.__context__]
        for wrapped in (getattr(x, "failures", None) or {}).values():
            todo.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
    return None


def on_rank0(comm, fn: Callable, *args) -> str | None:
    """fn(*args) on the world's rank 0 alone; its failure becomes an error message for `agree`, not an exception."""
    if comm.everyone.rank != 0:  # with tp, one rank in the world: not each data-parallel group's first
        return None
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
        return f"could not write the checkpoint: {type(e).__name__}: {e}"
    return None
