"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3) read into zerodp: the one place that knows DeepSpeed's names.

A DeepSpeed save_dir holds `latest` (the tag) and `{tag}/` with `mp_rank_00_model_states.pt` (stages
1-2; `zero_pp_rank_{r}_mp_rank_00_model_states.pt` per rank in stage 3) and one
`[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` per data-parallel rank. Each optimizer file holds
that rank's fp32 partition of every param group and the base optimizer's state (exp_avg, exp_avg_sq,
step) over the same partition:
  stages 1-2  a group's parameters are flattened in `param_shapes` order (with optional padding after
              each, `param_alignment_paddings`), the flat vector is padded to the world size and cut
              into one contiguous partition per rank;
  stage 3     every parameter is cut on its own: rank r holds elements [r*k, (r+1)*k) with
              k = ceil(numel / world), the pieces of a group's parameters concatenated in order.
`read` works out where each parameter's elements lie in those partitions (`Segment`s, by parameter
name: the layout-free view zerodp's own checkpoints use); `load` copies out the pieces this rank now
owns, on any world size and stage, and hands them to apply.py's `apply` like a zerodp checkpoint's: the
engine never learns DeepSpeed's names. The optimizer files are memory-mapped, so a rank reads about
its own share of them. DeepSpeed's files are pickles: they are read with
torch.load(weights_only=True) and an allow-list of the few DeepSpeed globals they hold (`ALLOWED`),
mapped to inert stand-ins; anything else is refused with its name.
"""

from __future__ import annotations

import enum
import glob
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field

import torch

from zerodp.checkpoint.apply import Parts, Staged, apply
from zerodp.checkpoint.errors import CheckpointError, agree
from zerodp.checkpoint.files import LATEST  # DeepSpeed names its tag file as zerodp does
from zerodp.checkpoint.pieces import owned_pieces, sharded_frozen, signature, tp_size, untrained
from zerodp.engine.engine import inside
from zerodp.engine.sharding.weights import Weights

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
# Optimizer state that is not Adam's would be loaded under the wrong names: refuse it.
ADAM = ("Adam", "AdamW")
# Implementation switches of torch's AdamW, not hyperparameters: the engine's own optimizer keeps its.
_IMPLEMENTATION = {"foreach", "fused", "capturable", "differentiable", "params"}


class _Record:
    """Stand-in for a DeepSpeed object (a loss scaler): its attributes, nothing callable."""


class _ZeroStage(enum.IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (pickled as ZeroStageEnum(n))."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclass
class _FragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (stages 1-2 write one per parameter)."""

    numel: int = 0
    start: int = 0


# The DeepSpeed globals its ZeRO checkpoints hold (0.1x), each read as an inert stand-in. Everything
# else in them (tensors, torch.Size, OrderedDict, builtins) is on torch's own weights_only list.
ALLOWED = [(_Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
           (_Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
           (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
           (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address")]


def torch_load(file: str, mmap: bool = False) -> dict:
    """torch.load(weights_only=True) admitting the globals in ALLOWED; a CheckpointError names any other."""
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"the global {found.group(1)}" if found else str(e).splitlines()[-1][:200]
        raise CheckpointError(f"refusing to load '{file}': it holds {what}, which is not among the globals "
                              "a DeepSpeed checkpoint writes (unpickling it could run code)") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise CheckpointError(f"DeepSpeed checkpoint file '{file}' cannot be read ({type(e).__name__}: {e})") from None


# ---- finding one ---------------------------------------------------------------------------------
def _is_tag_dir(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in MODEL_STATES)


def find(load_dir: str, tag: str | None = None) -> str | None:
    """The tag directory of a DeepSpeed checkpoint at `load_dir` (a save_dir or a tag dir), or None."""
    load_dir = os.fspath(load_dir)
    if tag is None and _is_tag_dir(load_dir):
        return load_dir
    if tag is None:
        try:
            with open(os.path.join(load_dir, LATEST)) as f:
                tag = f.read().strip()
        except (OSError, UnicodeDecodeError):
            return None
    path = os.path.join(load_dir, tag)
    return path if tag and "/" not in tag and _is_tag_dir(path) else None


def directory_contents(path: str) -> str:
    """What a directory holds, for an error that says what was found instead of a checkpoint."""
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return f"it cannot be listed ({e.strerror})"
    if not names:
        return "it is empty"
    shown = [n + ("/" if os.path.isdir(os.path.join(path, n)) else "") for n in names[:8]]
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return f"found: {', '.join(shown)}{more}"


# ---- reading one: where each parameter's elements lie in the rank partitions -----------------------
@dataclass(frozen=True)
class Segment:
    """Elements [start, start + numel) of a parameter, at `offset` in rank `rank`'s partition of its group."""

    rank: int
    offset: int
    start: int
    numel: int


@dataclass(frozen=True)
class _Layout:
    """How a DeepSpeed ZeRO stage lays its optimizer files out (the module docstring's two layouts)."""

    flats: str            # the key of each rank's fp32 flat partitions
    base: str             # the key of the wrapped optimizer's state dict
    per_parameter: bool   # stage 3: each parameter cut on its own (frozen ones too, in per-rank model files)


_FLAT = _Layout("single_partition_of_fp32_groups", "base_optimizer_state", per_parameter=False)
_LAYOUTS = {1: _FLAT, 2: _FLAT, 3: _Layout("fp32_flat_groups", "optimizer_state_dict", per_parameter=True)}


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint: its rank partitions (memory-mapped) and where each parameter lies in them."""

    path: str
    stage: int
    world_size: int
    groups: list[list[str]]                      # parameter names of each param group, DeepSpeed's order
    shapes: dict[str, torch.Size]
    parts: dict[str, list[list[torch.Tensor]]]   # "master" or optimizer key -> [group][rank] flat partition
    segments: dict[str, tuple[int, list[Segment]]]  # name -> (group, its segments)
    scalars: dict[str, torch.Tensor]             # "{group}/{key}" -> 0-dim (Adam's step)
    param_groups: list[dict]
    model: dict                                  # mp_rank_00_model_states.pt (rank 0's in stage 3)
    untrained: dict[str, torch.Tensor] = field(default_factory=dict)  # buffers, frozen parameters
    loss_scaler: dict = field(default_factory=dict)

    def copy(self, kind: str, name: str, start: int, dest: torch.Tensor) -> None:
        """dest[:] = elements [start, start + dest.numel()) of `kind` ("master", "exp_avg", ...) of `name`."""
        g, segments = self.segments[name]
        end = start + dest.numel()
        for s in segments:
            lo, hi = max(s.start, start), min(s.start + s.numel, end)
            if lo < hi:
                src = self.parts[kind][g][s.rank]
                dest[lo - start:hi - start].copy_(src[s.offset + lo - s.start:s.offset + hi - s.start])

    def whole(self, kind: str, name: str) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=torch.float32)
        self.copy(kind, name, 0, out.view(-1))
        return out


def verify_records(path: str, rank: int = 0, world_size: int = 1) -> None:
    """Check the CRC-32 of every record of the checkpoint's files (torch.save writes zip archives, whose
    records carry one; torch.load does not check them, so a damaged byte would load as a wrong value).
    Rank r of world_size checks every world_size-th file, so that N ranks read the files once between
    them; the load agrees on the result. A file in torch's legacy (non-zip) format has nothing to check."""
    for file in sorted(glob.glob(os.path.join(path, "*.pt")))[rank::world_size]:
        if not zipfile.is_zipfile(file):
            continue
        try:
            with zipfile.ZipFile(file) as z:
                bad = z.testzip()  # reads every record in chunks, comparing its CRC-32
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise CheckpointError(f"DeepSpeed checkpoint file '{file}' is corrupt: {e}") from None
        if bad is not None:
            raise CheckpointError(f"DeepSpeed checkpoint file '{file}' is corrupt: its record '{bad}' fails its "
                                  "CRC-32 check (a changed or damaged byte); refusing to load it")


def read(path: str) -> DeepSpeedCheckpoint:
    """Read the DeepSpeed checkpoint in tag directory `path`; one process, no group.

    The optimizer files are memory-mapped: a rank that copies out only the pieces it owns reads
    only those pages (about 1/N of the optimizer state), not every rank's file whole. Their records'
    checksums are checked by `verify_records`, which the caller runs first.
    """
    try:
        return _read(path)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"DeepSpeed checkpoint '{path}' is not laid out as DeepSpeed 0.1x writes ZeRO "
                              f"checkpoints ({type(e).__name__}: {e}): corrupt, or from another version") from None


def _read(path: str) -> DeepSpeedCheckpoint:
    model_file = next(os.path.join(path, f) for f in MODEL_STATES if os.path.isfile(os.path.join(path, f)))
    model = torch_load(model_file, mmap=True)  # stages 1-2 hold every working-precision weight in it
    world = model.get("dp_world_size")
    if not isinstance(world, int) or world < 1 or not isinstance(model.get("param_shapes"), list):
        raise CheckpointError(f"'{path}' is not a DeepSpeed ZeRO checkpoint zerodp can read: its model states "
                              "have no dp_world_size / param_shapes (a checkpoint without ZeRO?)")
    if model.get("mp_world_size", 1) != 1:
        raise CheckpointError(f"DeepSpeed checkpoint '{path}' was saved with model (tensor/pipeline) parallelism "
                              f"of {model['mp_world_size']}: zerodp reads data-parallel ZeRO checkpoints only")
    optim = [_optim_file(path, r) for r in range(world)]
    stage = int(optim[0].get("zero_stage", 1))  # BF16_Optimizer (bf16 stage 1, fp32 accumulation) has none
    groups = [list(g) for g in model["param_shapes"]]
    shapes = {n: torch.Size(s) for g in model["param_shapes"] for n, s in g.items()}
    _check_module_shapes(model_file, model.get("module") or {}, shapes)
    if stage not in _LAYOUTS:
        raise CheckpointError(f"DeepSpeed checkpoint '{path}' is of ZeRO stage {stage}; zerodp reads stages 1-3")
    layout = _LAYOUTS[stage]
    flats, base = layout.flats, [o[layout.base] for o in optim]
    if len(optim[0][flats]) != len(groups):  # stage 3 sub-groups smaller than a param group
        raise CheckpointError(f"DeepSpeed checkpoint '{path}' has {len(optim[0][flats])} flat partitions for "
                              f"{len(groups)} param groups (sub_group_size split them); zerodp reads one per group")
    parts = {"master": [[o[flats][g].detach() for o in optim] for g in range(len(groups))]}
    scalars = {}
    for g in range(len(groups)):
        per_rank = [b["state"].get(g, {}) for b in base]
        for key, v in per_rank[0].items():
            if torch.is_tensor(v) and v.dim() == 0:
                scalars[f"{g}/{key}"] = v.clone()
            elif torch.is_tensor(v):
                parts.setdefault(key, [None] * len(groups))[g] = [s[key].detach() for s in per_rank]
    paddings = optim[0].get("param_alignment_paddings") or [[0] * len(g) for g in groups]
    locate = _segments3 if layout.per_parameter else _segments12
    segments = {}
    for g, names in enumerate(groups):
        for name, segs in locate(names, shapes, world, parts["master"][g][0].numel(), paddings[g]).items():
            _check_segments(name, shapes[name], segs, [p[g] for p in parts.values()])
            segments[name] = (g, segs)
    scaler = optim[0].get("loss_scaler")
    return DeepSpeedCheckpoint(path, stage, world, groups, shapes, parts, segments, scalars,
                               base[0]["param_groups"], model, _untrained(path, model, shapes, world, layout),
                               dict(vars(scaler)) if isinstance(scaler, _Record) else {})


def _check_module_shapes(file: str, module: dict, shapes: dict[str, torch.Size]) -> None:
    """The model states' weights (stages 1-2 hold them whole; stage 3 empty) against param_shapes."""
    for name, shape in shapes.items():
        t = module.get(name)
        if torch.is_tensor(t) and t.numel() > 0 and t.shape != shape:
            raise CheckpointError(f"DeepSpeed checkpoint file '{file}' is corrupt: its weight '{name}' has shape "
                                  f"{tuple(t.shape)} where its param_shapes say {tuple(shape)}")


def _optim_file(path: str, rank: int) -> dict:
    found = sorted(glob.glob(os.path.join(path, f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")))
    if len(found) != 1:
        raise CheckpointError(f"DeepSpeed checkpoint '{path}' is incomplete: {'no' if not found else 'more than one'}"
                              f" optimizer file for data-parallel rank {rank} (zero_pp_rank_{rank}_mp_rank_00_"
                              f"optim_states.pt); {directory_contents(path)}")
    sd = torch_load(found[0], mmap=True)
    if not isinstance(sd.get("optimizer_state_dict"), dict):
        raise CheckpointError(f"'{found[0]}' has no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file")
    return sd["optimizer_state_dict"]


def _segments12(names: list[str], shapes: dict, world: int, size: int, paddings: list[int]) -> dict:
    """Stages 1-2: the group flattened in order (padding after each parameter), cut into `size` per rank."""
    out, offset = {}, 0
    for name, pad in zip(names, paddings):
        n = shapes[name].numel()
        out[name] = [Segment(r, max(offset, r * size) - r * size, max(offset, r * size) - offset,
                             min(offset + n, (r + 1) * size) - max(offset, r * size))
                     for r in range(offset // size, (offset + n - 1) // size + 1)] if n else []
        offset += n + pad
    return out


def _segments3(names: list[str], shapes: dict, world: int, size: int, paddings: list[int]) -> dict:
    """Stage 3: each parameter cut on its own into `world` pieces of ceil(numel / world) elements."""
    out, offset = {}, 0
    for name in names:
        n = shapes[name].numel()
        k = math.ceil(n / world)
        out[name] = [Segment(r, offset, r * k, min(k, n - r * k)) for r in range(world) if r * k < n]
        offset += k
    return out


def _check_segments(name: str, shape: torch.Size, segments: list[Segment], parts: list[list[torch.Tensor]]) -> None:
    """Every element of the parameter, inside every rank's partition (masters and each optimizer state)."""
    if sum(s.numel for s in segments) != shape.numel():
        raise ValueError(f"the DeepSpeed partitions place {sum(s.numel for s in segments)} of the "
                         f"{shape.numel()} elements of '{name}'")
    for per_rank in parts:
        for s in segments:
            if s.rank >= len(per_rank) or s.offset + s.numel > per_rank[s.rank].numel():
                have = per_rank[s.rank].numel() if s.rank < len(per_rank) else 0
                raise ValueError(f"rank {s.rank}'s DeepSpeed partition has {have} elements, '{name}' needs "
                                 f"{s.offset + s.numel} (truncated, or not the layout of param_shapes)")


def _untrained(path: str, model: dict, shapes: dict, world: int, layout: _Layout) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters: whole in `module`, except stage 3's frozen parameters (cut per rank)."""
    module, tied = model.get("module") or {}, model.get("shared_params") or {}
    out = {n: t for n, t in module.items() if n not in shapes and n not in tied and t.numel() > 0}
    frozen = model.get("frozen_param_shapes") or {}
    if layout.per_parameter and frozen:
        ranks = [torch_load(os.path.join(path, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"), mmap=True)
                 for r in range(world)]
        for name, shape in frozen.items():
            out[name] = torch.cat([r["frozen_param_fragments"][name].flatten() for r in ranks])[
                :torch.Size(shape).numel()].view(shape).clone()
    return out


# ---- loading one into an engine ------------------------------------------------------------------
def load(engine, path: str, parts=None) -> dict:
    """load_checkpoint for a DeepSpeed tag directory: stage, agree on every rank, then apply.py."""
    err = manifest = staged = None
    try:
        if tp_size(engine) > 1:  # its partitions are of whole parameters: a tp rank would read another's
            raise CheckpointError(f"'{path}' is a DeepSpeed checkpoint, which loads into a job without tensor "
                                  f"parallelism only (this one has tp {tp_size(engine)}): load it without tp and "
                                  "save a zerodp checkpoint, or `zerodp consolidate` it")
        verify_records(path, inside(engine).comm.rank, inside(engine).comm.world_size)
        ckpt = read(path)
        _check_model(engine, ckpt)
        manifest = _manifest(engine, ckpt)
        staged = _stage(engine, ckpt)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:  # noqa: BLE001 - must reach the agreement below, or other ranks hang
        err = f"loading the DeepSpeed checkpoint '{path}' failed: {type(e).__name__}: {e}"
    agree(inside(engine).comm, err)
    apply(engine, manifest, staged, parts or Parts())
    return manifest["client_state"]


def _check_model(engine, ckpt: DeepSpeedCheckpoint) -> None:
    prefix = f"DeepSpeed checkpoint '{ckpt.path}' is of a different model:"
    group_of = {n: g for g, names in enumerate(ckpt.groups) for n in names}
    current = signature(engine)
    trained = {e["name"]: e for e in current if e["kind"] == "trained" and e["alias_of"] is None}
    for name, e in trained.items():
        if name not in ckpt.shapes:
            raise CheckpointError(f"{prefix} parameter '{name}' {tuple(e['shape'])} is not in it (it trains "
                                  f"{', '.join(list(ckpt.shapes)[:6])}...)")
        if list(ckpt.shapes[name]) != e["shape"]:
            raise CheckpointError(f"{prefix} parameter '{name}' has shape {tuple(ckpt.shapes[name])} in the "
                                  f"checkpoint and {tuple(e['shape'])} in the model")
        if group_of[name] != e["group"]:
            raise CheckpointError(f"DeepSpeed checkpoint '{ckpt.path}': parameter '{name}' is in param group "
                                  f"{group_of[name]} there and in group {e['group']} of the optimizer: build the "
                                  "optimizer's param groups as the DeepSpeed run did")
    for name in ckpt.shapes:
        if name not in trained:
            raise CheckpointError(f"{prefix} it trains parameter '{name}' {tuple(ckpt.shapes[name])}, which the "
                                  "model does not train")
    for name in [*untrained(engine), *sharded_frozen(engine)]:
        if name not in ckpt.untrained:
            raise CheckpointError(f"{prefix} buffer or frozen parameter '{name}' is not in it")
    if type(engine.optimizer).__name__ not in ADAM:
        raise CheckpointError(f"DeepSpeed checkpoint '{ckpt.path}' holds Adam state (exp_avg, exp_avg_sq, step); "
                              f"the optimizer is {type(engine.optimizer).__name__}: use torch.optim.AdamW or Adam")
    if len(ckpt.param_groups) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"DeepSpeed checkpoint '{ckpt.path}' has {len(ckpt.param_groups)} optimizer param "
                              f"groups, the optimizer has {len(engine.optimizer.param_groups)}")


def _stage(engine, ckpt: DeepSpeedCheckpoint) -> Staged:
    """This rank's shard of every master and optimizer state, copied out of the rank partitions."""
    kinds = {k: [torch.zeros(m.numel(), dtype=torch.float32) for m in inside(engine).master_shards()] for k in ckpt.parts}
    for pc in owned_pieces(engine):
        for kind, dests in kinds.items():
            ckpt.copy(kind, pc.name, pc.start, dests[pc.master][pc.offset:pc.offset + pc.numel])
    model_state = {n: ckpt.untrained[n].to(t.dtype).view(t.shape) for n, t in untrained(engine).items()}
    model_state.update({n: ckpt.untrained[n] for n in sharded_frozen(engine)})  # apply cuts this rank's pieces
    masters = kinds.pop("master")
    return Staged(masters, kinds, dict(ckpt.scalars), model_state, {})


def _manifest(engine, ckpt: DeepSpeedCheckpoint) -> dict:
    """What apply.py's apply reads from a zerodp.json, from DeepSpeed's host state."""
    ds_config = ckpt.model.get("ds_config") or {}
    fp16 = bool((ds_config.get("fp16") or {}).get("enabled"))
    schedule = _lr_scheduler(engine, ckpt, ds_config)  # first: it may set the groups' lr
    groups = [{k: v for k, v in g.items() if k not in _IMPLEMENTATION and k in mine}
              for g, mine in zip(ckpt.param_groups, engine.optimizer.param_groups)]
    reserved = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                "ds_version", "checkpoint_parallel_dimensions", "num_experts", "ds_autoep_layers"}
    return {
        "counters": {"global_steps": int(ckpt.model.get("global_steps", 0)),
                     "skipped_steps": int(ckpt.model.get("skipped_steps", 0))},
        "param_groups": groups,
        "optim_scalars": {},
        "dtype": str(torch.float16) if fp16 else str(torch.float32),
        "loss_scaler": _loss_scaler(engine, ckpt.loss_scaler),
        "lr_scheduler": schedule,
        "config": engine.config.model_dump(mode="json"),
        "rng": {},  # DeepSpeed saves no RNG state: every rank gets a distinct seeded stream
        "client_state": {k: v for k, v in ckpt.model.items() if k not in reserved},
    }


def _loss_scaler(engine, ds: dict) -> dict:
    """DeepSpeed's (Dynamic)LossScaler attributes in zerodp's LossScaler names; the rest keeps the config's."""
    state = inside(engine).training.scaler.state_dict()
    names = {"cur_scale": "scale", "cur_iter": "cur_iter", "last_overflow_iter": "last_overflow_iter",
             "cur_hysteresis": "cur_hysteresis"}
    state.update({mine: ds[theirs] for theirs, mine in names.items() if ds.get(theirs) is not None})
    state["scale"] = float(state["scale"])
    return state


def _lr_scheduler(engine, ckpt: DeepSpeedCheckpoint, ds_config: dict) -> dict | None:
    """DeepSpeed's scheduler position as the engine scheduler's state.

    DeepSpeed's schedulers have taken the lr for `last_batch_iteration`, one less than the optimizer
    steps taken; zerodp's optimizer step t runs at DeepSpeed's get_lr(t - 1) (config/scheduler.py), so
    the resumed run keeps DeepSpeed's sequence with the engine scheduler's last_epoch at
    last_batch_iteration + 1 and its last lrs at the saved param groups' lrs.
    """
    saved, sched = ckpt.model.get("lr_scheduler"), engine.lr_scheduler
    theirs = ds_config.get("scheduler")
    if sched is None:
        if saved is None:
            return None
        raise CheckpointError(f"DeepSpeed checkpoint '{ckpt.path}' has an lr scheduler and the engine has none: "
                              f"configure the DeepSpeed run's 'scheduler' section ({theirs!r}) to continue it")
    state = sched.state_dict()
    if saved is None:  # a constant lr in DeepSpeed: the engine's own schedule goes on from the step count
        if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
            raise CheckpointError(f"DeepSpeed checkpoint '{ckpt.path}' has no lr scheduler; the engine's "
                                  f"{type(sched).__name__} cannot be placed at its step "
                                  f"{ckpt.model.get('global_steps')}")
        step = int(ckpt.model.get("global_steps", 0))
        lrs = [base * f(step) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(ckpt.param_groups, lrs):
            group["lr"] = lr
        state.update(last_epoch=step, _step_count=step + 1, _last_lr=lrs)
        return state
    mine = engine.config.scheduler
    if theirs is not None and mine is not None and (
            mine.type.lower() != str(theirs.get("type", "")).lower() or mine.params != theirs.get("params", {})):
        raise CheckpointError(f"DeepSpeed checkpoint '{ckpt.path}' was trained with scheduler {theirs!r}, the "
                              f"config has {mine.model_dump()!r}: use the same 'scheduler' section")
    if "last_batch_iteration" not in saved:
        raise CheckpointError(f"DeepSpeed checkpoint '{ckpt.path}' holds lr scheduler state {sorted(saved)}, "
                              "not DeepSpeed's (last_batch_iteration): zerodp cannot continue it")
    last = int(saved["last_batch_iteration"]) + 1
    state.update(last_epoch=last, _step_count=last + 1, _last_lr=[g["lr"] for g in ckpt.param_groups])
    return state


# ---- consolidating one ---------------------------------------------------------------------------
def weights(path: str) -> Weights:
    """A DeepSpeed tag dir's weights keyed like module.state_dict(), trained parameters from their fp32
    master partitions, each made whole only when the stream reaches it: the partitions are
    memory-mapped, so one tensor at a time is in memory, never the model. Aliases (DeepSpeed's
    shared_params) come last and share their source's values."""
    verify_records(path)
    ckpt = read(path)
    ties = dict(ckpt.model.get("shared_params") or {})
    order = list(ckpt.model.get("module") or {}) or list(ckpt.shapes)
    names = [n for n in order + [n for n in ckpt.shapes if n not in order]
             if n not in ties and (n in ckpt.shapes or n in ckpt.untrained)]
    shapes = {}
    for name in names:
        t = ckpt.untrained.get(name)
        shapes[name] = (ckpt.shapes[name], torch.float32) if name in ckpt.shapes else (
            t.shape, torch.float32 if t.is_floating_point() else t.dtype)
    shapes.update({alias: shapes[source] for alias, source in ties.items()})

    def stream():
        for name in names:
            if name in ckpt.shapes:
                yield name, ckpt.whole("master", name)
            else:
                t = ckpt.untrained[name]
                yield name, t.float() if t.is_floating_point() else t
    return Weights(shapes, ties, stream())

