"""The layout-free view of an engine: which pieces of which parameter this rank's shards hold.

Why pieces rather than buckets: the bucket layout (and its padding) depends on the world size and
the bucket size. A piece is named by the parameter and the element it starts at, so a checkpoint
written on one layout is read on any other: on load each rank works out which elements of which
parameter its shards now own and reads exactly the saved pieces that overlap them.

Tensor parallelism (engine/tensor_parallel/placements.py): a parameter that the tp ranks hold alike (flat.tp_duplicate)
is saved once, by tp rank 0, like any other. A tp shard (a Shard DTensor's local tensor, or a plain
parameter marked the Megatron way) is saved in the coordinates of the shard each tp rank holds, under
`{name}@tp{r}` (`stored`): its pieces `master/{name}@tp{r}@{start}` are elements of tp rank r's local
tensor. One rule for every placement: a column shard (Shard(1)) is no contiguous range of the whole
tensor, so global coordinates would cut each of its pieces into one piece per row. The manifest records
each shard's axis and every tp rank's shape (signature, "tp"): what consolidation, and a resume on another
tp size, join the shards along (whole.py).
A tp of one splits nothing and saves exactly as no tp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from zerodp.distributed.device import is_accelerator, rng_state
from zerodp.engine.engine import inside
from zerodp.engine.layout.flat import local, tp_duplicate, tp_parts
from zerodp.engine.layout.formats import named_block_state


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + numel) of parameter `name`, held at `offset` in master `master`."""

    name: str
    start: int
    master: int
    offset: int
    numel: int
    tp_rank: int | None = None  # a tp shard's: whose local tensor `start` counts in (None: the whole tensor)

    @property
    def stored(self) -> str:
        return stored(self.name, self.tp_rank)


def stored(name: str, tp_rank: int | None) -> str:
    """The name a tensor is saved under: tp rank r's shard of a tensor-parallel one as `{name}@tp{r}`."""
    return name if tp_rank is None else f"{name}@tp{tp_rank}"


def tp_size(engine) -> int:
    """The engine's tensor-parallel size (1 without tp)."""
    return 1 if inside(engine).comm.tp is None else inside(engine).comm.tp.world_size


def tp_rank(engine) -> int:
    return 0 if inside(engine).comm.tp is None else inside(engine).comm.tp.rank


def tp_shard(engine, t: torch.Tensor) -> int | None:
    """This rank's tp rank if `t` is a tensor-parallel shard (each tp rank holds its own part), else None."""
    return tp_rank(engine) if tp_size(engine) > 1 and not tp_duplicate(t) else None


def tp_dim(t: torch.Tensor) -> int | None:
    """The axis along which the tp shards of `t` join into the whole tensor: a Shard DTensor's dim, a
    Megatron parameter's `partition_dim` (when its shards are not interleaved: partition_stride 1); None
    when the model does not say (a parameter marked tensor/model_parallel and nothing more)."""
    if isinstance(t, DTensor):
        return next(pl.dim for pl in t.placements if not pl.is_replicate())  # Shard or _StridedShard
    dim, stride = getattr(t, "partition_dim", None), getattr(t, "partition_stride", 1)
    return dim if type(dim) is int and dim >= 0 and stride == 1 else None


def owned_pieces(engine) -> list[Piece]:
    """The parameter pieces this rank's master shards hold (every piece of the model in stage 0)."""
    return _pieces_of(engine, inside(engine).layout.buckets)


def owned_frozen_pieces(engine) -> list[Piece]:
    """The pieces of stage 3's frozen parameters this rank's working shards hold (Piece.master: the
    frozen bucket's place in layout.frozen_buckets); none below stage 3."""
    return _pieces_of(engine, inside(engine).layout.frozen_buckets)


def slot_names(engine) -> dict[int, str]:
    """id(tensor) -> its state_dict name, for every tensor the layout holds: the parameters (a tied one under its
    first name) and, at stage 3, bitsandbytes' per-block quantisation state (formats.block_state)."""
    names = {id(t): n for n, t in named_block_state(engine.module)}
    names.update({id(p): n for n, p in engine.module.named_parameters()})
    return names


def _pieces_of(engine, buckets: list) -> list[Piece]:
    """The pieces this rank's shards of `buckets` hold, each bucket by its place in the list."""
    names = slot_names(engine)
    layout, pieces = inside(engine).layout, []
    for i, b in enumerate(buckets):
        lo_r = layout.shard_start(b)
        for _, s, lo, hi in layout.owned_slots(b):
            pieces.append(Piece(names[id(s.param)], lo - s.offset, i, lo - lo_r, hi - lo, tp_shard(engine, s.param)))
    return pieces


def bucket_params(engine, b) -> list[Piece]:
    """Every whole parameter of bucket `b` (and quantisation state), as the saved layout lists it."""
    names = slot_names(engine)
    return [Piece(names[id(s.param)], s.offset, b.index, 0, s.numel) for s in b.slots]


def saved_pieces(metadata, prefix: str) -> dict[str, list[tuple[int, int, str]]]:
    """name -> [(start, numel, key)] for every saved key `{prefix}{name}@{start}`."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            name, _, start = key[len(prefix):].rpartition("@")
            out.setdefault(name, []).append((int(start), md.size.numel(), key))
    return out


def signature(engine) -> list[dict]:
    """Every state_dict entry: trained parameter, frozen parameter or buffer, with tied aliases.

    A tensor-parallel shard's entry has "tp": {"dim": its axis (tp_dim), "shapes": [this rank's shard's
    shape]}, and "shape" is the whole tensor's (a Megatron shard's: tp equal parts), or its shard's where
    the axis is unknown; save joins every tp rank's shapes into the manifest (join_tp_shapes)."""
    layout = inside(engine).layout
    trained = {id(s.param): b.group for b, s in layout.slots()}
    sharded = layout.by_frozen_param()  # stage 3's frozen parameters, saved as pieces
    # A stage-3 parameter between uses is an empty tensor: its shape is its slot's.
    shapes = {id(s.param): s.shape for _, s in [*layout.slots(), *layout.frozen_slots()]}
    params = {id(p) for p in engine.module.parameters()}
    first: dict[int, str] = {}
    out = []
    for name, t in engine.module.state_dict(keep_vars=True).items():
        # stage 3's sharded bitsandbytes quantisation state is frozen too: in its own dtype, in pieces
        kind = "trained" if id(t) in trained else "frozen" if id(t) in params or id(t) in sharded else "buffer"
        mine = list(shapes.get(id(t), local(t).shape))
        e = {"name": name, "kind": kind, "shape": list(t.shape if isinstance(t, DTensor) else mine),
             "dtype": str(t.dtype), "alias_of": first.get(id(t)), "group": trained.get(id(t))}
        if id(t) in sharded:
            e["sharded"] = True
        if tp_shard(engine, t) is not None:
            e["tp"] = {"dim": tp_dim(t), "shapes": [mine]}
            if tp_parts(t) > 1:  # each shard is its slice of each part (a fused q | k | v): joined part by part
                e["tp"]["parts"] = tp_parts(t)
            if not isinstance(t, DTensor) and e["tp"]["dim"] is not None:  # Megatron splits evenly
                e["shape"][e["tp"]["dim"]] *= tp_size(engine)
        out.append(e)
        first.setdefault(id(t), name)
    return out


def join_tp_shapes(model: list[dict], shards: list[tuple[int, dict[str, list[int]]]]) -> None:
    """Fill signature `model`'s tp shards with every tp rank's shape (`shards`: (tp rank, {name: its
    shape}) from each rank), and a shard whose axis is known with the whole tensor's shape."""
    for e in model:
        if "tp" not in e:
            continue
        by_rank = dict((r, s[e["name"]]) for r, s in shards)
        e["tp"]["shapes"] = [by_rank[r] for r in range(len(by_rank))]
        dim = e["tp"]["dim"]
        if dim is not None:
            e["shape"] = list(e["tp"]["shapes"][0])
            e["shape"][dim] = sum(s[dim] for s in e["tp"]["shapes"])


def tp_shapes(model: list[dict]) -> dict[str, list[int]]:
    """{name: this rank's shard's shape} of signature `model`'s tensor-parallel shards."""
    return {e["name"]: e["tp"]["shapes"][0] for e in model if "tp" in e}


def untrained(engine) -> dict[str, torch.Tensor]:
    """Frozen parameters held whole (below stage 3) and persistent buffers, by their first name."""
    return {e["name"]: t for e, t in zip(signature(engine), engine.module.state_dict(keep_vars=True).values())
            if e["kind"] != "trained" and not e.get("sharded") and e["alias_of"] is None}


def sharded_frozen(engine) -> dict[str, torch.Tensor]:
    """Stage 3's frozen parameters (saved as pieces), by their first name."""
    return {e["name"]: t for e, t in zip(signature(engine), engine.module.state_dict(keep_vars=True).values())
            if e.get("sharded") and e["alias_of"] is None}


def whole_parameters(engine) -> list[tuple[str, torch.Tensor]]:
    """(name, the tensor its optimizer steps) of each parameter this rank steps whole (a shape-aware
    optimizer's: optimizer_view.py); its state is saved whole, under `optim_param/{key}/{name}`, with
    whatever shape it has (Adafactor's row and column factors are not the parameter's). A tensor-parallel
    shard is stepped as its whole matrix (engine/tensor_parallel/whole.py), its state the whole matrix's and the
    same on every tp rank: saved once, by tp rank 0, under the parameter's own name, so that it resumes at
    any tp size."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for b, stepped in zip(inside(engine).layout.buckets, inside(engine).training.stepped_tensors()):
        if b.whole:
            for t, (_, s, _, _) in zip(stepped, inside(engine).layout.owned_slots(b)):
                out.append((names[id(s.param)], t))
    return out


def group_states(engine) -> dict[int, dict]:
    """The optimizer state of the first master of each param group (its per-group scalars)."""
    out: dict[int, dict] = {}
    for b, m in zip(inside(engine).layout.buckets, inside(engine).master_shards()):
        if b.group not in out and m in engine.optimizer.state:
            out[b.group] = engine.optimizer.state[m]
    return out


def local_state(engine) -> dict[str, torch.Tensor]:
    """The DCP tensors this rank writes (CPU copies): its master/optimizer pieces and, on rank 0,
    the replicated tensors. Also what tests compare: the union over ranks is layout-free.

    Each tensor is written once in the world: a piece by the first copy of its shard (rank 0 in stage 0,
    which shards nothing; replica 0 of hierarchical sharding); a tp shard by every tp rank (each its
    own), a tensor the tp ranks hold alike by tp rank 0 alone; replicated tensors by the world's rank 0."""
    comm, masters = inside(engine).comm, inside(engine).master_shards()
    holds_first_copy = comm.replica_rank == 0 if inside(engine).spec.shards_optimizer else comm.rank == 0
    out: dict[str, torch.Tensor] = {}
    if holds_first_copy:
        for pc in owned_pieces(engine):
            if pc.tp_rank is None and tp_rank(engine) != 0:
                continue
            m = masters[pc.master]
            out[f"master/{pc.stored}@{pc.start}"] = _cpu(m.detach()[pc.offset:pc.offset + pc.numel])
            for key, v in engine.optimizer.state.get(m, {}).items():
                if torch.is_tensor(v) and v.shape == m.shape:
                    out[f"optim/{key}/{pc.stored}@{pc.start}"] = _cpu(v.detach()[pc.offset:pc.offset + pc.numel])
        for name, t in whole_parameters(engine) if tp_rank(engine) == 0 else ():  # the same on every tp rank
            for key, v in engine.optimizer.state.get(t, {}).items():
                if torch.is_tensor(v):
                    out[f"optim_param/{key}/{name}"] = _cpu(v.detach())
                else:  # a plain number (transformers' Adafactor keeps its step and RMS so): read back as one
                    out[f"optim_param_number/{key}/{name}"] = torch.tensor(v, dtype=torch.float64)
        for pc in owned_frozen_pieces(engine):  # stage 3's frozen parameters: once, as the masters
            if pc.tp_rank is None and tp_rank(engine) != 0:
                continue
            owned = inside(engine).layout.frozen_buckets[pc.master].owned
            out[f"frozen/{pc.stored}@{pc.start}"] = _cpu(owned[pc.offset:pc.offset + pc.numel])
    rank = comm.everyone.rank
    if rank == 0:
        for g, state in group_states(engine).items():
            for key, v in state.items():
                if torch.is_tensor(v) and v.dim() == 0:
                    out[f"optim_scalar/{g}/{key}"] = _cpu(v.detach())
    for name, t in untrained(engine).items():
        r = tp_shard(engine, t)
        if (r is None and rank == 0) or (r is not None and comm.rank == 0):
            out[f"model/{stored(name, r)}"] = _cpu(local(t).detach())
    out[f"rng/{rank}/torch"] = torch.get_rng_state()
    if is_accelerator(inside(engine).spec.device):  # saved under the device type's name: "cuda" on CUDA and ROCm
        out[f"rng/{rank}/{inside(engine).spec.device.type}"] = rng_state(inside(engine).spec.device)
    return out


def first_non_finite(engine) -> str | None:
    """This rank's first non-finite fp32 master value, as "'NAME' element I (nan)", or None.

    One pass over the master shard: a sum per master (a nan/inf anywhere makes it non-finite, and
    all sums come to the host in one sync); only a master whose sum is non-finite is searched.
    """
    masters = inside(engine).master_shards()
    if not masters:
        return None
    sums = torch.stack([m.detach().sum() for m in masters])
    for i in torch.isfinite(sums).logical_not().nonzero().flatten().tolist():
        bad = torch.isfinite(masters[i]).logical_not().nonzero().flatten()
        if bad.numel() == 0:  # finite values whose sum overflowed
            continue
        k = int(bad[0])
        value = float(masters[i][k])
        for p in owned_pieces(engine):
            if p.master == i and p.offset <= k < p.offset + p.numel:
                return f"'{p.name}' element {p.start + k - p.offset} ({value})"
        return f"the padding of bucket {i} ({value})"
    return None


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True).contiguous()
