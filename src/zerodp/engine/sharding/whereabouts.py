"""What this rank's stage-3 gathers are for, named when one times out (Comm.peer_failure): the forward's
number, the unit, the phase and the step; and what a divergence of forwards looks like."""

from __future__ import annotations

from collections import Counter

import torch

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
