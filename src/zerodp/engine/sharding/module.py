"""A module sharded over the data-parallel ranks, training nothing: FSDP2's `fully_shard` in ZeRO's terms.

It owns what every sharded model has, trained or not: the layout (which parameter sits in which flat bucket,
and which shard is this rank's), the materialisation of those buckets from the model, its initialisers or
files, stage 3's per-unit gather and release (with the parameter shards in host memory under offload_param
"cpu", in a file of this rank's under "nvme": on_disk.py),
`gathered_parameters` (and writing weights back through it), the weights as a stream for export, and the
floating buffers kept equal across ranks. A frozen reference or teacher model is this part alone: no optimizer,
no reducer, no loss scaler and no gradient hook exist for it (`zerodp.shard`, or `zerodp.initialize` with
nothing to train). The Engine (engine.py) adds training to one: its stepping part subscribes to the writes
(`adopted`) to keep its fp32 masters equal to the weights written.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable

import torch
from torch import nn

from zerodp.config import Config
from zerodp.distributed.comm import Comm
from zerodp.distributed.device import can_pin, seed_everything
from zerodp.engine.layout import formats
from zerodp.engine.layout.flat import Bucket, local, set_local
from zerodp.engine.layout.layout import Layout, frozen_params
from zerodp.engine.layout.units import nothing_partitioned, unit_buckets
from zerodp.engine.layout.spec import EngineSpec
from zerodp.engine.setup import fill
from zerodp.engine.setup.fill import Filling
from zerodp.engine.sharding.buffers import BufferSync
from zerodp.engine.sharding.gather import BucketState, Gatherer
from zerodp.engine.sharding.gathered_state import GatheredStateDict, LoneCall
from zerodp.engine.sharding.memory import memory_report
from zerodp.engine.sharding.on_disk import ParamDiskSettings, ShardsOnDisk
from zerodp.engine.sharding.weights import Weights, engine_weights

# (buckets whole on every rank, the ids of the parameters written, or None for all): what a listener
# reads of a gathered_parameters(modifier_rank=...) write, before the buckets are released
Adopted = Callable[[list[Bucket], "set[int] | None"], None]


class ShardedModule:
    """A model sharded for ZeRO that trains nothing: use `zerodp.shard` (or `zerodp.initialize` without an
    optimizer, for a model none of whose parameters requires grad)."""

    def __init__(self, module: nn.Module, config: Config, comm: Comm, spec: EngineSpec, filling: Filling,
                 groups: list[list[nn.Parameter]], checkpoint_io=None):
        """filling: where the parameters' values come from (decide.local_check); groups: the trained parameters
        of each optimizer param group (none for a frozen model): they become views into the flat buckets, as
        stage 3's frozen ones do; everything else is kept whole."""
        self.config = config  # the validated configuration, the same on every rank
        self.comm = comm  # the process group every collective of the model goes through
        self.module = module  # the user's model: its sharded parameters become views into flat buckets
        self.spec = spec  # the facts decided once (decide.local_check)
        self.checkpoint_io = checkpoint_io  # zerodp.checkpoint, above the engine; None: no save/load
        formats.keep_packing(module)  # a 4-bit weight's words stay where the layout puts them
        formats.int8_follows_weight(module)  # an 8-bit layer computes from its weight wherever it is
        # stage 3 shards the frozen parameters too, and bitsandbytes' per-block quantisation state beside them;
        # id(quantized weight) -> that state: gathered with the weight (gathered_parameters)
        self.block_state = formats.block_state_of(module) if spec.shards_frozen else {}
        frozen = formats.with_block_state(module, frozen_params(module, groups)) if spec.shards_frozen else None
        self._cast_and_sync_untrained(groups, frozen or [], filling)
        # rank 0's floating buffers before each forward (broadcast_buffers); None: nothing to keep equal
        self.buffer_sync = (BufferSync(module, comm) if BufferSync.wanted(module, comm, config.broadcast_buffers)
                            else None)
        # stage 3's offload_param "nvme": the parameter shards' file and host buffers; None otherwise
        self.on_disk: ShardsOnDisk | None = None
        layout, fp32_shards = self._flat_buffers(groups, frozen, filling)
        self.layout: Layout = layout  # the buckets the sharded parameters are views into, this rank's shard
        # this rank's fp32 values of each trained bucket, which the masters start from (taken once by training)
        self._fp32_shards: list[torch.Tensor] | None = fp32_shards
        self.gatherer = self._gatherer(layout)  # stage 3's gather and release of each unit; None below stage 3
        # stage 3: module.state_dict() gathers the parameters it would otherwise hold empty; None below it
        self.gathered_state = (GatheredStateDict(module, self.gatherer, comm, config.comm_timeout_s)
                               if self.gatherer is not None else None)
        self.adopted: list[Adopted] = []  # told of each gathered_parameters(modifier_rank=...) write

    # ---- set-up -----------------------------------------------------------------------------------
    def _cast_and_sync_untrained(self, groups: list[list[nn.Parameter]], sharded: list[nn.Parameter],
                                 filling: Filling) -> None:
        """Frozen parameters kept whole (stages 0-2) and floating buffers: in EngineSpec.kept_dtype (their own,
        but fp32 under a 16-bit working precision), rank 0's values (frozen parameters read from weights are
        every rank's already: fill.start read them). The `sharded` frozen parameters (stage 3) are the flat
        buffers', filled like the trained ones."""
        trained = {id(p) for g in groups + [sharded] for p in g}
        read = {id(p) for p in self.module.parameters()} if filling.from_files else set()
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if id(t) in trained:
                continue
            if t.is_floating_point() and t.dtype != self.spec.kept_dtype(t):
                set_local(t, local(t).data.to(self.spec.kept_dtype(t)))
            if id(t) not in read:
                self.comm.broadcast(local(t).data)

    def _flat_buffers(self, groups: list[list[nn.Parameter]], frozen: list[torch.Tensor] | None, filling: Filling
                      ) -> tuple[Layout, list[torch.Tensor]]:
        """The parameters become views into flat buckets holding rank 0's weights; returns the layout
        and this rank's fp32 values of each trained bucket, which the masters start from."""
        zero, comm, spec = self.config.zero_optimization, self.comm, self.spec
        own_dtype = frozenset(id(t) for state in self.block_state.values() for t in state)  # never cast
        layout = Layout.build(groups, spec, comm, zero, frozen, own_dtype)
        note = nothing_partitioned(layout.gathered, zero) if spec.gathers_per_unit and comm.shard_size > 1 else None
        if note is not None and comm.everyone.rank == 0:
            print(note, file=sys.stderr, flush=True)
        if spec.params_on_disk:
            self.on_disk = self._shards_on_disk(layout)
        fp32_shards = fill.fill(layout.groups, filling, comm, layout.rank, spec.dtype, spec.device,
                                spec.gathers_per_unit, spec.offload_param,
                                zero.offload_param.pin_memory and can_pin(), frozen=layout.frozen,
                                store=self.on_disk.put if self.on_disk is not None else None)
        if self.config.seed is not None:  # after the initialisers, which draw rank 0's values
            seed_everything(self.config.seed + comm.rank)
        return layout, fp32_shards

    def _shards_on_disk(self, layout: Layout) -> ShardsOnDisk:
        """The parameter shards' file under offload_param.nvme_path, its space checked and reserved: a missing,
        unwritable or full directory (or buffers too small) on any rank is raised on every rank."""
        off = self.config.zero_optimization.offload_param
        settings = ParamDiskSettings.from_config(self.config, off.pin_memory and can_pin())
        names = self._unit_names()
        units: dict[int, str] = {}
        for u, bs in enumerate(unit_buckets(self.spec.units, layout.gathered)):
            for b in bs:
                units[b.index] = f"{units[b.index]}, " if b.index in units else "unit "
                units[b.index] += repr(names[u] or "(the model)")
        dtypes = [(b, self.spec.dtype) for g in layout.groups for b in g.buckets]
        dtypes += [(b, g.dtype) for g in layout.frozen for b in g.buckets]
        error = tier = None
        try:
            tier = ShardsOnDisk(sorted(dtypes, key=lambda e: e[0].index), layout.rank, settings, units)
        except (OSError, ValueError) as e:
            error = e
        self.comm.agree(error, "zerodp.initialize (offload_param \"nvme\")")
        return tier

    def _unit_names(self) -> list[str]:
        """Each stage-3 unit's root module's name ("" for the model itself)."""
        names = {id(m): n for n, m in self.module.named_modules()}
        return [names.get(id(root), "") for root in self.spec.units.roots]

    def _gatherer(self, layout: Layout) -> Gatherer | None:
        if not self.spec.gathers_per_unit:
            return None
        gatherer = Gatherer(self.spec.units, layout, self.comm,
                            self.config.zero_optimization.stage3_prefetch_bucket_size, self.spec.offload_param,
                            unit_names=self._unit_names(), on_disk=self.on_disk)
        if self.comm.notice is not None:  # a long wait in a gather names its phase, unit and step
            self.comm.notice.describe = lambda: gatherer.whereabouts.where()[0]
        return gatherer

    def take_fp32_shards(self) -> list[torch.Tensor]:
        """(training, once) this rank's fp32 values of each trained bucket, which its masters start from."""
        shards, self._fp32_shards = self._fp32_shards, None
        if shards is None:
            raise RuntimeError("the fp32 shards were taken already: one training part per sharded module")
        return shards

    # ---- forward ----------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        with self.comm.names_peer_failure("in the forward pass (stage 3 waits for parameter gathers)"):
            return self.module_forward(*args, **kwargs)

    def module_forward(self, *args, **kwargs):
        """The forward without naming a peer failure: the Engine names it with its step."""
        if self.spec.dtype != torch.float32:
            args, kwargs = cast_floating(args, self.spec.dtype), cast_floating(kwargs, self.spec.dtype)
        if self.buffer_sync is not None and (self.gatherer is None or self.gatherer.uneven is None):
            self.buffer_sync.before_forward()  # (not in an uneven_forwards block: a collective no agreement covers)
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> ShardedModule:
        self.module.train(mode)
        return self

    def eval(self) -> ShardedModule:
        return self.train(False)

    # ---- whole parameters ---------------------------------------------------------------------------
    @contextmanager
    def gathered_parameters(self, params: Iterable[nn.Parameter] | None = None, modifier_rank: int | None = None):
        """Within the block the given parameters (default: all) are whole on every rank (stage 3 gathers
        and releases them; other stages always hold them whole). Changes made inside are not kept,
        unless modifier_rank is given: that rank's values then become every rank's weights (and, where
        something trains them, fp32 masters). Forwards inside gather nothing, so ranks may run different
        numbers of them (generate() of any length: the whole model in working precision on every rank,
        gathered once, bounded by comm_timeout_s); uneven_forwards() does it without the whole model."""
        # a quantized weight's words are read with their per-block state (formats.block_state)
        wanted = None if params is None else {id(t) for p in params for t in (p, *self.block_state.get(id(p), ()))}
        buckets = [b for b in self.layout.gathered
                   if wanted is None or any(id(s.param) in wanted for s in b.slots)]
        if self.gatherer is not None and not all(map(self.gatherer.is_gathered, buckets)):
            self.gathered_state.entering("a gathered_parameters block")  # a lone state_dict() elsewhere learns of it
        with self.gatherer.gathered_parameters(buckets) if self.gatherer is not None else nullcontext():
            yield
            if modifier_rank is not None:
                self._adopt(buckets, modifier_rank, wanted)

    def _adopt(self, buckets: list[Bucket], src_rank: int, params: set[int] | None) -> None:
        """src_rank's values of `params` (ids; default all) in `buckets` (whole on every rank) become every
        rank's working values, and this rank's shard of them where stage 3 keeps it apart (collective)."""
        for b in buckets:
            self.comm.broadcast(b.data, src_rank)
            lo, hi = self.layout.shard_start(b), self.layout.shard_start(b) + b.shard_numel
            if b.owned.numel() and b.owned.data_ptr() == b.data[lo:hi].data_ptr():  # a view of the bucket already
                continue
            with self.on_disk.updating(b, read=True) if self.on_disk is not None else nullcontext():
                for _, s, start, end in self.layout.owned_slots(b):
                    if params is None or id(s.param) in params:
                        b.owned[start - lo:end - lo].copy_(b.data[start:end])
        if self.on_disk is not None:
            self.on_disk.flush()
        for listener in self.adopted:
            listener(buckets, params)

    @contextmanager
    def uneven_forwards(self):
        """Forwards inside the block (under torch.no_grad()) may differ in number between ranks: generate()
        stopping at different lengths, an eval loop over data that does not divide the ranks. At stage 3,
        each unit's gather is agreed first, and a rank that leaves the block early keeps joining the
        others' gathers until every rank has left it (stage3.UnevenForwards); one small all_reduce per
        unit, no prefetch. Call it on every rank. Stages 0-2 gather nothing in a forward: only no_grad.
        Where the whole model fits on each rank, `gathered_parameters()` costs no collective per forward."""
        with torch.no_grad(), self.gatherer.uneven_forwards() if self.gatherer is not None else nullcontext():
            yield

    # ---- weights out --------------------------------------------------------------------------------
    def weights(self, full_master: Callable[[Bucket], torch.Tensor] | None = None) -> Weights:
        """The weights as a stream of whole tensors, one bucket at a time (collective: iterate it to the end
        on every rank). full_master: a trained bucket's fp32 values (the training part's masters); frozen
        buckets come from their working shards."""
        if self.gathered_state is not None:
            self.gathered_state.entering("writing the weights")
        return engine_weights(self.module, self.comm, self.layout, self._full_values(full_master))

    def _full_values(self, full_master: Callable[[Bucket], torch.Tensor] | None) -> Callable[[Bucket], torch.Tensor]:
        def values(b: Bucket) -> torch.Tensor:
            if not b.frozen:
                if full_master is None:
                    raise RuntimeError(f"bucket {b.index} holds trained parameters, but nothing trains them")
                return full_master(b)
            return self.full_frozen(b)
        return values

    def full_frozen(self, b: Bucket) -> torch.Tensor:
        """Stage 3's frozen bucket b, whole, in its own dtype (its bits), from every rank's shard (collective)."""
        full = torch.empty(b.numel, dtype=b.owned.dtype, device=self.spec.device)
        with self.on_disk.reading(b) if self.on_disk is not None else nullcontext(b.owned) as shard:
            self.comm.shard_gather(full, shard.to(self.spec.device))
        return full

    def shards_in_memory(self):
        """A context in which every parameter shard is a tensor in host memory (b.owned): with offload_param
        "nvme" they are read in for its body and written back after it (a checkpoint's save or load)."""
        return self.on_disk.resident(self.layout.gathered) if self.on_disk is not None else nullcontext()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights keyed like module.state_dict(), trained ones in fp32 (their masters), frozen ones in
        their own dtype (engine_weights), each tensor whole (joined over the tp group
        under tensor parallelism; collective). It gathers the whole model on every rank: files are written
        without that (zerodp.checkpoint.export_engine, from `weights()`, one bucket at a time)."""
        return collect(self.weights())

    # ---- reports and hooks --------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by category, counted from the tensors the model owns."""
        return memory_report(self)

    def release_gathered(self) -> None:
        """Stage 3: every gathered parameter no gathered_parameters block holds is released (persistent ones stay
        whole); the next forward gathers what it needs. Between steps; nothing to do below stage 3."""
        if self.gatherer is not None:
            self.gatherer.release_gathered()

    def remove_hooks(self) -> None:
        """Every hook this sharded module put on the model removed, stage 3's gathered parameters released
        (persistent ones stay whole): nothing of it stays reachable from the model (DeepSpeed's destroy)."""
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
            self.gatherer.watcher = None
        if self.gathered_state is not None:
            self.gathered_state.remove_hooks()

    def gathered_bytes(self) -> tuple[int, int]:
        """Stage 3: (bytes of the buckets gathered now, bytes kept for gathers that none uses now); (0, 0) below."""
        return self.gatherer.gathered_bytes() if self.gatherer is not None else (0, 0)

    def watch_gathers(self, watcher: Callable[[Bucket, BucketState], None]) -> None:
        """Stage 3: watcher(bucket, its state) now and at each gather and release of a bucket."""
        self.gatherer.watch(watcher)

    def advise_on_lone_state_dict(self, advice: str, answer: LoneCall = LoneCall.RAISE) -> None:
        """Stage 3: what a module.state_dict() called on some ranks only suggests instead (a compatibility
        layer names its own saving calls), and whether it raises or returns placeholders (LoneCall)."""
        if self.gathered_state is not None:
            self.gathered_state.advice, self.gathered_state.lone = advice, answer

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError(_NOTHING_TO_TRAIN.format(call="backward()"))

    def step(self) -> None:
        raise RuntimeError(_NOTHING_TO_TRAIN.format(call="step()"))


def cast_floating(obj, dtype: torch.dtype):
    """Cast the floating tensors in (nested tuples / lists / dicts of) inputs to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


_NOTHING_TO_TRAIN = (
    "{call} on a sharded module with nothing to train: it was built without an optimizer for a model whose "
    "parameters all have requires_grad=False (a reference or teacher model), so it runs forward only; run it "
    "under torch.no_grad(), or give zerodp.initialize an optimizer and set requires_grad=True on what to train")


def collect(weights: Weights) -> dict[str, torch.Tensor]:
    values = {name: t.clone() for name, t in weights.stream}
    return {name: values[weights.ties.get(name, name)] for name in weights.shapes}
