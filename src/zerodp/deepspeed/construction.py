"""What a model's constructor wrote into its tensors under `deepspeed.zero.Init`, kept and replayed.

Init builds on the meta device, where a constructor's writes (`self.apply(self._init_weights)`, a `fill_`,
`nn.init.trunc_normal_`, its layers' own `reset_parameters`) store nothing. `Recorder`, a TorchFunctionMode
active inside Init, writes down each in-place call on a meta tensor (the outermost: `nn.init.normal_`, not
the `uniform_` inside it), through `.data` and `.detach()` aliases too, in the order the constructor made them.
initialize then materialises each module on CPU stand-ins (setup/initialisers.py) with `replay(module)` as its
initialiser: each of its tensors' calls again, each from the random state the whole build would have had
before it. Those states come from one pass over every call in order, one tensor's stand-in at a time; so every
parameter gets, bit for bit, the value a whole build with the same seed gives it (rank 0's, as DeepSpeed
keeps), and no rank holds the whole model.

What cannot be replayed is refused at initialize, naming the module and the call: a write through a view
(`w[0].fill_`), a call whose arguments read another meta tensor (their values do not exist), a module with
tensors on meta that the constructor never wrote and that has no reset_parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

# nn.init functions that return at once on meta, before any call the mode would see: wrapped while Init is open
# (reached as torch.nn.init.<name>; a name imported from torch.nn.init before the block is not wrapped)
_SILENT_ON_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")
_ALIASES = {torch.Tensor.detach, torch.Tensor.data.__get__}  # the same values under another tensor object
# Drawn on meta, they consume no random numbers there but do in a whole build: every later draw would shift.
_RANDOM_FACTORIES = {torch.randn, torch.rand, torch.randint, torch.randn_like, torch.rand_like, torch.randint_like,
                     torch.normal, torch.randperm, torch.bernoulli, torch.multinomial, torch.poisson}


@dataclass
class Call:
    """One in-place call on a tensor of the model, as the constructor made it."""

    order: int  # its place among every call recorded
    func: Callable
    args: tuple  # after the tensor itself
    kwargs: dict  # (nn.init's functions are handed the tensor as the keyword `tensor`: then it goes back there)
    shape: torch.Size
    dtype: torch.dtype
    keyword: str | None = None

    def on(self, t: torch.Tensor) -> None:
        """Make this call again, on t."""
        if self.keyword is None:
            self.func(t, *self.args, **self.kwargs)
        else:
            self.func(*self.args, **{**self.kwargs, self.keyword: t})


@dataclass
class Record:
    calls: list[Call] = field(default_factory=list)
    refusal: str | None = None  # why its values cannot be replayed
    drawn: list[str] = field(default_factory=list)  # random tensors made on meta in the same build (the Recorder's)


# A tensor's Record is an attribute of the tensor object (a weak reference to a Parameter would stop the
# engine's swap_tensors); replay_for reads them before set-up swaps anything.
_ATTRIBUTE = "_zerodp_construction"


def record_of(t: torch.Tensor) -> Record | None:
    return getattr(t, _ATTRIBUTE, None)


class Recorder(TorchFunctionMode):
    """Records in-place calls on meta tensors while a model is built under zero.Init."""

    def __init__(self):
        super().__init__()
        self.depth = 0  # >0 inside a recorded call: what it calls in turn is part of it
        self.count = 0
        # alias or view -> (base tensor, is a view): temporaries (`.data`), never a module's own tensors
        self.base: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.drawn: list[str] = []  # random factories called on meta during the build
        self.originals: dict[str, Callable] = {}  # nn.init's functions wrapped while the block is open

    def __enter__(self):
        for name in _SILENT_ON_META:
            self.originals[name] = getattr(torch.nn.init, name)
            setattr(torch.nn.init, name, self._recording(self.originals[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.nn.init, name, original)
        return super().__exit__(*exc)

    def _recording(self, original: Callable) -> Callable:
        def init(tensor: torch.Tensor, *args, **kwargs):
            if tensor.is_meta and self.depth == 0:
                self._record(original, tensor, args, kwargs, None)
                return tensor
            return original(tensor, *args, **kwargs)
        return init

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        keyword = None if args else "tensor" if isinstance(kwargs.get("tensor"), torch.Tensor) else None
        target = args[0] if args else kwargs.get(keyword) if keyword else None
        target = target if isinstance(target, torch.Tensor) and target.is_meta else None
        name = getattr(func, "__name__", "")
        recorded = self.depth == 0 and target is not None and name.endswith("_") and not name.startswith("__")
        if recorded:
            rest = {k: v for k, v in kwargs.items() if k != keyword}
            self._record(func, target, args[1:], rest, keyword)
        self.depth += recorded
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= recorded
        if func in _RANDOM_FACTORIES and isinstance(out, torch.Tensor) and out.is_meta:
            self.drawn.append(f"{func.__name__} of shape {tuple(out.shape)}")
        if target is not None and isinstance(out, torch.Tensor) and out.is_meta and out is not target:
            base, view = self.base.get(target, (target, False))
            if func in _ALIASES:
                self.base[out] = (base, view)
            elif out._is_view():
                self.base[out] = (base, True)
        return out

    def _record(self, func, target: torch.Tensor, args: tuple, kwargs: dict, keyword: str | None) -> None:
        base, view = self.base.get(target, (target, False))
        record = record_of(base)
        if record is None:
            record = Record(drawn=self.drawn)
            setattr(base, _ATTRIBUTE, record)
        what = f"{getattr(func, '__qualname__', func)}"
        if view:
            record.refusal = record.refusal or f"{what} wrote through a view of it (only part of the tensor)"
        elif any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values())):
            record.refusal = record.refusal or f"{what} read another tensor built on meta, which holds no values"
        record.calls.append(Call(self.count, func, args, kwargs, base.shape, base.dtype, keyword))
        self.count += 1


def replay_for(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """initialize's param_init_fn for a model built under zero.Init, or None when nothing was recorded for it.
    ValueError, naming the module, for a tensor whose values cannot be replayed (local: every rank built the
    same model, so every rank raises before any collective)."""
    owned: dict[int, tuple[str, nn.Module, str, torch.Tensor]] = {}  # id(tensor) -> its first registration
    for mname, m in model.named_modules():
        for n, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and t.is_meta:
                owned.setdefault(id(t), (mname, m, n, t))
    records = {i: record_of(t) for i, (_, _, _, t) in owned.items() if record_of(t) is not None}
    if not records:
        return None
    drawn = next((r.drawn for r in records.values() if r.drawn), None)
    if drawn:
        raise ValueError(f"the model's constructor under deepspeed.zero.Init drew {drawn[0]} on the meta device, "
                         "which holds no values, and whose draw a whole build makes: every value drawn after it "
                         "would differ. Create the tensor with torch.empty and fill it in the module's "
                         "reset_parameters() (or in a self.apply(init) of the constructor)")
    per_module: dict[int, list[tuple[str, Record]]] = {}
    for i, (mname, m, n, _) in owned.items():
        record = records.get(i)
        refusal = (record.refusal if record else
                   None if callable(getattr(m, "reset_parameters", None)) else "its constructor never set it")
        if refusal:
            raise ValueError(f"module {mname or '(the model)'!r}: {n!r}, built under deepspeed.zero.Init, cannot "
                             f"be given the value its constructor set ({refusal}); set it inside the module's "
                             "reset_parameters(), or after deepspeed.initialize inside zero.GatheredParameters("
                             "params, modifier_rank=0)")
        per_module.setdefault(id(m), []).append((n, record))
    return Replay(records, per_module).run


class Replay:
    """Module by module, each tensor's recorded calls on its stand-in, from the whole build's random states."""

    def __init__(self, records: dict[int, Record], per_module: dict[int, list[tuple[str, Record | None]]]):
        self.per_module = per_module  # id(module) -> its own tensors' names and records (None: reset_parameters)
        self.calls = sorted((c for r in records.values() for c in r.calls), key=lambda c: c.order)
        self.states: dict[int, torch.Tensor] | None = None  # call order -> the random state before it
        self.end: torch.Tensor | None = None  # the random state after the last call

    def _learn_states(self) -> None:
        """One pass over every call in order, on a stand-in of its tensor made and dropped per call."""
        self.states = {}
        with torch.no_grad():
            for c in self.calls:
                self.states[c.order] = torch.get_rng_state()
                c.on(torch.empty(c.shape, dtype=c.dtype))
        self.end = torch.get_rng_state()

    def run(self, module: nn.Module) -> None:
        if self.states is None:  # the first module asked: the random state is the whole build's start (rank 0's)
            self._learn_states()
        mine = self.per_module.get(id(module), [])
        with torch.no_grad():
            if any(r is None for _, r in mine):
                module.reset_parameters()  # what its constructor left unwritten (torch.empty), as without Init
            for n, record in mine:
                t = module._parameters[n] if n in module._parameters else module._buffers[n]
                for c in record.calls if record else ():
                    torch.set_rng_state(self.states[c.order])
                    c.on(t)
        torch.set_rng_state(self.end)  # where the whole build leaves it, whatever module runs last
