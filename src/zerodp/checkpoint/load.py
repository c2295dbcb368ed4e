"""load_checkpoint: resume from a checkpoint saved on any world size and stage.

Two phases, so that a bad checkpoint changes nothing: `_stage` reads and checks this rank's share into
fresh CPU tensors, every rank agrees that all of them succeeded (errors.agree), and only then
`apply` (apply.py) writes the masters, optimizer state, counters, scaler, scheduler and RNG into the engine.
Working-precision parameters are not stored: they are the masters cast to the working dtype,
exactly what a step would have left.

Tensor parallelism: with the tp size it was saved with, each tp rank reads the pieces of its own shards
(pieces.py), any data-parallel size. With another tp size (a checkpoint without tp into a tp job, or the
reverse, included) each rank reads whole every tensor it keeps a part of, its saved tp shards joined
(whole.py), and cuts out its own shard: more reading, one tensor held at a time. That needs each tp
shard's axis: a Megatron shard without partition_dim is refused, on every rank before the engine is touched.
"""

from __future__ import annotations


import torch
from torch.distributed.checkpoint.api import CheckpointException

from zerodp.checkpoint import deepspeed
from zerodp.checkpoint.apply import Parts, Staged, apply
from zerodp.checkpoint.errors import CheckpointError, agree, failure_text
from zerodp.checkpoint.pieces import (
    owned_frozen_pieces,
    owned_pieces,
    saved_pieces,
    sharded_frozen,
    signature,
    stored,
    tp_rank,
    tp_shapes,
    tp_shard,
    tp_size,
    untrained,
    whole_parameters,
)
from zerodp.checkpoint.read import LOAD_CHUNK_NUMEL, read_metadata, read_tensors, resolve
from zerodp.checkpoint.files import run_of, set_engine_run
from zerodp.checkpoint.whole import its_shard, plan
from zerodp.engine.engine import inside
from zerodp.engine.layout.flat import local


def load_checkpoint(engine, load_dir: str, tag: str | None = None, optimizer_states: bool = True,
                    lr_scheduler_states: bool = True, module_only: bool = False) -> dict:
    """Restore a checkpoint saved on any world size and stage; returns its client_state.

    Collective: call on every rank. Everything is read and checked before the engine is touched;
    a problem on any rank raises the same CheckpointError on every rank. optimizer_states /
    lr_scheduler_states False keep the engine's own; module_only loads the weights alone.
    """
    training = inside(engine).training
    with inside(engine).comm.names_peer_failure("in engine.load_checkpoint()"):
        # the disk tiers: the masters, states and parameter shards read in, loaded into, and written back
        with training.model_states_in_memory() if training is not None else inside(engine).sharded.shards_in_memory():
            return _load(engine, load_dir, tag, optimizer_states, lr_scheduler_states, module_only)


def _load(engine, load_dir: str, tag: str | None, optimizer_states: bool, lr_scheduler_states: bool,
          module_only: bool) -> dict:
    parts = Parts(optimizer_states and not module_only, lr_scheduler_states and not module_only, not module_only)
    ds_path = deepspeed.find(load_dir, tag)
    if ds_path is not None:  # a DeepSpeed ZeRO checkpoint: deepspeed.py reads it, apply.py loads it
        return deepspeed.load(engine, ds_path, parts)
    err = staged = manifest = None
    try:
        path, manifest = resolve(load_dir, tag)
        _check_model(engine, path, manifest)
        staged = _stage(engine, path, manifest)
    except CheckpointError as e:
        err = str(e)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reach the agreement, or other ranks hang
        err = f"loading the checkpoint from {load_dir!r} failed: {failure_text(e)}"
    agree(inside(engine).comm, err)
    apply(engine, manifest, staged, parts)
    if not module_only:  # the engine continues the checkpoint's run; with its weights alone it starts its own
        set_engine_run(engine, run_of(manifest))
    return manifest["client_state"] if manifest["client_state"] is not None else {}


def _check_model(engine, path: str, manifest: dict) -> None:
    current = signature(engine)
    saved = {e["name"]: e for e in manifest["model"]}
    names = {e["name"] for e in current}
    what = lambda e: "buffer" if e["kind"] == "buffer" else "parameter"  # noqa: E731
    prefix = f"checkpoint '{path}' is of a different model:"
    for e in current:
        s = saved.get(e["name"])
        if s is None:
            raise CheckpointError(f"{prefix} {what(e)} '{e['name']}' {tuple(e['shape'])} is not in the checkpoint")
        if _resharding(engine, manifest):
            _check_axis_known(engine, path, manifest, e, s)
        if ("tp" in e or "tp" in s) and not _resharding(engine, manifest):
            _check_tp_shard(engine, prefix, e, s)
        elif s["shape"] != e["shape"]:  # the whole tensor's
            raise CheckpointError(f"{prefix} {what(e)} '{e['name']}' has shape {tuple(s['shape'])} in the "
                                  f"checkpoint and {tuple(e['shape'])} in the model")
        if s["alias_of"] != e["alias_of"]:
            raise CheckpointError(f"{prefix} '{e['name']}' is tied to {s['alias_of']!r} in the checkpoint "
                                  f"and to {e['alias_of']!r} in the model")
        if (s["kind"] == "trained") != (e["kind"] == "trained"):
            state = {True: "trained", False: "not trained"}
            raise CheckpointError(f"{prefix} parameter '{e['name']}' is {state[s['kind'] == 'trained']} in the "
                                  f"checkpoint and {state[e['kind'] == 'trained']} now (requires_grad differs)")
    for s in manifest["model"]:
        if s["name"] not in names:
            raise CheckpointError(f"{prefix} it has {what(s)} '{s['name']}' {tuple(s['shape'])}, which the "
                                  "model does not have")
    if manifest.get("optimizer", type(engine.optimizer).__name__) != type(engine.optimizer).__name__:
        raise CheckpointError(f"checkpoint '{path}' holds {manifest['optimizer']} state, the optimizer is "
                              f"{type(engine.optimizer).__name__}")
    if len(manifest["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"checkpoint '{path}' has {len(manifest['param_groups'])} optimizer param groups, "
                              f"the optimizer has {len(engine.optimizer.param_groups)}")
    views = [v.value for v in inside(engine).spec.views]
    saved_views = manifest.get("optimizer_views") or ["flat shards"] * len(manifest["param_groups"])
    if saved_views != views:
        raise CheckpointError(f"checkpoint '{path}' holds optimizer state of {saved_views} (per param "
                              f"group), the optimizer steps {views}: its state cannot be read in another form")


def _stage(engine, path: str, manifest: dict) -> Staged:
    """Read this rank's share of the checkpoint into fresh CPU tensors; the engine is untouched."""
    metadata = read_metadata(path)
    md = metadata.state_dict_metadata
    shards, rank = inside(engine).master_shards(), inside(engine).comm.everyone.rank
    masters = [torch.zeros(m.numel(), dtype=torch.float32) for m in shards]
    keys = {k.split("/")[1] for k in md if k.startswith("optim/")}
    states = {}
    for key in sorted(keys):
        dtype = next(m.properties.dtype for k, m in md.items() if k.startswith(f"optim/{key}/"))
        states[key] = [torch.zeros(m.numel(), dtype=dtype) for m in shards]
    small = [k for k in md if k.startswith(("optim_scalar/", f"rng/{rank}/"))]
    mine = {name for name, _ in whole_parameters(engine)}  # stepped whole here: their state is read whole
    small += [k for k in md if k.startswith(("optim_param/", "optim_param_number/")) and k.split("/", 2)[2] in mine]
    whole = {**untrained(engine), **sharded_frozen(engine)}  # stage 3's cut out of a whole saved value
    frozen = {f"model/{stored(name, tp_shard(engine, t))}": name for name, t in whole.items()}
    shards = [torch.zeros(b.shard_numel, dtype=b.owned.dtype) for b in inside(engine).layout.frozen_buckets]
    if _resharding(engine, manifest):
        copies, model_state = {}, _reshard(engine, path, manifest, metadata, masters, states)
    else:
        copies, model_state = _copies(engine, path, manifest, metadata, masters, states), None
        small += [key for key in frozen if key in md]
        held = untrained(engine)
        pieces, assembled = _frozen_copies(engine, path, metadata, shards,
                                           [k for k, n in frozen.items() if k not in md and n in held])
        for key, dests in pieces.items():
            copies.setdefault(key, []).extend(dests)
    rest: dict[str, torch.Tensor] = {}

    def consume(chunk: dict[str, torch.Tensor]) -> None:
        for key, t in chunk.items():
            for src_off, dest, dest_off, n in copies.get(key, ()):
                dest[dest_off:dest_off + n].copy_(t[src_off:src_off + n])
            if key not in copies:
                rest[key] = t

    read_tensors(path, metadata, list(copies) + small, manifest, consume)
    scalars = {k[len("optim_scalar/"):]: t for k, t in rest.items() if k.startswith("optim_scalar/")}
    if model_state is None:
        model_state = {frozen[k]: t for k, t in rest.items() if k.startswith("model/")}
        model_state.update({frozen[k]: t.view(local(whole[frozen[k]]).shape) for k, t in assembled.items()})
    rng = {k.rsplit("/", 1)[1]: t for k, t in rest.items() if k.startswith("rng/")}
    whole_states: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in rest.items():
        if k.startswith(("optim_param/", "optim_param_number/")):
            kind, key, name = k.split("/", 2)
            number = t.item() if kind == "optim_param_number" else None
            whole_states.setdefault(name, {})[key] = t if number is None else int(number) if number.is_integer() else number
    return Staged(masters, states, scalars, model_state, rng, whole_states, shards)


def _frozen_copies(engine, path: str, metadata, shards: list[torch.Tensor], unsaved_whole: list[str]
                   ) -> tuple[dict[str, list], dict[str, torch.Tensor]]:
    """Frozen parameters saved as pieces (`frozen/`, by a stage-3 run): the copies of those that overlap
    this rank's stage-3 frozen shards into `shards`, and, for each `model/{name}` key in `unsaved_whole`
    (a frozen parameter this engine holds whole, saved in pieces), its pieces into a whole tensor."""
    saved = saved_pieces(metadata, "frozen/")
    copies: dict[str, list] = {}
    for pc in owned_frozen_pieces(engine):
        if pc.stored not in saved:
            continue  # saved whole (model/{name}): cut out of it by apply
        covered = 0
        for start, numel, key in saved[pc.stored]:
            lo, hi = max(start, pc.start), min(start + numel, pc.start + pc.numel)
            if lo < hi:
                copies.setdefault(key, []).append((lo - start, shards[pc.master], pc.offset + lo - pc.start, hi - lo))
                covered += hi - lo
        if covered != pc.numel:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: frozen parameter '{pc.name}' elements "
                                  f"[{pc.start}, {pc.start + pc.numel}) are not all saved")
    assembled: dict[str, torch.Tensor] = {}
    for key in unsaved_whole:
        found = saved.get(key[len("model/"):])
        if not found:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: '{key[len('model/'):]}' is not saved")
        assembled[key] = torch.zeros(sum(n for _, n, _ in found))
        for start, numel, piece in found:
            copies.setdefault(piece, []).append((0, assembled[key], start, numel))
    return copies, assembled


def _copies(engine, path: str, manifest: dict, metadata, masters: list, states: dict) -> dict[str, list]:
    """The saved pieces that overlap what this rank owns: {key: [(source offset, destination, its offset,
    numel)]} (a tp shard's from this rank's tp coordinate)."""
    copies: dict[str, list] = {}
    saved = {"master": saved_pieces(metadata, "master/")}
    saved.update({key: saved_pieces(metadata, f"optim/{key}/") for key in states})
    for pc in owned_pieces(engine):
        stepped_whole = inside(engine).layout.buckets[pc.master].whole  # its state is read whole (_stage)
        for kind, dests in [("master", masters), *(() if stepped_whole else states.items())]:
            covered = 0
            for start, numel, key in saved[kind].get(pc.stored, []):
                lo, hi = max(start, pc.start), min(start + numel, pc.start + pc.numel)
                if lo < hi:  # the saved piece overlaps what this rank now owns
                    dest = (dests[pc.master], pc.offset + lo - pc.start)
                    copies.setdefault(key, []).append((lo - start, *dest, hi - lo))
                    covered += hi - lo
            # A parameter never stepped (no gradient yet, unused.py) has no optimizer state: zeros,
            # which Adam's first step treats as its fresh state.
            never = (manifest.get("step_counts") or {}).get(pc.name) == 0 and kind != "master"
            if covered != pc.numel and not never:
                raise CheckpointError(f"checkpoint '{path}' is corrupt: {kind} of '{pc.name}' elements "
                                      f"[{pc.start}, {pc.start + pc.numel}) are not all saved")
    return copies


def _reshard(engine, path: str, manifest: dict, metadata, masters: list, states: dict) -> dict[str, torch.Tensor]:
    """Another tp size: each tensor this rank keeps a part of is read whole (its saved tp shards joined,
    whole.py) and this rank's shard of it cut out, one tensor at a time. Returns the untrained tensors'."""
    saved = {e["name"]: e for e in manifest["model"]}
    params = dict(engine.module.named_parameters())
    # a stage-3 parameter's own shape is empty
    local_shapes = {id(s.param): s.shape for _, s in [*inside(engine).layout.slots(), *inside(engine).layout.frozen_slots()]}
    mine: dict[str, list] = {}
    for pc in owned_pieces(engine):
        mine.setdefault(pc.name, []).append(pc)
    never = {n for n, count in (manifest.get("step_counts") or {}).items() if count == 0}
    verified: set[str] = set()  # each file's checksum once, not once per pass

    def cut(t: torch.Tensor, shape: torch.Size, w: torch.Tensor) -> torch.Tensor:
        return its_shard(t, tp_shard(engine, t), tp_size(engine), shape, w)

    whole = {n for n, _ in whole_parameters(engine)}  # their state is read whole (_stage)
    for kind, dests in [("master", masters), *states.items()]:
        prefix = "master/" if kind == "master" else f"optim/{kind}/"
        entries = [saved[n] for n in mine if kind == "master" or (n not in never and n not in whole)]  # never stepped: zeros
        reading = plan(path, manifest, metadata, entries, prefix)
        for name, w in reading.stream(path, manifest, metadata, LOAD_CHUNK_NUMEL, verified):
            p = params[name]
            flat = cut(p, local_shapes[id(p)], w).reshape(-1)
            for pc in mine[name]:
                dests[pc.master][pc.offset:pc.offset + pc.numel].copy_(flat[pc.start:pc.start + pc.numel])
    frozen = {**untrained(engine), **sharded_frozen(engine)}  # apply cuts stage 3's shards out of these
    reading = plan(path, manifest, metadata, [saved[n] for n in frozen])
    return {n: cut(frozen[n], local_shapes.get(id(frozen[n]), local(frozen[n]).shape), w).clone()
            for n, w in reading.stream(path, manifest, metadata, LOAD_CHUNK_NUMEL, verified)}


def _resharding(engine, manifest: dict) -> bool:
    """Whether the checkpoint was saved with another tp size than the engine's."""
    return manifest.get("tp", 1) != tp_size(engine)


def _check_axis_known(engine, path: str, manifest: dict, e: dict, s: dict) -> None:
    """Resuming on another tp size joins the saved tp shards and cuts this rank's: along a known axis."""
    for side, entry, tp in (("saved", s, manifest.get("tp", 1)), ("in the model", e, tp_size(engine))):
        if entry.get("tp") and entry["tp"]["dim"] is None:
            raise CheckpointError(f"checkpoint '{path}' was saved with tp {manifest.get('tp', 1)} and this job runs with "
                                  f"tp {tp_size(engine)}, but '{e['name']}' ({side}, tp {tp}) is a tensor-parallel "
                                  "shard whose axis is unknown (marked tensor_model_parallel / model_parallel "
                                  "without Megatron's partition_dim): set partition_dim on the model's tp shards, "
                                  f"or resume with tp {manifest.get('tp', 1)}")


def _check_tp_shard(engine, prefix: str, e: dict, s: dict) -> None:
    """At the saved tp size, a tensor-parallel shard (in the model or the checkpoint) is one on both sides,
    along the same axis where both say it, and this tp rank's shard has the same shape."""
    where = {True: "a tensor-parallel shard", False: "whole on every tp rank"}
    if ("tp" in e) != ("tp" in s):
        raise CheckpointError(f"{prefix} '{e['name']}' is {where['tp' in s]} in the checkpoint and "
                              f"{where['tp' in e]} in the model")
    r, mine = tp_rank(engine), tp_shapes([e])[e["name"]]
    dims = (s["tp"]["dim"], e["tp"]["dim"])
    if (None not in dims and dims[0] != dims[1]) or s["tp"]["shapes"][r] != mine:
        raise CheckpointError(f"{prefix} tp rank {r}'s shard of '{e['name']}' has shape "
                              f"{tuple(s['tp']['shapes'][r])} (tp axis {s['tp']['dim']}) in the checkpoint and "
                              f"{tuple(mine)} (tp axis {e['tp']['dim']}) in the model")
