"""Parameters with no gradient are not stepped: PyTorch's semantics on flat shards.

In PyTorch (and DDP, FSDP2) a parameter whose `.grad` is None after backward is skipped by
`optimizer.step()`: its value and its optimizer state (Adam's m, v and its own `step` count) stay as
they were. zerodp steps whole flat master shards, so without this module such a parameter would be
stepped with a zero gradient (DeepSpeed's behaviour), which AdamW turns into weight decay and decayed
moments. `zero_optimization.step_unused_parameters: true` keeps that behaviour (and skips all this).

  used bits     one per trained parameter: did it get a gradient on this rank in the window (any
                micro-step)? They ride in the all-reduce of the gradient norm (stages 1-3), or in
                stage 0's small all-reduce of the non-finite flags (as DDP has one for its
                used-parameter map). A parameter is used if any rank used it.
  fast path     a shard whose parameters are all used and all stepped as often as the shard is stepped
                whole, as usual: the normal case costs no host work beyond reading the bits when this
                rank itself saw an unused parameter. A rank that saw every parameter used makes its
                bits on the device (no copy from the host) and reads nothing back.
  slow path     otherwise the shard is replaced, for this one optimizer.step() call, by views of its
                used parameters' element ranges (adjacent ones with equal step counts merged), each with
                views of the shard's optimizer state and its own `step` count: unused ranges are not
                touched at all, and Adam's bias correction uses each parameter's own count, exactly as
                PyTorch gives it. The views are stepped in the same optimizer.step() call as the other
                shards (no second pass over memory); the cost is host work per view. A shard whose
                parameters' counts once diverged stays on this path (their counts never re-converge).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.optim import Optimizer

from zerodp.distributed.comm import Comm
from zerodp.distributed.device import can_pin
from zerodp.engine.layout.layout import Layout


class UsedParameters:
    """The window's used bits, their agreement across ranks, and a step that leaves the rest alone."""

    def __init__(self, layout: Layout, comm: Comm):
        self.comm = comm
        buckets, rank = layout.buckets, layout.rank
        self.first = []  # global slot id of each bucket's first slot
        self.params = [s.param for b in buckets for s in b.slots]  # by slot id
        total = 0
        for b in buckets:
            self.first.append(total)
            total += len(b.slots)
        # The window's bits as one Python int, byte i = slot i (host-only: no tensor op per micro-step,
        # and nothing that peak.py's fake tensors would have to stand in for).
        self.total = total
        self.window = 0
        self.all_used = int.from_bytes(b"\x01" * total, "little")
        # Per master shard: (slot id, lo, hi) of each parameter range it holds, in shard coordinates.
        self.ranges: list[list[tuple[int, int, int]]] = []
        for k, b in enumerate(buckets):
            lo_r = rank * b.shard_numel
            self.ranges.append([(self.first[k] + i, lo - lo_r, hi - lo_r) for i, _, lo, hi in b.owned_slots(rank)])
        self.ids = [torch.tensor([r[0] for r in ranges], dtype=torch.long) for ranges in self.ranges]
        # Whole-parameter buckets: the optimizer steps each parameter as its own tensor and skips one
        # without a gradient itself (used_slots); only flat shards need the views below.
        self.whole = [b.whole for b in buckets]
        self.used: torch.Tensor | None = None  # the agreed bits of the step being taken; None: all used
        # Step counts, materialised only once some parameter was not stepped (until then every
        # parameter and every shard has been stepped `uniform_steps` times).
        self.uniform_steps = 0
        self.counts: torch.Tensor | None = None    # per slot: times stepped
        self.shard_step: list[int] | None = None   # per master: the value in its optimizer state['step']

    # ---- the window ------------------------------------------------------------------------------
    def after_backward(self, arrived: list[bytearray]) -> None:
        """OR in the slots that received a gradient in this micro-step (reducer.arrived)."""
        self.window |= int.from_bytes(b"".join(arrived), "little")

    def norm_and_agree(self, partitioned, grads: list[torch.Tensor], flags: torch.Tensor):
        """partitioned.grad_norm_squared, with the used bits summed over ranks in the same all-reduce;
        sets `self.used` (None when every parameter was used somewhere)."""
        local_all = self.window == self.all_used
        if local_all:  # the usual step: made on the device, nothing copied from the host
            bits = torch.ones(self.total, dtype=torch.float64, device=flags.device)
        else:  # from pinned memory without blocking (a pageable copy waits for the whole stream)
            bits = torch.tensor(list(self.window.to_bytes(self.total, "little")), dtype=torch.float64)
            bits = (bits.pin_memory() if can_pin() else bits).to(flags.device, non_blocking=True)
        flags = torch.cat([flags, bits])
        norm_sq, flags = partitioned.grad_norm_squared(grads, flags)
        n = flags.numel() - bits.numel()
        flags, agreed = flags[:n], flags[n:]
        if local_all or self.comm.is_fake(agreed):
            self.used = None  # this rank used everything, so every rank did: nothing to read back
        else:  # the host picks the ranges to step: a read of the agreed bits (this step's one sync)
            used = agreed.cpu() > 0
            self.used = None if bool(used.all()) else used
        return norm_sq, flags

    def end_window(self, stepped: bool) -> None:
        """After the step (taken or skipped): count what was stepped, start the next window."""
        if stepped:
            if self.counts is None and self.used is None:
                self.uniform_steps += 1
            else:
                self._materialise()
                self.counts += 1 if self.used is None else self.used.long()
        self.window = 0
        self.used = None

    def uniform(self) -> bool:
        """Every parameter used in this step and stepped as often as every other so far: the shards
        are stepped whole (what a step skipped on the device needs, unstep() taking it back)."""
        return self.used is None and self.counts is None

    def unstep(self) -> None:
        """The last step, counted as taken while uniform(), was skipped on the device."""
        self.uniform_steps -= 1

    def _materialise(self) -> None:
        if self.counts is None:
            self.counts = torch.full((self.total,), self.uniform_steps, dtype=torch.long)
            self.shard_step = [self.uniform_steps] * len(self.ranges)

    # ---- the step ---------------------------------------------------------------------------------
    @contextmanager
    def only_used(self, optimizer: Optimizer, masters: list[torch.Tensor], part: list[int]):
        """Around one optimizer.step() over masters[part] (their .grad set): unused ranges untouched,
        each used parameter stepped with its own step count."""
        if self.used is None and self.counts is None:  # all used, all counts equal: whole shards
            yield
            return
        self._materialise()
        used = torch.ones(self.total, dtype=torch.bool) if self.used is None else self.used
        swaps = {}
        for k in part:
            ids = self.ids[k]
            if bool(used[ids].all()) and bool((self.counts[ids] == self.shard_step[k]).all()):
                self.shard_step[k] += 1  # stepped whole, its state['step'] (if any) moves with it
                continue
            swaps[k] = self._views(optimizer, masters[k], self._segments(k, used))
        replace = {id(masters[k]): [v for v, _ in views] for k, views in swaps.items()}
        saved = [g["params"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = [v for p in g["params"] for v in replace.get(id(p), [p])]
        try:
            yield
        finally:
            for g, params in zip(optimizer.param_groups, saved):
                g["params"] = params
            for k, views in swaps.items():
                self._write_back(optimizer, k, masters[k], views, used)

    def used_slots(self, k: int) -> list[bool] | None:
        """For master k's parameter ranges in order: whether each was used in this step; None: all were."""
        if self.used is None:
            return None
        return self.used[self.ids[k]].tolist()

    def _segments(self, k: int, used: torch.Tensor) -> list[tuple[int, int, int]]:
        """(lo, hi, step count) of runs of used parameters with equal counts (the padding between two
        adjacent ones is zero, has a zero gradient and stays zero, so it may be stepped with them)."""
        runs: list[list[int]] = []
        ids = self.ids[k]
        used_here, counts_here = used[ids].tolist(), self.counts[ids].tolist()  # no per-element tensor reads
        for (slot, lo, hi), u, c in zip(self.ranges[k], used_here, counts_here):
            if not u:
                runs.append(None)
                continue
            if runs and runs[-1] is not None and runs[-1][2] == c:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, c])
        return [tuple(r) for r in runs if r is not None]

    @staticmethod
    def _views(optimizer: Optimizer, m: torch.Tensor, segments) -> list[tuple[torch.Tensor, tuple]]:
        state = optimizer.state[m] if m in optimizer.state else {}
        out = []
        for lo, hi, count in segments:
            v = m.detach()[lo:hi]
            v.grad = m.grad[lo:hi]
            if state:
                optimizer.state[v] = {
                    key: (t[lo:hi] if torch.is_tensor(t) and t.shape == m.shape
                          else torch.full_like(t, count) if key == "step" and torch.is_tensor(t) else t)
                    for key, t in state.items()}
            out.append((v, (lo, hi)))
        return out

    def _write_back(self, optimizer: Optimizer, k: int, m: torch.Tensor, views, used: torch.Tensor) -> None:
        """Fold the views' state into the shard's (new state tensors: first step, SGD's momentum)."""
        state = optimizer.state[m]
        step = None
        for v, (lo, hi) in views:
            for key, t in optimizer.state.pop(v, {}).items():
                if torch.is_tensor(t) and t.dim() > 0 and t.shape == v.shape:
                    if key not in state:
                        state[key] = torch.zeros(m.shape, dtype=t.dtype, device=t.device)
                    dest = state[key][lo:hi]
                    if dest.data_ptr() != t.data_ptr():
                        dest.copy_(t)
                elif key == "step" and torch.is_tensor(t):
                    step = t
                else:
                    state.setdefault(key, t)
            v.grad = None
        ids = self.ids[k]
        after = int((self.counts[ids] + used[ids].long()).max()) if len(ids) else self.shard_step[k]
        self.shard_step[k] = after
        if step is not None or "step" in state:
            template = step if step is not None else state["step"]
            state["step"] = torch.full_like(template, after)
        if not state:
            del optimizer.state[m]

    # ---- checkpoints ------------------------------------------------------------------------------
    def counts_by_name(self, names: dict[int, str]) -> dict[str, int] | None:
        """Each parameter's own step count, for a checkpoint (None while all are equal)."""
        if self.counts is None:
            return None
        return {names[id(p)]: int(c) for p, c in zip(self.params, self.counts.tolist())}

    def after_load(self, optimizer: Optimizer, masters: list[torch.Tensor], names: dict[int, str],
                   saved: dict[str, int] | None) -> None:
        """A loaded checkpoint gives every shard the group's saved `step`; `saved` (zerodp.json's
        step_counts) gives each parameter its own count back."""
        steps = [int(optimizer.state[m]["step"]) if m in optimizer.state and "step" in optimizer.state[m] else 0
                 for m in masters]
        self.window = 0
        self.used = None
        if saved is None and len({n for n, whole in zip(steps, self.whole) if not whole}) <= 1:
            flat = [n for n, whole in zip(steps, self.whole) if not whole]
            self.uniform_steps, self.counts, self.shard_step = (flat[0] if flat else 0), None, None
            return
        self.counts = torch.tensor([saved.get(names[id(p)], 0) if saved else steps[0] for p in self.params],
                                   dtype=torch.long)
        self.shard_step = steps
