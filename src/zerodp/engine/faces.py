"""The engine as a training framework's model, optimizer and scheduler: each role defined once, in torch's own
interfaces, for the compatibility layers (integrations/hf, integrations/lightning, deepspeed/) to hand to a loop
that was written for a plain torch module and optimizer.

  EngineModule      an nn.Module whose forward runs the engine (input casts, stage 3's gathers): the model the
                    framework's loop calls; its no_sync is DDP's, by deferred_reduction.
  EngineOptimizer   param_groups / step / zero_grad / state_dict: step() is the engine's step (reduce, clip,
                    update, gather); the real optimizer's state lives sharded in the engine and its checkpoint.
  EngineScheduler   for a loop that steps its scheduler itself: the engine steps the real one after each update
                    it does not skip, so step() here does nothing; get_last_lr() is the lr of the last update.
  deferred_reduction  the one answer to "may this backward hold its gradients back for a later one" (a loop's
                    no_sync): the engine's no_sync where it can, nothing where it keeps only a gradient shard.

A layer keeps only what its framework needs beyond these (Lightning's precision plugin, the HF Trainer's seams,
DeepSpeed's names); tests/test_house.py checks that no other module defines these roles again.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

from torch import nn

from zerodp.engine.engine import Engine, inside


class EngineModule(nn.Module):
    """The model a framework's loop calls: forwards go through the engine. `module` is the user's model (its
    parameters are views into the engine's buckets); `engine` may be attached after construction, for a
    framework that hands out the model before its optimizer exists (the engine is built with the optimizer)."""

    def __init__(self, module: nn.Module, engine: Engine | None = None, not_built: str = "") -> None:
        super().__init__()
        self.module = module
        self.engine = engine  # None until the layer builds it; then forward runs through it
        self._not_built = not_built  # the error a forward before that raises: the layer says when it builds one

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            raise RuntimeError(self._not_built or "the zerodp engine is not built yet")
        return self.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.engine is not None:
            self.engine.zero_grad()  # gradients live in the engine's buckets, cleared by step()

    def no_sync(self) -> AbstractContextManager:
        """DDP's no_sync, which a loop calls on the model before an accumulation window's last micro-batch: the
        engine's deferred reduction (deferred_reduction below)."""
        if self.engine is None:
            raise RuntimeError(self._not_built or "the zerodp engine is not built yet")
        return deferred_reduction(self.engine)

    def _get_name(self) -> str:
        # A loop that picks behaviour by the model class's name (a causal label shift) sees the user's model.
        return self.module._get_name()


class EngineOptimizer:
    """The optimizer a framework's loop holds: step() is the engine's step (reduce, clip, update, gather), after
    the closure if one is given (torch's contract: it recomputes the loss, which step() returns)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.state: dict = {}  # nothing for a loop to move between devices: the state is sharded in the engine
        self.defaults = getattr(engine.optimizer, "defaults", {})
        # The lr the last update used, for an EngineScheduler's get_last_lr: kept only once one exists, since
        # reading the lr settles a step decided on the device (a wait a loop without one does not pay).
        self.last_lr: list[float] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        result = closure() if closure is not None else None
        if self.last_lr is not None:
            self.last_lr = self.engine.get_lr()
        self.engine.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()  # gradients live in the engine's buckets, cleared by step()

    def state_dict(self) -> dict:
        return {}  # the state is in the engine's sharded checkpoint, which every rank writes its share of

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError("the zerodp engine's optimizer state is restored from its sharded checkpoint "
                             "(engine.load_checkpoint), not from a state dict")


class EngineScheduler:
    """The lr scheduler of a loop that steps its own: the engine steps the real one after each update it does
    not skip (as DeepSpeed does), so step() here does nothing; get_last_lr() is the lr of the last update."""

    def __init__(self, optimizer: EngineOptimizer) -> None:
        self.optimizer = optimizer
        optimizer.last_lr = optimizer.engine.get_lr()  # before any update: the lr the first one will use

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return list(self.optimizer.last_lr)


def defers_reduction(engine: Engine) -> bool:
    """Whether a backward can hold its gradients back for a later one (engine.no_sync): stages 0-1, which keep
    whole gradients; stages 2-3 reduce-scatter each gradient as backward produces it, to keep only a shard."""
    return not inside(engine).spec.keeps_gradient_shard


def deferred_reduction(engine: Engine) -> AbstractContextManager:
    """A loop's "no gradient sync on this micro-batch": engine.no_sync() where the engine defers reductions;
    elsewhere nothing, since each backward reduce-scatters into the shard's accumulator, which sums the same
    gradients (the engine steps after gradient_accumulation_steps backwards either way)."""
    return engine.no_sync() if defers_reduction(engine) else nullcontext()
