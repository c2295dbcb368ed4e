"""The end of a process that used torch.distributed: its process groups freed while the interpreter is
still whole, so that a finished job exits 0 (or with its error), not with SIGABRT.

Why: on gloo about 1 process exit in 10 aborted after a finished job ("terminate called without an
active exception", exit -6). The cause is torch's (pytorch PR #179291): a group's worker threads
(`pt_gloo_runloop`) hold work objects, with their tensors, that are then freed during the interpreter's
finalization, when a thread that needs the GIL is ended by CPython with pthread_exit, and its unwinding
through a noexcept C++ frame is std::terminate. Those threads stop only when the ProcessGroup object is
freed, and `destroy_process_group()` does not free it while anything still references it: zerodp's Comm
does (the engine holds one), so in every script that used zerodp they lived into finalization.

`release_at_exit` is the hook, registered once (`register`, called by init_distributed and every Comm).
atexit runs it before finalization: after the script's last line, or after its uncaught error's
traceback is printed (the exit code stays the error's), and after every exit hook registered later. It
destroys the groups zerodp created for its own collectives (Comm.bound's twins of a script's group) and
the default group if zerodp created it and they are still alive, drops the references every live Comm
holds, and collects garbage: each freed group joins its threads there, while they can run.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Protocol

import torch.distributed as dist


class GroupHolder(Protocol):
    def release_groups(self) -> None:
        """Drop every reference to a process group (called at exit only)."""


_holders: weakref.WeakSet = weakref.WeakSet()  # every live Comm: what may keep a group alive
_state = {"registered": False}
# The default group zerodp created (init_distributed), held by identity: a forked rank inherits this module's
# state but makes a default group of its own, which a flag would mistake for zerodp's.
_default: list[dist.ProcessGroup] = []
# groups zerodp created besides the default one (Comm.bound's twins of a script's groups), by their ranks
_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def register(holder: GroupHolder | None = None, created_default: bool = False) -> None:
    """Arrange for `release_at_exit` to run at this process's exit (once, however often called).

    holder: an object whose process-group references must go before the interpreter finalizes.
    created_default: zerodp has just created the default group (init_distributed), so the hook
    destroys it if the script did not.
    """
    if holder is not None:
        _holders.add(holder)
    if created_default:
        _default[:] = [dist.distributed_c10d._get_default_group()]
    if not _state["registered"]:
        _state["registered"] = True
        atexit.register(release_at_exit)


def register_group(ranks: tuple[int, ...], group: dist.ProcessGroup) -> None:
    """A group zerodp created for its own collectives over these ranks: destroyed at exit if the script
    did not (a destroyed one is replaced by the next of the same ranks)."""
    _groups[ranks] = group
    register()


def group_of(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
    """zerodp's own group over these ranks, if it made one and it is alive."""
    group = _groups.get(ranks)
    return group if group is not None and alive(group) else None


def owns(group: dist.ProcessGroup) -> bool:
    """Whether zerodp created this group (the default group in init_distributed, or a twin)."""
    if any(group is g for g in _groups.values()):
        return True
    return any(group is g for g in _default) and alive(group)


def alive(group: dist.ProcessGroup) -> bool:
    """Whether the group has not been destroyed (destroy_process_group() with no group destroys all)."""
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


def release_at_exit() -> None:
    """Free every process group zerodp created or holds, and join their gloo threads, now.

    Never raises (an exit hook's error would only add a traceback to the process's own end) and never
    changes the exit code. A group the script created and still uses is left alive: only the script
    knows when it is done with it.
    """
    for group in _groups.values():  # before the default group, whose store they use
        if alive(group):
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - freeing it below is what matters
                pass
    _groups.clear()
    # Dropped whatever happens: a reference held here would keep the group's gloo threads alive into finalization.
    created, _default[:] = any(alive(g) for g in _default), []
    if created:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already half torn down: freeing it below is what matters
            pass
    for holder in list(_holders):
        holder.release_groups()
    gc.collect()  # a group in a reference cycle (an error's traceback, an engine's hooks) is freed here
