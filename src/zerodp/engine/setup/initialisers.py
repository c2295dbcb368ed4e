"""The initialiser source: the values of a model built on `meta`, from each module's own initialiser.

A module with a tensor on `meta` registered directly on it is initialised by its
`reset_parameters()` (torch's convention, which FSDP follows) or by the `param_init_fn(module)` the
user passes (as FSDP1's). Units run one at a time on CPU, in `module.modules()` order (the order in
which a model that creates its layers in registration order constructs them, and so draws its random
numbers), starting from rank 0's CPU random state: each parameter then gets, bit for bit, the value a
whole build with the same seed gives it, without the whole model ever existing. A module keeps the
values of the tensors it owns (first registers); what it draws for a tied weight that another module
owns is only drawn, as the whole build draws it before tying.

The random state before each module is recorded as the walk first passes it, so the engine may ask for
parameters in any order: going back re-runs one module from its recorded state. Asked in module order,
every module runs once.

Each module's stand-ins are fresh heap blocks, and glibc often cannot reuse a freed one for the next module's
(torch asks posix_memalign for a little more than the block, and the block's trimmed tail, kept in the
thread cache, stops it from joining the heap's top): the heap would grow by one stand-in per module until
the engine's trim after the bucket, on ranks where the cache happens to have room. A Linear(2048, 2048)
stack on meta kept up to 0.6 GiB more on such ranks. Handing the freed pages back before each large module
runs holds every rank to one module's stand-ins.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import swap_tensors

from zerodp.distributed.device import return_freed_host_memory
from zerodp.engine.layout.flat import local

ParamInitFn = Callable[[nn.Module], None]

# A module with at least this many bytes of stand-ins first hands the freed heap pages back (malloc_trim,
# ~0.1-2 ms): below it, a module's retained stand-ins are small next to the cost of trimming before each.
TRIM_BYTES = 1 << 20


def meta_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the parameters and of the buffers that are on `meta` (tied ones under their first name)."""
    params = [n for n, p in module.named_parameters() if p.is_meta]
    buffers = [n for n, b in module.named_buffers() if b.is_meta]
    return params, buffers


class ModuleInit:
    """ParameterSource over the module initialisers of a meta-built model; also gives its buffers.

    `wanted`: the names (parameters and buffers) the initialisers give when weights give the rest; a module
    holding none of them is left out, neither run nor drawn for, as a build that loads its values from
    files (from_pretrained) draws nothing for it. None: every module with a tensor on meta."""

    def __init__(self, module: nn.Module, param_init_fn: ParamInitFn | None = None,
                 wanted: set[str] | None = None):
        self.param_init_fn = param_init_fn
        self.modules: list[nn.Module] = []
        self.module_names: list[str] = []
        self.module_of: dict[str, int] = {}  # a meta parameter's name -> the module that owns it
        self.buffer_modules: list[int] = []  # modules with a meta buffer of their own
        self.module_bytes: list[int] = []  # the bytes of each module's CPU stand-ins
        self.built: dict[int, tuple[torch.Size, torch.dtype]] = {}
        first = {id(p): n for n, p in module.named_parameters()}
        self.real = {n: p for n, p in module.named_parameters() if not p.is_meta}  # a partly meta model
        for mname, m in module.named_modules():
            direct = list(itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)))
            if not any(t.is_meta for t in direct) or not _holds_wanted(m, mname, first, wanted):
                continue
            k = len(self.modules)
            self.modules.append(m)
            self.module_names.append(mname)
            for p in m.parameters(recurse=False):
                # As built: the engine may give a parameter another shape (a flat view) and dtype.
                self.built[id(p)] = (p.shape, p.dtype)
                if p.is_meta:
                    self.module_of.setdefault(first[id(p)], k)
            if any(b.is_meta for b in m.buffers(recurse=False)):
                self.buffer_modules.append(k)
            self.module_bytes.append(sum(t.numel() * t.element_size() for t in direct))
        self.states: list[torch.Tensor] = []  # states[k]: the CPU random state before module k
        # As zerodp.initialize found it: set-up may draw random numbers before the modules run.
        self.initial_state = torch.get_rng_state()
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    # ---- checks (local: no collective) ----------------------------------------------------------
    def uninitialisable(self, names: list[str]) -> list[str]:
        """Those of the given parameter/buffer names whose module has no initialiser."""
        if self.param_init_fn is not None:
            return []
        wanted, out = set(names), []
        bare = {k for k, m in enumerate(self.modules) if not _has_initialiser(m)}
        for k in sorted(bare):
            prefix = self.module_names[k] + "." if self.module_names[k] else ""
            m = self.modules[k]
            for n, t in itertools.chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False)):
                if t.is_meta and prefix + n in wanted:
                    out.append(prefix + n)
        return out

    def check(self, shapes: dict[str, torch.Size]) -> None:
        missing = self.uninitialisable(list(shapes))
        if missing:
            raise ValueError(missing_initialiser(missing))

    # ---- values ---------------------------------------------------------------------------------
    def seed(self, state: torch.Tensor) -> None:
        """Begin from this CPU random state (rank 0's, so that every rank draws the same values)."""
        self.states = [state]

    def finish(self, advance: bool) -> None:
        """With `advance` (the initialisers gave the parameters), draw whatever modules were not asked for
        (a tied head), one at a time, and leave the CPU random state where the whole build leaves it;
        otherwise the rank's own state is restored."""
        self._cached = None
        while advance and len(self.states) <= len(self.modules):
            self._run(len(self.states) - 1)
        torch.set_rng_state(self.states[-1] if advance else self.initial_state)
        self._cached = None

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self.module_of:
            return local(self.real[name]).detach().reshape(-1)[start:stop]
        return self._values(self.module_of[name])[name].reshape(-1)[start:stop]

    def buffers(self) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
        """(module, buffer name, value) for every buffer that was on meta, module by module."""
        for k in self.buffer_modules:
            values = self._values(k)
            m = self.modules[k]
            for n, b in list(m.named_buffers(recurse=False)):
                key = f"{self.module_names[k]}.{n}" if self.module_names[k] else n
                if key in values:
                    yield m, n, values[key]

    def _values(self, k: int) -> dict[str, torch.Tensor]:
        """Module k's own tensors, initialised (the last module's are kept: slots of one module come together)."""
        if self._cached is not None and self._cached[0] == k:
            return self._cached[1]
        self._cached = None  # one module's values at a time
        while len(self.states) <= k:  # first pass over the modules before k: draw, to learn their states
            self._run(len(self.states) - 1)
        values = self._run(k)
        self._cached = (k, values)
        return values

    def _run(self, k: int) -> dict[str, torch.Tensor]:
        """Run module k's initialiser on CPU stand-ins for its own tensors; the module is left as it was
        (meta, or the places the engine has given them already: a tied weight may be in a flat buffer)."""
        m, prefix = self.modules[k], (self.module_names[k] + "." if self.module_names[k] else "")
        if self.module_bytes[k] >= TRIM_BYTES:
            # The last module's stand-ins, before this module's are made: freed blocks inside the heap go
            # back; as much of the heap's top as this module needs stays for it (~10 ms less per 16 MiB).
            return_freed_host_memory(keep=self.module_bytes[k])
        torch.set_rng_state(self.states[k])
        kept = {n: b for n, b in m.named_buffers(recurse=False)}
        for n, b in kept.items():
            setattr(m, n, torch.empty_like(b, device="cpu"))
        try:
            with torch.no_grad(), _stand_ins(m, self.built):
                if self.param_init_fn is not None:
                    self.param_init_fn(m)
                elif _has_initialiser(m):  # else it holds only tensors that other modules own (a tied weight)
                    m.reset_parameters()
                values = {prefix + n: b.detach() for n, b in m.named_buffers(recurse=False)}
                for n, p in m.named_parameters(recurse=False):
                    if self.module_of.get(prefix + n) == k:
                        values[prefix + n] = p.detach()
        finally:
            for n, b in kept.items():
                setattr(m, n, b)
        if len(self.states) == k + 1:
            self.states.append(torch.get_rng_state())
        return values


def _holds_wanted(m: nn.Module, mname: str, first: dict[int, str], wanted: set[str] | None) -> bool:
    """Whether module m registers a tensor on meta that `wanted` names (under its own or its first name)."""
    if wanted is None:
        return True
    prefix = mname + "." if mname else ""
    named = itertools.chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False))
    return any(t.is_meta and (prefix + n in wanted or first.get(id(t)) in wanted) for n, t in named)


def _has_initialiser(m: nn.Module) -> bool:
    return callable(getattr(m, "reset_parameters", None))


@contextlib.contextmanager
def _stand_ins(m: nn.Module, built: dict[int, tuple[torch.Size, torch.dtype]]) -> Iterator[None]:
    """Module m's own parameters are CPU stand-ins of their built shapes while its initialiser runs.
    swap_tensors keeps each Parameter object (the optimizer and the engine hold them by identity); a
    tensor-parallel DTensor cannot swap with a plain tensor, so the module holds a stand-in of the whole
    tensor in its place instead: the initialiser draws the whole tensor, as the whole build does, and the
    engine reads this rank's shard out of it (tp_shards)."""
    swapped = []
    for n, p in m.named_parameters(recurse=False):
        stand_in, held = _cpu_stand_in(p, *built[id(p)]), isinstance(p, DTensor)
        if held:
            m._parameters[n] = stand_in
        else:
            swap_tensors(p, stand_in)
        swapped.append((n, p, stand_in, held))
    try:
        yield
    finally:
        for n, p, stand_in, held in swapped:
            if held:
                m._parameters[n] = p
            else:
                swap_tensors(p, stand_in)


def _cpu_stand_in(p: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="cpu"), requires_grad=p.requires_grad)


def missing_initialiser(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"the model is on the 'meta' device and nothing can initialise {shown}: the module that "
            "registers it has no reset_parameters(); give that module a reset_parameters(), pass "
            "zerodp.initialize(..., param_init_fn=fn) with fn(module) initialising the module's own "
            "tensors, or build the model off 'meta'")
