"""Writing a staged checkpoint into an engine, the second phase of every load (load.py for zerodp's
own checkpoints, deepspeed.py for DeepSpeed's): masters, untrained tensors, optimizer state, scheduler,
counters, loss scaler and RNG. It runs only after every rank agreed that staging succeeded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from zerodp.checkpoint.pieces import owned_frozen_pieces, untrained, whole_parameters
from zerodp.distributed.device import seed_everything, set_rng_state
from zerodp.engine.engine import inside
from zerodp.engine.layout.flat import local


@dataclass(frozen=True)
class Parts:
    """What a load restores besides the weights (which it always does)."""

    optimizer: bool = True
    lr_scheduler: bool = True
    training_state: bool = True  # counters, loss scale, RNG


@dataclass
class Staged:
    masters: list[torch.Tensor]                  # fp32, this rank's shard of each bucket
    states: dict[str, list[torch.Tensor]]        # optimizer key -> per-bucket shard
    scalars: dict[str, torch.Tensor]             # "{group}/{key}" -> 0-dim tensor
    untrained: dict[str, torch.Tensor]         # whole values by name (frozen parameters, buffers)
    rng: dict[str, torch.Tensor]
    # a parameter stepped whole: its stored name -> its optimizer state, each tensor as saved (pieces.whole_parameters)
    whole_states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # stage 3: this rank's shard of each frozen bucket, read from saved pieces (None: none saved so; the
    # frozen parameters saved whole are in `untrained`, and this rank's pieces are cut out of them)
    frozen: list[torch.Tensor] | None = None


def apply(engine, manifest: dict, staged: Staged, parts: Parts = Parts()) -> None:
    """Write what was staged into the engine; parts says what besides the weights."""
    with torch.no_grad():
        for m, new in zip(inside(engine).master_shards(), staged.masters):
            m.copy_(new.view(m.shape))
        for name, t in untrained(engine).items():
            if name in staged.untrained:
                local(t).data.copy_(staged.untrained[name])  # a tp shard's: this rank's own
        _apply_frozen(engine, staged)
    if parts.optimizer:
        _apply_optimizer(engine, manifest, staged)
    inside(engine).training.weights_from_masters()
    inside(engine).training.drop_gradients()
    if engine.lr_scheduler is not None and manifest.get("lr_scheduler") is not None and parts.lr_scheduler:
        engine.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
    if not parts.training_state:
        return
    if inside(engine).spec.dtype == torch.float16 and manifest["dtype"] == str(torch.float16):
        inside(engine).training.scaler.load_state_dict(manifest["loss_scaler"])  # a bf16/fp32 run has no scale to resume
    inside(engine).training.resume_counters(manifest["counters"]["global_steps"], manifest["counters"]["skipped_steps"])
    _restore_rng(engine, manifest, staged.rng)


def _apply_frozen(engine, staged: Staged) -> None:
    """Stage 3's frozen shards: as staged from saved pieces, or cut out of whole saved values."""
    buckets = inside(engine).layout.frozen_buckets
    for b, new in zip(buckets, staged.frozen or ()):
        b.owned.copy_(new)
    for pc in owned_frozen_pieces(engine):
        whole = staged.untrained.get(pc.name)
        if whole is not None:
            dest = buckets[pc.master].owned[pc.offset:pc.offset + pc.numel]
            dest.copy_(whole.reshape(-1)[pc.start:pc.start + pc.numel])


def _apply_optimizer(engine, manifest: dict, staged: Staged) -> None:
    # The optimizer's own load_state_dict puts each state tensor on its parameter's device and
    # dtype (and `step` where the optimizer wants it), so it continues exactly.
    opt, masters = engine.optimizer, inside(engine).master_shards()
    with inside(engine).training.torch_format.sharded_format():  # this rank's shards, as torch keeps them
        _apply_shards(engine, manifest, staged, opt, masters)
    inside(engine).training.restore_step_counts(masters, manifest.get("step_counts"))


def _apply_shards(engine, manifest: dict, staged: Staged, opt, masters: list[torch.Tensor]) -> None:
    sd = opt.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {}
    for name, t in whole_parameters(engine):
        if staged.whole_states.get(name):
            state[index[id(t)]] = dict(staged.whole_states[name])
    for i, (b, m) in enumerate(zip(inside(engine).layout.buckets, masters)):
        if b.whole:
            continue
        entry = {k: v[i].view(m.shape) for k, v in staged.states.items()}
        entry.update({k.split("/", 1)[1]: t.clone() for k, t in staged.scalars.items()
                      if k.split("/", 1)[0] == str(b.group)})
        entry.update(manifest.get("optim_scalars", {}).get(str(b.group), {}))
        if entry:
            state[index[id(m)]] = entry
    sd["state"] = state
    for group, saved in zip(sd["param_groups"], manifest["param_groups"]):
        for k, v in saved.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
    opt.load_state_dict(sd)


def _restore_rng(engine, manifest: dict, rng: dict[str, torch.Tensor]) -> None:
    rank = inside(engine).comm.everyone.rank  # with tp, each rank of the world saved its own
    host = manifest.get("rng", {}).get(str(rank))
    if host is None or "torch" not in rng:
        # More ranks than were saved: a deterministic, distinct stream per rank.
        seed_everything((manifest["config"].get("seed") or 0) + rank)
        return
    torch.set_rng_state(rng["torch"])
    if inside(engine).spec.device.type in rng:
        set_rng_state(rng[inside(engine).spec.device.type], inside(engine).spec.device)
    version, internal, gauss = host["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in host:
        try:
            import numpy as np
            kind, keys, pos, has_gauss, cached = host["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
