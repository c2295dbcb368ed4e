"""Peak memory of a training step, measured on fake tensors: rank 0 of N ranks, any model size.

Under `FakeTensorMode` every tensor has its shape, dtype and device but no storage, and the fake
process group (backend "fake") returns from every collective at once. One CPU process therefore runs
a real forward, backward and optimizer step of a 6.7B GPT as rank 0 of 64 ranks, allocating nothing.
PyTorch's `MemTracker` (`FSDPMemTracker` for FSDP2) follows each tensor storage from its creation to
its release; the peak is the largest sum of live storages, split by category at that moment. It is
the logical-tensor part of CUDA's max_memory_allocated: the caching allocator's 512-byte rounding,
cuBLAS / NCCL workspaces and fragmentation are not in it.

The device is the CPU: a CPU-only torch cannot fake CUDA here (`Tensor.copy_` and `.to()` open a
CUDA device guard before the fake kernel runs and fail with "not linked with support for cuda").
The same ops run on either device except the attention kernel (CPU flash attention in place of
CUDA's), whose saved tensors are the same size.

Two steps run (the optimizer creates its state in the first); the peak is over both. Categories:
  params          working parameters (zerodp's flat buffers; FSDP2's fp32 shards, also its master)
  gathered        stage 3's gathered buckets, FSDP2's unsharded parameters and all-gather outputs
  grads           the reduced gradient this rank keeps (FSDP2: sharded and unsharded gradients)
  master          zerodp's fp32 master shard
  optimizer       optimizer states (AdamW's m and v)
  buckets         zerodp's reduce bucket pool, FSDP2's reduce-scatter inputs
  activations     saved for backward, and recomputed by activation checkpointing
  temps           backward's temporaries: activation gradients, each parameter's gradient until
                  the engine's hook has copied it into its bucket
  step_temps      made by engine.step() outside optimizer.step(): the fp32 gradient copy, norms
  other           inputs and targets

Measuring code works around two PyTorch limits from outside (`_propagation_in_its_own_fake_mode`,
`_swaps_despite_weak_references`). A model built on meta under the fake mode is filed by MemTracker
under the device "meta", which holds no memory, and is left out. The engine takes each stage-3
parameter's view of its gathered buffer while the buffer is whole (flat.Bucket.views): a view taken
from a freed storage regrows it on fake tensors, which would count.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _RefType

COLUMNS = ("params", "gathered", "grads", "master", "optimizer", "buckets", "activations", "temps",
           "step_temps", "other")
_TOTAL = "Total"


class Ref(_RefType):
    """MemTracker's categories (same member names) plus the engine's own."""

    PARAM = "params"
    BUFFER = "buffers"
    GRAD = "grads"
    ACT = "activations"
    TEMP = "temps"
    OPT = "optimizer"
    OTH = "other"
    MASTER = "master"
    BUCKET = "buckets"
    GATHERED = "gathered"
    STEP = "step_temps"


_ENGINE_OWNED = (Ref.MASTER, Ref.BUCKET, Ref.GATHERED)

# FSDPMemTracker's category names -> COLUMNS
_FSDP_COLUMN = {"Sharded Param": "params", "Buffer": "params", "Unsharded Param": "gathered",
                "All Gather": "gathered", "Sharded Grad": "grads", "Unsharded Grad": "grads",
                "Reduce Scatter": "buckets", "OptState": "optimizer", "Activation": "activations",
                "Temp": "temps", "Inputs": "other"}


class _Where:
    """Keeps the device peak only (MemTracker also keeps one per module, a loop over every module
    on every op), and where the step was (`phase`, innermost module) when it rose."""

    phase = "set-up"
    peak_at = ""
    after_step: dict[str, int] = {}

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if dev.type != "meta" and self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                self._peak_mem[dev] = snap[_TOTAL]
                self._peak_mem_snap[dev] = dict(snap)
                inner = max(self._mod_tracker.parents, key=len, default="")
                self.peak_at = f"{self.phase} {inner}" if inner not in ("", "Global") else self.phase


class ZeroTracker(_Where, MemTracker):
    """MemTracker with the engine's categories; `label` names a tensor the engine owns."""

    def __init__(self) -> None:
        super().__init__()
        self._ref_class = Ref
        self._labelling = False

    def _track(self, reftype: _RefType, t: torch.Tensor) -> None:
        ref = Ref[reftype.name]
        if ref is Ref.ACT and self.phase == "step":
            ref = Ref.STEP
        super()._track(ref, t)

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        # MemTracker files a module's parameters under PARAM on each first forward; a stage 3
        # parameter is a view of a gathered bucket and keeps the engine's label.
        known = [self._WINFO.get(st, (None, None))[0] for st in get_untyped_storages(t)]
        if not self._labelling and known and all(w is not None and w.reftype in _ENGINE_OWNED for w in known):
            return set(known)
        return super()._update_and_maybe_create_winfos(t, Ref[reftype.name], update_existing)

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        # A parameter's .grad lives only until the engine's hook copies it into a bucket: it is a
        # temporary of backward, not the gradient the rank keeps (that one is labelled `grads`).
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    def label(self, t: torch.Tensor, ref: Ref) -> None:
        """File t's storage under `ref`, also in the peak snapshot if t was made at the peak."""
        self._labelling = True
        try:
            self._update_and_maybe_create_winfos(t, ref)
        finally:
            self._labelling = False
        for dev, snap in self._curr_mem_snap.items():
            if snap[_TOTAL] == self._peak_mem.get(dev):
                self._peak_mem_snap[dev] = dict(snap)


class _FSDPTracker(_Where, FSDPMemTracker):
    pass


# ---- one measured configuration (in a child process) --------------------------------------------
def _gpt(spec: dict[str, Any], device: torch.device):
    from zerodp.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTConfig(**spec["model"]))


def _source_model(spec: dict[str, Any], device: torch.device):
    """spec["source"] (a zerodp.plan.models.PlanModel's fields): the model and its batch, or None."""
    from zerodp.plan.models import PlanModel
    torch.manual_seed(0)
    with torch.device(device):
        model, inputs = PlanModel(**spec["source"]).build()
        return model, None if inputs is None else inputs(spec["micro_batch"], spec["seq"], device)


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss  # a Hugging Face output carries .loss


def _batch(spec: dict[str, Any], vocab: int, device: torch.device):
    shape = (spec["micro_batch"], spec["seq"])
    return (torch.randint(0, vocab, shape, device=device), torch.randint(0, vocab, shape, device=device))


def _adamw(params) -> torch.optim.Optimizer:
    # as `zerodp bench` builds it on CUDA: fused, so the step makes no full-size temporaries
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)


@contextmanager
def _propagation_in_its_own_fake_mode():
    """DTensor's sharding propagation runs each op on global-shape fake tensors, in the active fake
    mode when there is one; MemTracker counts ops of the fake mode it was entered in, so under
    FakeTensorMode every optimizer step on FSDP2's DTensors would add the full unsharded parameter,
    gradient and state sizes to the peak (about 100 GiB for 6.7B). A fake mode of its own keeps
    those metadata-only ops out of the count, as MemTracker intends."""
    import torch.distributed.tensor._sharding_prop as prop
    saved = prop.detect_fake_mode
    prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        prop.detect_fake_mode = saved


def _snapshot(tracker, kind: str) -> dict[str, int]:
    # A model built on meta under the fake mode is filed under device "meta", which holds no memory.
    snap = next((s for dev, s in tracker.get_tracker_snapshot(kind).items() if dev.type != "meta"), {})
    out = dict.fromkeys(COLUMNS, 0)
    for ref, nbytes in snap.items():
        if ref == _TOTAL:
            continue
        name = ref.value if isinstance(ref, Ref) else _FSDP_COLUMN[ref.value]
        out["params" if name == "buffers" else name] += nbytes
    return out


def _run_zerodp(spec: dict[str, Any], device: torch.device) -> ZeroTracker:
    engine, batch = _zerodp_engine(spec, device)
    tracker = _label_engine(ZeroTracker(), engine, batch)
    with tracker:
        for _ in range(2 if batch is not None else 0):  # no inputs: the engine's own memory only
            tracker.phase = "forward"
            loss = _loss(engine(*batch))
            tracker.phase = "backward"
            engine.backward(loss)
            tracker.phase = "step"
            engine.step()
            tracker.reset_mod_stats()  # MemTracker counts one forward per root module
        tracker.after_step = _snapshot(tracker, "current")  # while the engine is alive
    return tracker


def _zerodp_engine(spec: dict[str, Any], device: torch.device):
    """The engine the spec describes, with `zerodp bench`'s optimizer, and its batch."""
    import zerodp
    from zerodp.activations import checkpoint_blocks
    from zerodp.models.gpt import Block

    if "source" in spec:
        model, batch = _source_model(spec, device)
    else:
        model = _gpt(spec, device)
        batch = _batch(spec, model.config.vocab_size, device)
    engine = zerodp.initialize(model, _adamw(model.parameters()), _config(spec))
    if spec["checkpointing"]:
        checkpoint_blocks(engine.module, (Block,))
    return engine, batch


def _label_engine(tracker: ZeroTracker, engine, batch) -> ZeroTracker:
    """Each tensor the engine holds, under its column; the reducer's buffers as it makes them."""
    from zerodp.engine.engine import inside
    parts = inside(engine)
    tracker.track_external(engine.module)
    for g in [*parts.layout.groups, *parts.layout.frozen]:  # stage 3's frozen shards too
        if g.data is not None:
            tracker.label(g.data, Ref.PARAM)
        for b in g.buckets if parts.spec.gathers_per_unit else ():
            tracker.label(b.data, Ref.GATHERED)
    if parts.training.masters_are_copies:  # in fp32 the master is the working buffer's shard itself
        for m in parts.master_shards():
            tracker.label(m, Ref.MASTER)
    for t in batch or ():
        if isinstance(t, torch.Tensor):
            tracker.label(t, Ref.OTH)
    # gradient and reduce buffers are made on first use in each window
    parts.training.on_new_gradient_buffer(
        lambda t, kind: tracker.label(t, Ref.GRAD if kind == "grad" else Ref.BUCKET))
    return tracker


def _config(spec: dict[str, Any]) -> dict[str, Any]:
    zero = {"stage": spec["stage"], **spec.get("zero_optimization", {})}
    if spec.get("reduce_bucket_size"):
        zero["reduce_bucket_size"] = spec["reduce_bucket_size"]
    config = {"train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_clipping": 1.0,
              "zero_optimization": zero}
    if spec["dtype"] != "fp32":
        config[spec["dtype"]] = {"enabled": True}
    return config


def _run_setup(spec: dict[str, Any], device: torch.device) -> ZeroTracker | None:
    """The set-up as a user runs it, every tensor counted from the first: the model built (on the
    device, spec["setup"] "whole"; on meta, "meta") and zerodp.initialize called. On the meta path
    the initialisers' CPU stand-ins (one unit at a time, fp32) are host memory on a GPU job and are
    counted here with the device's, so the figure is an upper bound on the device's peak. None when a
    model on meta has a module nothing can initialise (zerodp.initialize's error; a user passes
    param_init_fn), or when this torch's swap_tensors cannot run on fake tensors: the caller then
    gives the formula, and says so."""
    import zerodp
    from zerodp.plan.models import PlanModel

    tracker = ZeroTracker()
    with tracker, _swaps_despite_weak_references():
        torch.manual_seed(0)
        with torch.device("meta" if spec["setup"] == "meta" else device):
            model = PlanModel(**spec["source"]).build()[0]
        try:  # as the train job: Hugging Face layers are initialised by the model's own _init_weights
            engine = zerodp.initialize(model, _adamw(model.parameters()), _config(spec))
        except (ValueError, RuntimeError):  # a module with no initialiser (the meta path needs the user's
            if spec["setup"] != "meta":   # param_init_fn), or a torch whose swap_tensors the fake mode refuses
                raise
            return None
        tracker.after_step = _snapshot(tracker, "current")  # while the engine is alive
        del engine
    return tracker


@contextmanager
def _swaps_despite_weak_references():
    """Lets torch.utils.swap_tensors run on fake tensors. The engine gives each parameter of a model
    on meta its storage in place (swap_tensors keeps the Parameter object, which the optimizer holds),
    and swap_tensors refuses a tensor with a weak reference; under FakeTensorMode every fake tensor has
    one, from the fake mode's own converter memo. The check guards users' weak references to the
    swapped objects; the memo only maps real tensors to their fakes, and the run ends with the mode."""
    import weakref

    import torch.utils

    class _NoWeakReferences:
        def __getattr__(self, name: str):
            return getattr(weakref, name)

        @staticmethod
        def getweakrefs(_: object) -> list:
            return []

    saved = getattr(torch.utils, "weakref", None)
    if saved is None:  # another torch's swap_tensors: nothing to lift (a refusal gives the formula)
        yield
        return
    torch.utils.weakref = _NoWeakReferences()
    try:
        yield
    finally:
        torch.utils.weakref = saved


def _run_fsdp2(spec: dict[str, Any], device: torch.device, mesh) -> _FSDPTracker:
    """`zerodp bench`'s fsdp2 mode: fully_shard per block and on the root, bf16 parameters and
    fp32 gradient reduction, blocks checkpointed, clip 1.0, fused AdamW; `reshard_after_forward`
    False is its fsdp2-noreshard mode (ZeRO-2-like: parameters stay gathered from forward to backward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zerodp.activations import checkpoint_blocks
    from zerodp.models.gpt import Block

    model = _gpt(spec, device)
    if spec["checkpointing"]:
        checkpoint_blocks(model, (Block,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if spec["dtype"] != "fp32" else MixedPrecisionPolicy())
    reshard = spec.get("reshard_after_forward", True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    opt = _adamw(model.parameters())
    x, y = _batch(spec, model.config.vocab_size, device)
    tracker = _FSDPTracker(model, opt)
    tracker.track_inputs((x, y))
    with _propagation_in_its_own_fake_mode(), tracker:
        _torch_steps(tracker, model, opt, x, y, nullcontext())
    return tracker


def _torch_steps(tracker, model, opt, x, y, autocast) -> None:
    """Two steps of a model PyTorch itself trains (FSDP2, plain): clip 1.0, set_to_none."""
    for _ in range(2):
        tracker.phase = "forward"
        with autocast:
            loss = model(x, y)
        tracker.phase = "backward"
        loss.backward()
        tracker.phase = "step"
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker.reset_mod_stats()
    tracker.after_step = _snapshot(tracker, "current")


def _run_plain(spec: dict[str, Any], device: torch.device) -> ZeroTracker:
    """`zerodp bench`'s plain mode: fp32 parameters, bf16 autocast, fused AdamW, clip 1.0,
    zero_grad(set_to_none=True); one process, no data parallelism."""
    from zerodp.activations import checkpoint_blocks
    from zerodp.models.gpt import Block

    model = _gpt(spec, device)
    if spec["checkpointing"]:
        checkpoint_blocks(model, (Block,))
    opt = _adamw(model.parameters())
    x, y = _batch(spec, model.config.vocab_size, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["dtype"] != "fp32")
    tracker = ZeroTracker()
    tracker.track_external(model, opt)
    for t in (x, y):
        tracker.label(t, Ref.OTH)
    with tracker:
        _torch_steps(tracker, model, opt, x, y, autocast)
    return tracker


def _measure_here(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerodp.distributed.comm import init_fake
    from zerodp.models.gpt import GPT, GPTConfig

    init_fake(spec["world"])
    device = torch.device("cpu")
    mesh = None
    if spec["mode"] == "fsdp2":  # outside the fake mode: the mesh reads its rank table with .tolist()
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (spec["world"],))
    start = time.perf_counter()
    try:
        # The meta path broadcasts rank 0's real CPU random state (the fake collective ignores it).
        fake_mode = FakeTensorMode(allow_non_fake_inputs=spec.get("setup") == "meta")
        with fake_mode if spec.get("fake", True) else nullcontext():
            run = {"fsdp2": lambda: _run_fsdp2(spec, device, mesh), "plain": lambda: _run_plain(spec, device),
                   "zerodp": lambda: _run_zerodp(spec, device), "setup": lambda: _run_setup(spec, device)}
            tracker = run[spec["mode"]]()
    finally:
        dist.destroy_process_group()
    if "source" in spec:
        from zerodp.plan.models import PlanModel
        psi = PlanModel(**spec["source"]).num_params()
    else:
        with torch.device("meta"):
            psi = GPT(GPTConfig(**spec["model"])).num_params()
    if tracker is None:
        return {"spec": spec, "num_params": psi, "peak": None, "seconds": time.perf_counter() - start}
    at_peak = _snapshot(tracker, "peak")
    return {"spec": spec, "num_params": psi, "peak": sum(at_peak.values()), "at_peak": at_peak,
            "peak_at": tracker.peak_at, "after_step": tracker.after_step,
            "seconds": time.perf_counter() - start}


def measure_peaks(specs: list[dict[str, Any]], timeout: float | None = None) -> list[dict[str, Any]]:
    """Each spec's peak in one fresh Python process (a process group is created per spec).

    spec: mode ("zerodp" | "fsdp2" | "plain": one process, PyTorch AMP | "setup": zerodp's set-up, with
    setup "whole" or "meta", the model built on the device or on meta), stage (zerodp, setup), world, model (GPTConfig fields)
    or source (zerodp: a PlanModel's fields, any model), micro_batch,
    seq, dtype ("bf16" | "fp32"; fp16's overflow check reads a value), checkpointing,
    reduce_bucket_size (zerodp; None: the engine's default), zero_optimization (zerodp: more config
    keys), reshard_after_forward (FSDP2, default True), fake (default True; False runs real CPU
    tensors, for small models).
    """
    from zerodp.plan.measure import run_child
    return run_child(["zerodp.plan.peak", json.dumps(specs)], "the fake-tensor measuring subprocess", timeout)


if __name__ == "__main__":
    print(json.dumps([_measure_here(s) for s in json.loads(sys.argv[1])]))
