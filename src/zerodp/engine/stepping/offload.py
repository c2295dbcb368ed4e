"""ZeRO-Offload's host side: the memory the offloaded optimizer steps in, the copies to and from the
device, and the CPU kernel it steps with.

One block of host memory (pinned when it can be) holds, per bucket, the fp32 master, its fp32
gradient and, in mixed precision, a staging shard in the working dtype. Every copy between the
device and the host is then between tensors of one dtype; the casts run on the host, host tensor to
host tensor. A cross-device `copy_` that also changes dtype would convert through a full-size
temporary of its own: on the device for a non-blocking device-to-host copy (the gradient), in
pageable host memory for a host-to-device one (the weights), which makes that copy block.

torch's host allocator (CachingHostAllocator) rounds each pinned allocation up to a power of two:
one block is rounded once, and `pinned_bytes` says by how much.

`use_fused_kernel`: torch's Adam/AdamW default to their single-tensor loop on the CPU, about 9x slower
than their fused CPU kernel on a flat shard (benchmarks/RESULTS.md); where the user chose no
implementation, the host shards are stepped by the fused kernel.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from zerodp.distributed.device import synchronize_stream
from zerodp.sizes import pinned_bytes

_ALIGN_BYTES = 64  # every shard in the block starts on a cache line (and any dtype's alignment)


class HostShards:
    """Per bucket: `masters[k]` (fp32), `grads[k]` (fp32) and, when the working dtype is not fp32,
    `staging[k]` (working dtype), all views of one host block."""

    def __init__(self, shards: list[torch.Tensor], working: torch.dtype, pin: bool):
        self.working = working
        self.pinned = pin  # the block is pinned (non-blocking copies, allocator rounding)
        kinds = [torch.float32, torch.float32] + ([working] if working != torch.float32 else [])
        offsets, end = [], 0
        for s in shards:
            for dtype in kinds:
                offsets.append((end, s.numel(), dtype))
                end += -(-s.numel() * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES
        self.block = torch.empty(end, dtype=torch.uint8, device="cpu", pin_memory=pin)
        views = [self.block[o:o + n * d.itemsize].view(d) for o, n, d in offsets]
        self.masters, self.grads = views[0::len(kinds)], views[1::len(kinds)]
        self.staging = views[2::len(kinds)] if len(kinds) == 3 else []
        for m, s in zip(self.masters, shards):
            m.copy_(s)
        self._sent = False  # a host-to-device copy from staging may still be reading it

    def receive_gradients(self, grads: list[torch.Tensor]) -> None:
        """Copy the gradient shards into the host fp32 gradients (blocks until they are there)."""
        staged = [bool(self.staging) and g.dtype == self.working for g in grads]
        for k, g in enumerate(grads):
            # A dtype other than fp32 and the working one (grad_accum_dtype) converts on the device:
            # step_transient counts that temporary.
            (self.staging[k] if staged[k] else self.grads[k]).copy_(g, non_blocking=True)
        if grads:
            synchronize_stream(grads[0].device)  # the host step needs the gradients
        self._sent = False
        for k in (k for k, s in enumerate(staged) if s):
            self.grads[k].copy_(self.staging[k])

    def send_weights(self, k: int, owned: torch.Tensor) -> None:
        """Start the copy of master k into the bucket's working shard on the device (non-blocking)."""
        if not self.staging:
            owned.copy_(self.masters[k], non_blocking=True)
            return
        if self._sent:  # a gather outside a step (a checkpoint load): the last copies may still read staging
            synchronize_stream(owned.device)
            self._sent = False
        self.staging[k].copy_(self.masters[k])
        owned.copy_(self.staging[k], non_blocking=True)

    def send_done(self) -> None:
        """Every send_weights of one gather is issued: the next gather's host writes must wait for them."""
        self._sent = bool(self.staging)

    def bytes(self) -> dict[str, int]:
        """Host bytes: the fp32 gradient copy, the staging shards, and the pinned block's rounding."""
        return {"offload_gradients": sum(g.numel() * 4 for g in self.grads),
                "offload_staging": sum(s.numel() * s.element_size() for s in self.staging),
                "offload_pinned_rounding": pinned_bytes(self.block.numel(), self.pinned) - self.block.numel()}


def use_fused_kernel(optimizer: Optimizer) -> bool:
    """Step a torch Adam/AdamW on the host with its fused CPU kernel when no param group chose an
    implementation (foreach and fused both None, torch's defaults); True when it switched. The same
    algorithm: moments bit for bit equal to the single-tensor loop's here, parameters within 1e-6
    (tests/test_optimizer.py). A load_state_dict that brings back unchosen groups is switched again."""
    switched = _switch(optimizer)
    if switched:
        optimizer.register_load_state_dict_post_hook(_switch_after_load)
    return switched


def _switch(optimizer: Optimizer) -> bool:
    groups = optimizer.param_groups
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or any(
            g.get("foreach") is not None or g.get("fused") is not None or g.get("differentiable")
            or g.get("capturable") for g in groups):
        return False
    for g in groups:
        g["fused"] = True
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # as torch's __init__ sets for fused=True: grad_scale folds
    return True


def _switch_after_load(optimizer: Optimizer) -> None:
    _switch(optimizer)
    # A checkpoint whose groups chose an implementation keeps it: then grad_scale no longer folds.
    optimizer._step_supports_amp_scaling = all(g.get("fused") for g in optimizer.param_groups)
