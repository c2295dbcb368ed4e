"""What the user's optimizer is allowed to see of a parameter: a flat shard, or the whole parameter.

An element-wise optimizer (Adam, SGD, ...) updates each element from that element's gradient and state
alone, so any cut of the model is the same algorithm: it steps flat 1-D shards of the buckets (flat.py),
1/N of every bucket per rank. Every other optimizer looks at a parameter as a whole (Adafactor's row and
column statistics, Muon's orthogonalisation, LAMB's trust ratio, a user's row norms): handed a flat shard
it would run another algorithm, silently. Those step WHOLE parameters: the layout puts each parameter
whole into one rank's shard of its bucket (flat.lay_out, `whole`), and that rank's optimizer steps it in
its own shape (its state in that shape); the others never see it. Reduce-scatter and all-gather are the
same bucketed collectives as for flat shards.

Which is which: torch's element-wise classes (ELEMENT_WISE), and any class that declares itself with a
class attribute `zerodp_element_wise = True` (False forces whole parameters). Anything else steps whole
parameters. An optimizer whose step needs a closure (LBFGS) re-evaluates the loss and couples every
parameter: it is refused by name (`refusal`), as is SparseAdam (the buckets hold dense gradients).

Several optimizers (Muon on the hidden matrices, AdamW on the rest) are given as a list and stepped as
one (`Optimizers`); each of their param groups keeps its own view.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict, defaultdict
from typing import Callable, Sequence

import torch
from torch.optim import Optimizer

from zerodp.engine.layout.spec import OptimizerView

# torch.optim's classes whose update is element by element (their foreach and fused forms included).
ELEMENT_WISE: frozenset[type] = frozenset(getattr(torch.optim, n) for n in (
    "Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop"))


# What initialize takes: an optimizer, or a factory params -> optimizer (DeepSpeed's callable form).
OptimizerLike = Optimizer | Callable[[list], Optimizer]


def view_of(optimizer_class: type) -> OptimizerView:
    """The view an optimizer class steps exactly on."""
    declared = getattr(optimizer_class, "zerodp_element_wise", None)
    if declared is None:
        declared = optimizer_class in ELEMENT_WISE
    return OptimizerView.FLAT_SHARDS if declared else OptimizerView.WHOLE_PARAMETERS


def refusal(optimizer_class: type) -> str | None:
    """Why zerodp cannot step this optimizer class exactly, or None."""
    name = optimizer_class.__name__
    if optimizer_class is getattr(torch.optim, "SparseAdam", None):
        return (f"{name} steps sparse gradients, and ZeRO's gradient buckets are dense; use torch.optim.Adam "
                "(or AdamW)")
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return (f"{name}.step needs a closure that re-evaluates the loss over every parameter (its step couples "
                "them all), which engine.step() does not take; use a first-order optimizer such as "
                "torch.optim.AdamW, or Adafactor / Muon for shape-aware updates")
    return None


def probe_class(factory: Callable[[list], Optimizer]) -> type:
    """The class a factory params -> Optimizer builds, from a build on one 1x1 tensor (a 2-D one: Muon
    refuses anything else)."""
    built = factory([torch.zeros(1, 1, requires_grad=True)])
    if not isinstance(built, Optimizer):
        raise TypeError(f"the optimizer factory returned {type(built).__name__}, expected a torch.optim.Optimizer")
    return type(built)


class Optimizers(Optimizer):
    """Several optimizers over disjoint parameters, stepped as one: their param groups in order, one
    state shared by all (keyed by tensor, so they never collide), one step. What a scheduler, a
    checkpoint and the engine see as `engine.optimizer`."""

    def __init__(self, optimizers: Sequence[Optimizer]):
        self.optimizers = list(optimizers)  # the user's, in the order given; their groups are ours
        self.defaults = {}
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self._patch_step_function()
        self.state = defaultdict(dict)
        for opt in self.optimizers:
            self.state.update(opt.state)
        self._link()

    def _link(self) -> None:
        """Our groups are the optimizers' own group dicts (a scheduler's lr reaches them); one state."""
        for opt in self.optimizers:
            opt.state = self.state
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]

    def group_owners(self) -> list[Optimizer]:
        """The optimizer of each of our param groups."""
        return [opt for opt in self.optimizers for _ in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: give them back to each optimizer
        groups = iter(self.param_groups)
        for opt in self.optimizers:
            opt.param_groups = [next(groups) for _ in opt.param_groups]
        self._link()

    def __repr__(self) -> str:
        return f"Optimizers({', '.join(type(o).__name__ for o in self.optimizers)})"


def rewired(optimizer: OptimizerLike, per_group: list[list[torch.Tensor]], shapes: dict[int, torch.Size]
             ) -> Optimizer:
    """The user's optimizer stepping `per_group`'s tensors instead of the model's parameters (or the factory's,
    built on them). shapes: id(parameter) -> its shape (a stage-3 parameter between uses is empty)."""
    if not isinstance(optimizer, Optimizer):
        built = optimizer([{"params": per_group[0]}])
        if not isinstance(built, Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}, expected a torch.optim.Optimizer")
        return built
    # Adagrad's accumulators, made at construction; None: a state it has stepped or loaded, which the
    # engine loads again in torch's format once the optimizer steps the shards (torch_state.py, has_stepped)
    initial = _initial_state(optimizer, shapes) or [{} for _ in per_group]
    optimizer.state.clear()
    for group, tensors, init in zip(optimizer.param_groups, per_group, initial):
        group["params"] = tensors
        for t in tensors if init else ():
            optimizer.state[t] = {k: torch.full_like(t, v) if isinstance(v, float) else v.clone()
                                  for k, v in init.items()}
    return optimizer


def has_stepped(optimizer: OptimizerLike, shapes: dict[int, torch.Size]) -> bool:
    """Whether the user's optimizer comes with a state of its own (it has stepped, or loaded one), not the one a
    freshly built optimizer makes. shapes: as for rewired."""
    return isinstance(optimizer, Optimizer) and _initial_state(optimizer, shapes) is None


def _initial_state(optimizer: Optimizer, shapes: dict[int, torch.Size]) -> list[dict] | None:
    """The state a freshly built optimizer made for each param group at construction (torch's Adagrad: a
    step of 0 and an accumulator filled with one value), as {key: fill value (float) of a per-element
    tensor, or a tensor of its own}, to be made again on the tensors it will step; [] per group when it made
    none. None when the state is not such a fresh one (the optimizer has stepped)."""
    out = []
    for group in optimizer.param_groups:
        states = [optimizer.state[p] for p in group["params"] if p in optimizer.state]
        if not states:
            out.append({})
            continue
        p0 = next(p for p in group["params"] if p in optimizer.state)
        init = {}
        for k, v in optimizer.state[p0].items():
            if not torch.is_tensor(v):
                return None
            if v.dim() > 0 and v.shape in (p0.shape, shapes.get(id(p0))):  # (stage 3: p0 released, empty)
                if not all(torch.equal(s[k], torch.full_like(s[k], v.flatten()[0])) for s in states):
                    return None
                init[k] = float(v.flatten()[0])
            elif k == "step" and float(v) != 0:
                return None
            else:
                init[k] = v
        out.append(init)
    return out
