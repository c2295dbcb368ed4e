"""What this rank's stage-3 gathers are for, named when one times out (Comm.peer_failure): the forward's
number, the unit, the phase and the step; and what a divergence of forwards looks like.

Divergence named where it starts (`GatherTags`): where the host can read a small tensor for free (a CPU
device), each gather of a unit's buckets (where the rank waits for them anyway, not a prefetch) first
all-gathers a tag of what it is for (its first bucket, the phase, the unit, the step, that bucket's gathers in
that phase since the step; not the forward's number, which forwards inside a gathered_parameters block move
without a gather). Measured on 2 gloo ranks at load 5: 1.05 ms per exchange, against 12.8 ms for the
all-gather of one 4 MB bucket. Ranks in step send
equal tags; a rank that runs an extra forward (an evaluation on rank 0 only, an eval loop split unevenly)
sends another at its very first gather, and every rank raises there, naming what each rank was doing,
instead of pairing that gather with another rank's and failing later, or never."""

from __future__ import annotations

from collections import Counter

import torch

from zerodp.distributed.comm import Comm

from zerodp.distributed.failures import DIVERGENCE


# What a divergence of stage-3 forwards looks like, and what to do instead (a timed-out forward gather says it).
FORWARDS_DIVERGED = (
    "ranks that run different numbers of forwards (an eval loop over data that does not divide the ranks, "
    "generate() stopping at different lengths) diverge at stage 3, where each forward gathers every unit "
    "from every rank: run them inside `with engine.gathered_parameters():` (the whole model gathered once, "
    "where it fits) or `with engine.uneven_forwards():` (ranks that finish early answer the others' gathers)")


class Whereabouts:
    """What this rank's gathers are for, named when one times out: each unit's forwards counted per phase
    ("forward": training, with gradients; "eval": no gradients or module.eval()) since the last step."""

    def __init__(self, unit_names: list[str]):
        self.unit_names = unit_names  # unit -> its root module's name, for the message
        self.forwards: Counter[tuple[str, int]] = Counter()  # (phase, unit) -> forwards since the last step
        self.steps = 0  # optimizer steps taken (engine.global_steps)
        self.doing: tuple[str, int, int] | str = "a gather"  # (phase, unit, forward number), or what else

    def forward(self, unit: int, training: bool) -> None:
        phase = "forward" if training and torch.is_grad_enabled() else "eval"
        self.forwards[phase, unit] += 1
        self.doing = (phase, unit, self.forwards[phase, unit])

    def stepped(self, steps: int) -> None:
        self.steps = steps
        self.forwards.clear()

    def where(self) -> tuple[str, str, str]:
        """(where, the collective, what a divergence looks like) for Comm.peer_failure."""
        if isinstance(self.doing, str):
            return f"{self.doing} after step {self.steps}", "all_gather", DIVERGENCE
        phase, unit, n = self.doing
        name = f"unit {unit} ({repr(self.unit_names[unit]) if self.unit_names[unit] else 'the model'})"
        if phase == "backward":
            return f"for the backward of {name} at step {self.steps + 1}", "all_gather", DIVERGENCE
        when = f"at step {self.steps + 1}" if phase == "forward" else f"after step {self.steps}"
        return f"for forward {n} of {name} in {phase} {when}", "all_gather", FORWARDS_DIVERGED


_PHASES = ("forward", "eval", "backward")  # a tag's phase: its index; anything else (a block, a step): 3


class GatherTags:
    """The tag of each gather, all-gathered before it and compared (the module's docstring)."""

    def __init__(self, comm: Comm, whereabouts: Whereabouts):
        self.comm, self.whereabouts = comm, whereabouts
        self.gathers: Counter[tuple[int, int]] = Counter()  # (phase, bucket) -> its gathers since the last step

    def check(self, bucket: int) -> None:
        """All-gather this gather's tag; raise on every rank if any rank's differs (a collective)."""
        w = self.whereabouts
        phase, unit, _ = w.doing if not isinstance(w.doing, str) else ("", -1, 0)
        code = _PHASES.index(phase) if phase in _PHASES else len(_PHASES)
        self.gathers[code, bucket] += 1
        tag = torch.tensor([bucket, code, unit, w.steps, self.gathers[code, bucket]], dtype=torch.int64)
        try:
            tags = self.comm.all_gather_tags(tag)
        except RuntimeError as e:  # a peer that runs no gather (fewer forwards): named as the gather's own wait
            failure = self.comm.peer_failure(e, *w.where())
            if failure is None:
                raise
            raise failure from e
        if bool((tags == tags[0]).all()):
            return
        said = "; ".join(f"rank {r} gathers bucket {t[0]} {self._for(t)}" for r, t in enumerate(tags.tolist()))
        raise RuntimeError(f"zerodp: stage-3 ranks diverged at this gather: {said}. " + FORWARDS_DIVERGED)

    def _for(self, t: list[int]) -> str:
        _, code, unit, steps, k = t
        if code == len(_PHASES) or unit < 0:
            return f"outside a forward (a gathered_parameters block, a step) after step {steps}"
        name = f"unit {unit} ({self.whereabouts.unit_names[unit]!r})" if self.whereabouts.unit_names[unit] else \
            f"unit {unit} (the model)"
        if _PHASES[code] == "backward":
            return f"for the backward of {name} at step {steps + 1} (its gather {k} there)"
        when = f"at step {steps + 1}" if code == 0 else f"after step {steps}"
        return f"for a {'training forward' if code == 0 else 'forward in eval'} of {name} {when} (its gather {k} there)"

    def stepped(self) -> None:
        self.gathers.clear()
