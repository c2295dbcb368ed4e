"""The layout-free view of an engine: which pieces of which parameter this rank's shards hold.

Why pieces rather than buckets: the bucket layout (and its padding) depends on the world size and
the bucket size. A piece is named by the parameter and the element it starts at, so a checkpoint
written on one layout is read on any other: on load each rank works out which elements of which
parameter its shards now own and reads exactly the saved pieces that overlap them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodp.distributed.device import is_accelerator, rng_state


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + numel) of parameter `name`, held at `offset` in master `master`."""

    name: str
    start: int
    master: int
    offset: int
    numel: int


def owned_pieces(engine) -> list[Piece]:
    """The parameter pieces this rank's master shards hold (every piece of the model in stage 0)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    layout, pieces = engine.layout, []
    for i, b in enumerate(layout.buckets):
        lo_r = layout.shard_start(b)
        for _, s, lo, hi in layout.owned_slots(b):
            pieces.append(Piece(names[id(s.param)], lo - s.offset, i, lo - lo_r, hi - lo))
    return pieces


def bucket_params(engine, b) -> list[Piece]:
    """Every whole parameter of bucket `b`, as the saved layout lists it."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
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
    """Every state_dict entry: trained parameter, frozen parameter or buffer, with tied aliases."""
    layout = engine.layout
    trained = {id(s.param): b.group for b, s in layout.slots()}
    # A stage-3 parameter between uses is an empty tensor: its shape is its slot's.
    shapes = {id(s.param): layout.shape_of(s) for _, s in layout.slots()}
    params = {id(p) for p in engine.module.parameters()}
    first: dict[int, str] = {}
    out = []
    for name, t in engine.module.state_dict(keep_vars=True).items():
        kind = "trained" if id(t) in trained else "frozen" if id(t) in params else "buffer"
        out.append({"name": name, "kind": kind, "shape": list(shapes.get(id(t), t.shape)), "dtype": str(t.dtype),
                    "alias_of": first.get(id(t)), "group": trained.get(id(t))})
        first.setdefault(id(t), name)
    return out


def untrained(engine) -> dict[str, torch.Tensor]:
    """Frozen parameters and persistent buffers, by their first name."""
    return {e["name"]: t for e, t in zip(signature(engine), engine.module.state_dict(keep_vars=True).values())
            if e["kind"] != "trained" and e["alias_of"] is None}


def group_states(engine) -> dict[int, dict]:
    """The optimizer state of the first master of each param group (its per-group scalars)."""
    out: dict[int, dict] = {}
    for b, m in zip(engine.layout.buckets, engine.master_shards()):
        if b.group not in out and m in engine.optimizer.state:
            out[b.group] = engine.optimizer.state[m]
    return out


def local_state(engine) -> dict[str, torch.Tensor]:
    """The DCP tensors this rank writes (CPU copies): its master/optimizer pieces and, on rank 0,
    the replicated tensors. Also what tests compare: the union over ranks is layout-free."""
    comm, masters = engine.comm, engine.master_shards()
    writes_replicated = comm.rank == 0
    out: dict[str, torch.Tensor] = {}
    # Hierarchical sharding: the first copy of each shard writes it (the others hold the same values).
    if (engine.stage > 0 and comm.replica_rank == 0) or writes_replicated:
        for pc in owned_pieces(engine):
            m = masters[pc.master]
            out[f"master/{pc.name}@{pc.start}"] = _cpu(m.detach()[pc.offset:pc.offset + pc.numel])
            for key, v in engine.optimizer.state.get(m, {}).items():
                if torch.is_tensor(v) and v.shape == m.shape:
                    out[f"optim/{key}/{pc.name}@{pc.start}"] = _cpu(v.detach()[pc.offset:pc.offset + pc.numel])
    if writes_replicated:
        for g, state in group_states(engine).items():
            for key, v in state.items():
                if torch.is_tensor(v) and v.dim() == 0:
                    out[f"optim_scalar/{g}/{key}"] = _cpu(v.detach())
        for name, t in untrained(engine).items():
            out[f"model/{name}"] = _cpu(t.detach())
    out[f"rng/{comm.rank}/torch"] = torch.get_rng_state()
    if is_accelerator(engine.device):  # saved under the device type's name: "cuda" on CUDA and ROCm
        out[f"rng/{comm.rank}/{engine.device.type}"] = rng_state(engine.device)
    return out


def first_non_finite(engine) -> str | None:
    """This rank's first non-finite fp32 master value, as "'NAME' element I (nan)", or None.

    One pass over the master shard: a sum per master (a nan/inf anywhere makes it non-finite, and
    all sums come to the host in one sync); only a master whose sum is non-finite is searched.
    """
    masters = engine.master_shards()
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
