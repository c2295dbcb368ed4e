"""Stage 3's units: which parameters are gathered, released and reduced together.

A unit is a module (its root) and every parameter registered in its subtree outside a nested unit (with a
bitsandbytes weight's per-block quantisation state, formats.block_state).
`zero_optimization.stage3_unit` (or `zerodp.initialize(..., stage3_unit=)`) chooses the roots:
  "blocks" (default)  the repeated children of the model: the members of an nn.ModuleList or
                      nn.Sequential whose children are all of one class (a transformer's blocks), or
                      of a class the model names in `_no_split_modules` (Hugging Face's list of the
                      same thing, read as a plain attribute); and the model itself for the rest;
  "module"            every module that registers parameters, one unit each;
  a list              module classes, class names or qualified module names; and the model for the rest;
  a function          module -> bool; and the model for the rest.
Why blocks: each unit costs an all-gather in the forward, one in the backward and a reduce-scatter,
each with a launch, a wait and hook work. A transformer block of ten small modules as ten units pays
that ten times; as one unit, once (FSDP2's wrapping: fully_shard per block, then the root).

The buckets (flat.lay_out) never split a unit; consecutive units share a bucket up to
`stage3_prefetch_bucket_size` elements (and `reduce_bucket_size`), and units under `stage3_param_persistence_threshold`
elements stay gathered (they share buckets only with each other). A unit's forward gathers the
buckets of every parameter its modules register, a tied parameter another unit owns included; a
parameter that code outside its unit reads before that unit runs is not gathered (as in FSDP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from zerodp.config import ConfigError, ZeroConfig
from zerodp.engine.layout.flat import Bucket, FlatGroup, lay_out
from zerodp.engine.layout.formats import block_state

UnitRule = str | Sequence[type | str] | Callable[[nn.Module], bool]


@dataclass
class Units:
    roots: list[nn.Module]
    of_param: dict[int, int]            # id(param) -> the unit of the first module registering it
    uses: list[list[nn.Parameter]]      # unit -> the parameters its modules register (tied ones too)
    outer: int | None                   # the model's own unit; None when the model is no unit's root

    def numel(self, params: list[nn.Parameter]) -> dict[int, int]:
        """Elements each unit owns among `params`."""
        out: dict[int, int] = {}
        for p in params:
            u = self.of_param[id(p)]
            out[u] = out.get(u, 0) + p.numel()
        return out


def find_units(model: nn.Module, rule: UnitRule) -> Units:
    """The units of `model` under `rule` (see the module docstring). Local: no collective."""
    roots = list({id(m): m for m in _roots(model, rule)}.values())
    index = {id(m): i for i, m in enumerate(roots)}
    unit_of_module = _assign(model, index)
    of_param: dict[int, int] = {}
    uses: list[dict[int, nn.Parameter]] = [{} for _ in roots]
    for m in model.modules():
        # a bitsandbytes layer's per-block quantisation state is sharded and gathered with its weight's words
        for p in [*m.parameters(recurse=False), *(t for _, t in block_state(m))]:
            u = unit_of_module[id(m)]
            of_param.setdefault(id(p), u)
            uses[u][id(p)] = p
    return Units(roots, of_param, [list(u.values()) for u in uses], index.get(id(model)))


def unit_rule(zero: ZeroConfig, given: UnitRule | None) -> UnitRule:
    """The rule in force: zerodp.initialize's stage3_unit, else the config's."""
    if given is None:
        return zero.stage3_unit
    if "stage3_unit" in zero.model_fields_set:
        raise ConfigError("stage3_unit is given both to zerodp.initialize and in zero_optimization; give it once")
    return given


def layout(groups: list[list[nn.Parameter]], units: Units, partitions: int, zero: ZeroConfig,
           whole: Sequence[bool] = ()) -> list[FlatGroup]:
    """Stage 3's buckets: units never split, persistent ones apart, small ones coalesced up to the
    prefetch size (and the reduce bucket size, which bounds the reduce buffers as in stage 2)."""
    sizes = units.numel([p for g in groups for p in g])
    persistent = {u for u, n in sizes.items() if n < zero.stage3_param_persistence_threshold}
    coalesce = min(zero.stage3_prefetch_bucket_size, zero.reduce_bucket_size)
    return lay_out(groups, partitions, coalesce, units.of_param, persistent, whole)


def nothing_partitioned(buckets: Sequence[Bucket], zero: ZeroConfig) -> str | None:
    """The line stage 3 says when every unit stays whole (all under stage3_param_persistence_threshold, the
    default 100,000 elements keeping every unit of a small model): memory as at stage 2; None otherwise."""
    if not buckets or not all(b.persistent for b in buckets):
        return None
    threshold = zero.stage3_param_persistence_threshold
    return (f"[zerodp] stage 3 partitions no parameter of this model: each of its units has fewer than "
            f"stage3_param_persistence_threshold={threshold:g} elements, so each stays whole on every rank (as "
            f"at stage 2); set zero_optimization.stage3_param_persistence_threshold lower (0 partitions every "
            f"unit) to shard them")


def _roots(model: nn.Module, rule: UnitRule) -> list[nn.Module]:
    if rule == "module":
        return [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    if rule == "blocks":
        names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
        return [model, *(_members(model) if _repeated(model) else _blocks(model, names))]
    if callable(rule) and not isinstance(rule, type):
        return [model, *(m for m in model.modules() if m is not model and rule(m))]
    if isinstance(rule, (list, tuple)) and rule:
        return [model, *_named(model, rule)]
    raise ConfigError(f"stage3_unit {rule!r} is not a unit rule; expected 'blocks', 'module', a non-empty list "
                      "of module classes, class names or module names, or a function module -> bool")


def _blocks(module: nn.Module, names: set[str]) -> list[nn.Module]:
    """The outermost repeated children under `module` (not descending into one once found)."""
    found: list[nn.Module] = []
    for child in module.children():
        if type(child).__name__ in names:
            found.append(child)
        elif _repeated(child):
            found += _members(child)
        else:
            found += _blocks(child, names)
    return found


def _repeated(m: nn.Module) -> bool:
    kids = list(m.children())
    return isinstance(m, (nn.ModuleList, nn.Sequential)) and len(kids) > 1 and len({type(k) for k in kids}) == 1


def _members(m: nn.Module) -> list[nn.Module]:
    return [k for k in m.children() if next(k.parameters(), None) is not None]


def _named(model: nn.Module, rule: Sequence[type | str]) -> list[nn.Module]:
    found: list[nn.Module] = []
    for entry in rule:
        hits = [m for name, m in model.named_modules()
                if (isinstance(entry, type) and isinstance(m, entry))
                or (isinstance(entry, str) and entry in (type(m).__name__, name))]
        if not hits:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"stage3_unit names {getattr(entry, '__name__', entry)!r}, which is neither a "
                              f"module class nor a module name of this model; its classes are {classes}")
        found += hits
    return found


def _assign(model: nn.Module, index: dict[int, int]) -> dict[int, int]:
    """id(module) -> its unit: its own if it is a root, else its nearest root ancestor's (pre-order,
    first path wins for a module that appears twice, as model.modules() lists it once)."""
    out: dict[int, int] = {}
    stack = [(model, index.get(id(model), -1))]
    while stack:
        m, unit = stack.pop()
        if id(m) in out:
            continue
        unit = index.get(id(m), unit)
        out[id(m)] = unit
        stack += [(c, unit) for c in reversed(list(m.children()))]
    return out


def kept_last(last: int | None, last_buckets: list[Bucket], prefetch_numel: int) -> int | None:
    """The forward's last unit stays gathered into the backward when its gathered elements fit in the
    prefetch budget (keeping it is prefetching it for the backward): `last`, else None."""
    moving = sum(b.numel for b in last_buckets if not b.persistent)
    return last if last is not None and moving <= prefetch_numel else None


def unit_buckets(units: Units, buckets: list[Bucket]) -> list[list[Bucket]]:
    """Each unit's buckets: those of every parameter its modules register, in index order."""
    bucket_of = {id(s.param): b for b in buckets for s in b.slots}
    return [sorted({id(b): b for p in used if (b := bucket_of.get(id(p))) is not None}.values(),
                   key=lambda b: b.index) for used in units.uses]


def planned_gathers(units: Units, buckets: list[Bucket], last_unit: int | None) -> tuple[int, int]:
    """All-gathers per micro-step, and their elements, once the forward's order is known: each bucket
    that is not persistent once in the forward, and once more in the backward unless the model's own
    unit or the last unit kept gathered (`last_unit`, see kept_last) reads it."""
    of_unit = unit_buckets(units, buckets)
    kept = {b.index for u in (units.outer, last_unit) if u is not None for b in of_unit[u]}
    moving = [b for b in buckets if not b.persistent]
    again = [b for b in moving if b.index not in kept]
    return len(moving) + len(again), sum(b.numel for b in moving + again)
