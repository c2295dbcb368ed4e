"""`optimizer.state_dict()` / `load_state_dict()` in torch's own format, over the model's parameters.

After zerodp.initialize the user's optimizer steps this rank's flat master shards (optimizer.py), so torch's
own state_dict() would hold one flat tensor per bucket and rank: a DDP script's own checkpoint
(`torch.save({"optimizer": optimizer.state_dict()})`, `optimizer.load_state_dict(...)` to resume) would write
a file no other world size, stage or plain optimizer can read. Hooks on the optimizer give instead the state
of a plain optimizer over the model's parameters: keyed 0..P-1 in the param groups' order (the groups the
optimizer was built with, frozen parameters included, as torch numbers them), each tensor in its
parameter's shape, the groups' hyperparameters as they are. Loading such a state cuts each rank's shards
from the whole tensors (no collective), whatever world size or stage wrote it.

state_dict() gathers every shard's state: a collective in stages 1-3, so every rank calls it and one saves
(as a stage-3 model.state_dict()). A call on some ranks only (`if rank == 0:`, nanoGPT's checkpoint)
would wait for ever or pair with another rank's collective: it asks the store first (gathered_state's
EveryRank) and raises naming that way. zerodp's own checkpoints read the sharded format (`sharded_format`).
Optimizers that step whole parameters (optimizer_view.py), tensor parallelism and the disk tier keep state
that lies whole on one rank, split over tp ranks or in a file: their state_dict() and load_state_dict()
raise, naming engine.save_checkpoint, which saves them on any layout.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch
from torch.optim import Optimizer

from zerodp.distributed.comm import Comm
from zerodp.engine.layout.flat import Bucket
from zerodp.engine.sharding.gathered_state import EveryRank

_NUMBER = itertools.count()  # optimizers of this process, numbered alike on every rank: their store keys
ADVICE = ("call optimizer.state_dict() on every rank and save it from one (`sd = optimizer.state_dict()` "
          "before `if rank == 0: torch.save(...)`), or save with engine.save_checkpoint(dir) on every rank")


class TorchFormat:
    """The state_dict hooks of one partitioned optimizer."""

    def __init__(self, optimizer: Optimizer, params: list[list[torch.Tensor]], buckets: list[Bucket],
                 masters: list[torch.Tensor], comm: Comm, rank: int, sharded: bool, timeout_s: float,
                 on_disk: bool = False):
        self.on_disk = on_disk          # offload_optimizer "nvme": the states live in this rank's file
        self.params = params            # per param group, the parameters torch numbers, in the user's order
        self.buckets, self.masters = buckets, masters  # each bucket's master shard, which the optimizer steps
        self.comm, self.rank = comm, rank  # rank: this rank's shard of every bucket
        self.sharded = sharded          # the state is partitioned (stages 1-3): state_dict() gathers
        self.raw = False                # inside sharded_format(): torch's own format, untouched
        self.ranks = EveryRank(comm, f"zerodp/optimizer_state_dict/{next(_NUMBER)}", timeout_s)
        optimizer.register_state_dict_post_hook(self._whole)
        optimizer.register_load_state_dict_pre_hook(self._cut)

    @contextmanager
    def sharded_format(self):
        """state_dict() / load_state_dict() of this rank's shards, as torch keeps them (zerodp's checkpoints)."""
        self.raw = True
        try:
            yield
        finally:
            self.raw = False

    def _refuse_layouts(self, call: str) -> None:
        if any(b.whole for b in self.buckets) or self.comm.tp is not None or self.on_disk:
            why = ("steps whole parameters" if any(b.whole for b in self.buckets) else "runs tensor-parallel"
                   if self.comm.tp is not None else "keeps its optimizer states on disk (offload_optimizer nvme)")
            raise NotImplementedError(
                f"optimizer.{call} in torch's format is not available for an engine that {why} (each state lies "
                "whole on one rank or split over tp ranks); save and resume with engine.save_checkpoint(dir) and "
                "engine.load_checkpoint(dir) on every rank, which resume on any world size")

    def _whole(self, optimizer: Optimizer, sd: dict) -> dict | None:
        """state_post_hook: this rank's shard state -> a plain optimizer's over the model's parameters."""
        if self.raw:
            return None
        self._refuse_layouts("state_dict()")
        if self.sharded:
            missing = self.ranks.ask("optimizer.state_dict()", "it gathers the optimizer state's shards")
            if missing is not None:
                arrived, why = missing
                raise RuntimeError(
                    f"optimizer.state_dict() gathers the optimizer state from all {self.comm.world_size} ranks, "
                    f"but only {arrived} of them called it and {why} (is it called under `if rank == 0:`?); "
                    f"{ADVICE}")
        index = {id(p): i for i, p in enumerate(p for group in self.params for p in group)}
        state: dict[int, dict] = {}
        for b, m in zip(self.buckets, self.masters):
            own = optimizer.state.get(m)
            if not own:
                continue
            flat = {k: self._gathered(b, v) for k, v in own.items() if torch.is_tensor(v) and v.shape == m.shape
                    and v.dim() > 0}
            for s in b.slots:
                entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in own.items() if k not in flat}
                entry.update({k: f[s.offset:s.offset + s.numel].view(s.shape).clone() for k, f in flat.items()})
                state[index[id(s.param)]] = entry
        groups = [{**g, "params": [index[id(p)] for p in group]} for g, group in zip(sd["param_groups"], self.params)]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _gathered(self, b: Bucket, v: torch.Tensor) -> torch.Tensor:
        """Bucket b's whole flat tensor of one state whose shard this rank holds (v)."""
        if not self.sharded:
            return v.detach()
        device = b.data.device if b.data is not None else b.owned.device
        out = torch.empty(b.numel, dtype=v.dtype, device=device)
        self.comm.shard_gather(out, v.detach().to(device))
        return out.to(v.device)

    def _cut(self, optimizer: Optimizer, sd: dict) -> dict | None:
        """load_state_pre_hook: a plain optimizer's state over the model's parameters -> this rank's shards."""
        if self.raw:
            return None
        self._refuse_layouts("load_state_dict()")
        self._check(sd)
        saved_id = {id(p): i for group, g in zip(self.params, sd["param_groups"]) for p, i in zip(group, g["params"])}
        mine = {id(t): i for i, t in enumerate(t for g in optimizer.param_groups for t in g["params"])}
        state = {}
        for b, m in zip(self.buckets, self.masters):
            saved = {id(s.param): sd["state"].get(saved_id[id(s.param)]) for s in b.slots}
            first = next((s for s in b.slots if saved[id(s.param)]), None)
            if first is not None:
                state[mine[id(m)]] = self._shard(b, saved, saved[id(first.param)], first.shape)
        groups = [{**g, "params": [mine[id(t)] for t in own["params"]]}
                  for g, own in zip(sd["param_groups"], optimizer.param_groups)]
        return {"state": state, "param_groups": groups}

    def _shard(self, b: Bucket, saved: dict[int, dict | None], first: dict, shape: torch.Size) -> dict:
        """Bucket b's state for this rank's shard: each per-element state cut from its parameters' whole
        tensors (zero where a parameter has none saved: it was never stepped), the rest (Adam's step) as
        its first parameter's."""
        start, entry = self.rank * b.shard_numel, {}
        for key, v in first.items():
            if not (torch.is_tensor(v) and v.dim() > 0 and v.shape == shape):
                entry[key] = v
                continue
            shard = torch.zeros(b.shard_numel, dtype=v.dtype)
            for _, s, lo, hi in b.owned_slots(self.rank):
                whole = (saved[id(s.param)] or {}).get(key)
                if whole is not None:
                    shard[lo - start:hi - start] = whole.detach().reshape(-1)[lo - s.offset:hi - s.offset].cpu()
            entry[key] = shard
        return entry

    def _check(self, sd: dict) -> None:
        expected = [len(group) for group in self.params]
        found = [len(g.get("params", ())) for g in sd.get("param_groups", ())] if isinstance(sd, dict) else None
        if found != expected or not isinstance(sd.get("state"), dict):
            raise ValueError(f"optimizer.load_state_dict() expects the state of an optimizer over this model's "
                             f"parameters, {len(expected)} param group(s) of {expected} parameters (torch's "
                             f"format, as optimizer.state_dict() returns it here or from a plain optimizer), "
                             f"got {'groups of ' + str(found) if found is not None else type(sd).__name__}")
