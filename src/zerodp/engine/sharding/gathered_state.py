"""Stage 3: `module.state_dict()` holds the whole parameters, gathered one bucket at a time.

Outside a forward a stage-3 parameter points at an empty tensor (stage3.py), so torch's own
state_dict would hold shape-(0,) tensors: `torch.save(model.state_dict(), path)` would write an empty
model and exit 0. Hooks on the modules put a copy of each parameter's gathered value in its entry
instead, gathering the buckets a module's parameters live in when the traversal reaches it and
releasing them when it moves on: one module's buckets gathered at a time, the whole model only in
the returned dict (as for a model held whole). Tied parameters share one copy, as they share one tensor.

The gathers are collectives: every rank must call state_dict() the same way (every rank calls it,
one rank saves). A call on one rank only (`if rank == 0: torch.save(model.state_dict(), ...)`) would
wait for ever in its first all_gather, or pair it with another rank's different collective. So each
call that has something to gather first checks, through the process group's store (which no
collective uses), that every rank has made it too. A missing rank that is already in another gather of
this engine that this rank has not reached (a `gathered_parameters` block that gathers, full_state_dict,
save_checkpoint: DeepSpeed-Chat's every-rank save after its rank-0-only one) will not make this call: that is found at
once (`LoneCall`), else after `comm_timeout_s`. Then the call raises, naming what works instead, or
(`LoneCall.PLACEHOLDERS`, zerodp.deepspeed's choice) returns DeepSpeed's placeholders with one warning line:
each released parameter as the empty tensor it is, the persistent ones whole, no collective.
`state_dict(keep_vars=True)` returns the parameters themselves, as torch does (whole only inside a
gather), and gathers nothing.
"""

from __future__ import annotations

import itertools
import sys
import time
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn

from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import Bucket
from zerodp.engine.layout.formats import block_state
from zerodp.engine.sharding.gather import Gatherer

_NUMBER = itertools.count()  # engines of this process, numbered alike on every rank (they build them alike)
_FIRST_WAIT_S = 10.0  # then one line says what the call waits for, before comm_timeout_s runs out
_GAVE_UP = 1 << 40    # what a rank that stopped waiting takes from a call's count of ranks

_POLL_S = 0.05        # how often a waiting call looks at the store
ENGINE_ADVICE = ("read the fp32 weights with engine.full_state_dict() on every rank, or read the parameters "
                 "inside `with engine.gathered_parameters():` on every rank")


class LoneCall(Enum):
    """What a state_dict() that not every rank makes returns."""

    RAISE = "raise"                # zerodp's own API: an error naming what works instead
    PLACEHOLDERS = "placeholders"  # DeepSpeed's: the released parameters empty, with one warning line


class GatheredStateDict:
    """The state_dict hooks of one stage-3 engine's module."""

    def __init__(self, module: nn.Module, gatherer: Gatherer, comm: Comm, timeout_s: float):
        self.gatherer, self.comm, self.timeout_s = gatherer, comm, timeout_s
        # What a call made on too few ranks is told to do instead (zerodp.deepspeed names its own API).
        self.advice = ENGINE_ADVICE
        self.lone = LoneCall.RAISE  # what a call made on too few ranks returns
        self.gathering = True  # this call gathers (False: it returns placeholders)
        self.bucket_of = {id(s.param): b for b in gatherer.buckets if not b.persistent for s in b.slots}
        # whether every rank makes a call, asked through the store under this engine's keys
        self.ranks = EveryRank(comm, f"zerodp/stage3_state_dict/{next(_NUMBER)}", timeout_s)
        self.root: nn.Module | None = None    # the module whose state_dict() call is under way
        self.root_prefix = ""
        self.keep_vars = False
        self.mine: list[Bucket] = []          # buckets this call gathered and holds for the current module
        self.copies: dict[int, torch.Tensor] = {}  # id(param) -> its copy in this call's dict
        self._handles = []  # the state_dict hooks on every module (remove_hooks)
        if self.bucket_of:  # persistent buckets are whole already: nothing to gather
            for m in module.modules():  # (torch marks a post hook as public: a function, not a bound method)
                self._handles.append(m.register_state_dict_pre_hook(self._pre_hook))
                self._handles.append(m.register_state_dict_post_hook(lambda *args: self._post_hook(*args)))

    def remove_hooks(self) -> None:
        """The module's state_dict() is its own again (the engine is being destroyed)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        # A child's call always has a prefix; "" is a new call (after one that raised half-way too).
        if self.root is not None and prefix != "":
            return
        self._end()
        self.gathering = True
        if not keep_vars and self._has_released(module):
            self.gathering = self._every_rank_called()
        self.root, self.root_prefix, self.keep_vars = module, prefix, keep_vars

    def _post_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if self.root is None:
            return
        if not self.keep_vars and self.gathering:
            own = [(n, p) for n, p in self._own(module) if id(p) in self.bucket_of]
            if own:
                self._fill(own, state_dict, prefix)
        if module is self.root and prefix == self.root_prefix:
            self._end()

    @staticmethod
    def _own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The tensors a module writes into its state_dict that a stage-3 bucket may hold, by their keys in it: its
        own parameters, and a bitsandbytes layer's per-block quantisation state (formats.block_state)."""
        return [*((n, p) for n, p in module._parameters.items() if p is not None), *block_state(module)]

    def _fill(self, own: list[tuple[str, torch.Tensor]], state_dict: dict, prefix: str) -> None:
        """This module's parameters' entries: copies of their values, their buckets gathered if need be."""
        needed = {b.index: b for b in (self.bucket_of[id(p)] for _, p in own)}
        self.gatherer.release([b for b in self.mine if b.index not in needed])
        self.mine = [b for b in self.mine if b.index in needed]
        missing = [b for b in needed.values() if not self.gatherer.is_gathered(b)]
        self.gatherer.whereabouts.doing = "in module.state_dict()"
        self.gatherer.gather(missing)
        self.mine += missing
        for name, p in own:
            if prefix + name in state_dict:
                if id(p) not in self.copies:
                    self.copies[id(p)] = p.detach().clone()
                state_dict[prefix + name] = self.copies[id(p)]

    def _end(self) -> None:
        self.gatherer.release(self.mine)
        self.mine, self.copies, self.root = [], {}, None

    def _has_released(self, module: nn.Module) -> bool:
        return any((b := self.bucket_of.get(id(p))) is not None and not self.gatherer.is_gathered(b)
                   for m in module.modules() for _, p in self._own(m))

    def entering(self, call: str) -> None:
        """(the engine) This rank enters a collective call (a gathered_parameters block that gathers,
        full_state_dict, save_checkpoint), which every rank makes in the same order: a rank waiting in a
        state_dict() call this rank has not made learns that this rank will not make it first (EveryRank)."""
        self.ranks.entering(call)

    def _every_rank_called(self) -> bool:
        """Before a call's first gather: whether every rank of the group makes this call too (True), or
        not (False with LoneCall.PLACEHOLDERS; LoneCall.RAISE raises)."""
        missing = self.ranks.ask("state_dict() of a stage-3 model", "it gathers the parameters' shards")
        return True if missing is None else self._lone(*missing)

    def _lone(self, arrived: int, why: str) -> bool:
        """A call not every rank makes: DeepSpeed's placeholders with one warning line, or the error."""
        text = (f"state_dict() of a stage-3 model gathers every parameter from all {self.comm.world_size} "
                f"ranks, but only {arrived} of them called it and {why} (is it called under `if rank == 0:`?)")
        if self.lone is LoneCall.PLACEHOLDERS:
            print(f"[zerodp] rank {self.comm.rank}: {text}; it returns DeepSpeed's placeholders (the partitioned "
                  f"parameters empty) and gathers nothing: {self.advice}", file=sys.stderr, flush=True)
            return False
        raise RuntimeError(f"{text}; call model.state_dict() on every rank and save from one, or {self.advice}")


class EveryRank:
    """Whether every rank of a group makes a call that is collective (it gathers), asked through the
    process group's store, which no collective uses, before the call's first collective.

    Each rank adds 1 to the call's count; the last to arrive marks it complete. A rank that stops
    waiting subtracts _GAVE_UP in the same atomic add, so it and any rank arriving later agree on
    whether every rank had arrived (then all gather) or not (then none does). A missing rank already in
    another collective call of the same owner (`entering`) that this rank has not reached is found at
    once; otherwise after `timeout_s`, with one line after _FIRST_WAIT_S saying what the call waits for."""

    def __init__(self, comm: Comm, tag: str, timeout_s: float):
        self.comm, self.tag, self.timeout_s = comm, tag, timeout_s  # tag: this owner's keys in the store
        self.calls = 0    # calls that asked: numbers their keys
        self.entered = 0  # collective calls this rank has entered (entering)

    def entering(self, call: str) -> None:
        """This rank enters a collective call that every rank makes in the same order."""
        if self.comm.world_size > 1 and not self.comm.is_fake():
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{self.tag}/entered/{self.comm.everyone.rank}", f"{self.calls} {self.entered} {call}")
        self.entered += 1

    def ask(self, what: str, because: str) -> tuple[int, str] | None:
        """None when every rank of the group (every rank of the world under tp) makes this call; else how
        many did and why this rank stopped waiting. `what` and `because` name the call in the waiting line."""
        if self.comm.world_size == 1 or self.comm.is_fake():
            return None
        store = dist.distributed_c10d._get_default_store()
        key, world = f"{self.tag}/{self.calls}", self.comm.everyone.world_size
        self.calls += 1
        arrived = store.add(key, 1)
        if arrived < 0:
            return arrived + _GAVE_UP, "another rank stopped waiting for it"
        if arrived == world:
            store.set(key + "/all", "1")
        why = self._wait(store, key + "/all", world, f"{what} waits for every rank to call it ({because})")
        if why is None:
            return None
        arrived = store.add(key, -_GAVE_UP) + _GAVE_UP
        if arrived == world:  # the last rank came as this one gave up: it gathers with the others
            return None
        return arrived, why

    def _wait(self, store: dist.Store, done: str, world: int, line: str) -> str | None:
        """Until every rank has made the call (None), another rank is found in a call this rank has not
        reached, or timeout_s passes (then why this rank stops waiting)."""
        start, told = time.monotonic(), False
        others = [f"{self.tag}/entered/{r}" for r in range(world) if r != self.comm.everyone.rank]
        while True:
            if _waited(store, done, _POLL_S):
                return None
            for k in others:
                if store.check([k]):
                    calls, entered, call = store.get(k).decode().split(maxsplit=2)
                    if int(calls) < self.calls and int(entered) >= self.entered:  # it will not make this one first
                        return (f"rank {k.rsplit('/', 1)[1]} is in {call} instead "
                                f"(found in {time.monotonic() - start:.1f} s)")
            waited = time.monotonic() - start
            if not told and waited > min(_FIRST_WAIT_S, self.timeout_s):
                told = True
                print(f"[zerodp] rank {self.comm.rank}: {line}; it fails after "
                      f"comm_timeout_s={self.timeout_s:g} s if they do not", file=sys.stderr, flush=True)
            if waited > self.timeout_s:
                return f"comm_timeout_s={self.timeout_s:g} s passed"


def _waited(store: dist.Store, key: str, seconds: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=seconds))
    except RuntimeError:  # the store's timeout (DistStoreError)
        return False
    return True
