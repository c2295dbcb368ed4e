"""Activation checkpointing: keep only each block's input between forward and backward, recompute
the rest in backward; optionally keep those inputs in host memory or in one pre-allocated buffer.

Built on `torch.utils.checkpoint` (non-reentrant). Non-reentrant checkpointing saves the tensor
arguments of the checkpointed function through the autograd saved-tensor mechanism, *outside* its
own recompute hooks; a `saved_tensors_hooks` context around the call therefore sees exactly the
checkpointed inputs and nothing else. The hooks here decide where those inputs live:

  plain                           the input tensor itself stays on the device (torch's behaviour);
  cpu_checkpointing               copied into (pinned, on CUDA) host memory on a side stream during
                                  forward, the device copy released; in backward, when block i's
                                  recompute asks for its input, the input of block i-1 (the one
                                  packed before it) starts coming back on a second side stream, so
                                  accelerator memory for activations stays at about one block's worth;
  contiguous_memory_optimization  written into one buffer of `number_checkpoints` equal slots,
                                  allocated on first use (on the host with cpu_checkpointing,
                                  otherwise on the device): no allocation per checkpoint, no
                                  fragmentation from many same-sized, differently-lived tensors.

Use with the engine (the config's `activation_checkpointing` block picks the mode; the engine does
not know which modules are blocks, so the call names them):

    engine = zerodp.initialize(model, optimizer, config)
    ckpt = zerodp.activations.checkpoint_blocks(engine.module, (Block,), engine.config.activation_checkpointing)
    ...                                # train as usual; engine.memory_report() now shows activations
    ckpt.remove()                      # the blocks' forward methods are back to what they were

or, for one call, `zerodp.activations.checkpoint(fn, *args)` (plain) / `Checkpointer(...)(fn, *args)`.
Only positional tensor arguments are offloaded or made contiguous; tensors passed as keyword
arguments are kept by reference, as torch.utils.checkpoint does. `synchronize_checkpoint_boundary`
synchronises the device after each checkpointed forward (a debugging aid); `profile` is accepted
and has no effect. `partition_activations` is refused by the config (see config/keys.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from zerodp.config import ActivationCheckpointingConfig
from zerodp.distributed.device import (
    current_stream,
    event,
    is_accelerator,
    new_stream,
    synchronize,
    use_stream,
    wait_stream,
)

# Slots start on 512-byte boundaries: any dtype view is aligned, and so are the copies into them.
SLOT_ALIGN = 512


def checkpoint(fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) with its activations recomputed in backward (non-reentrant)."""
    return _torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


class _Kept:
    """What autograd holds for one checkpointed input between forward and backward."""

    __slots__ = ("owner", "tensor", "device", "nbytes", "slot", "offloaded", "copied", "fetched",
                 "prev", "__weakref__")

    def __init__(self, owner: "Checkpointer", tensor: torch.Tensor, device: torch.device, nbytes: int,
                 slot: int | None, offloaded: bool):
        self.owner, self.tensor, self.device, self.nbytes = owner, tensor, device, nbytes
        self.slot, self.offloaded = slot, offloaded
        self.copied = None    # CUDA event: the device -> host copy has finished
        self.fetched = None   # (device tensor, CUDA event) of a host -> device copy under way
        self.prev = None      # weakref to the input kept just before this one (the earlier block)

    def __del__(self) -> None:
        self.owner._release(self)


@dataclass
class Checkpointer:
    """Checkpoints functions, holding their inputs as configured; owns the offload buffers."""

    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    buffer: torch.Tensor | None = field(default=None, init=False, repr=False)  # contiguous slots (uint8)
    slot_bytes: int = field(default=0, init=False)
    live_bytes: int = field(default=0, init=False)  # held for checkpoints now (separate allocations)
    peak_bytes: int = field(default=0, init=False)  # high-water mark of the above, or the buffer's size
    _free: list[int] = field(default_factory=list, init=False, repr=False)
    _last: Any = field(default=None, init=False, repr=False)      # weakref to the last _Kept packed
    _streams: Any = field(default=None, init=False, repr=False)   # CUDA (device->host, host->device)
    _blocks: list = field(default_factory=list, init=False, repr=False)
    _model: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.contiguous_memory_optimization and not self.number_checkpoints:
            raise ValueError("contiguous_memory_optimization needs number_checkpoints: the number of "
                             "checkpointed inputs alive at once (one per checkpointed block)")

    @classmethod
    def from_config(cls, config: ActivationCheckpointingConfig | dict | None) -> "Checkpointer":
        if config is None:
            return cls()
        if isinstance(config, dict):
            config = ActivationCheckpointingConfig(**config)
        return cls(cpu_checkpointing=config.cpu_checkpointing,
                   contiguous_memory_optimization=config.contiguous_memory_optimization,
                   number_checkpoints=config.number_checkpoints,
                   synchronize_checkpoint_boundary=config.synchronize_checkpoint_boundary)

    # ---- checkpointing --------------------------------------------------------------------------
    def __call__(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), checkpointed; its positional tensor inputs held as configured."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = _torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)
        if self.synchronize_checkpoint_boundary:
            synchronize()
        return out

    def _pack(self, x: torch.Tensor) -> _Kept:
        nbytes = x.numel() * x.element_size()
        if not (self.cpu_checkpointing or self.contiguous_memory_optimization):
            kept = _Kept(self, x, x.device, nbytes, None, False)
        else:
            slot = None
            if self.contiguous_memory_optimization:
                slot = self._take_slot(x, nbytes)
                dst = self.buffer[slot * self.slot_bytes:slot * self.slot_bytes + nbytes]
                dst = dst.view(x.dtype).view(x.shape)
            else:
                dst = torch.empty(x.shape, dtype=x.dtype, device=self._home(x),
                                  pin_memory=self.cpu_checkpointing and is_accelerator(x.device))
            kept = _Kept(self, dst, x.device, nbytes, slot, self.cpu_checkpointing)
            self._copy_out(kept, x)
        if kept.slot is None:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        kept.prev = self._last
        self._last = weakref.ref(kept)
        return kept

    def _unpack(self, kept: _Kept) -> torch.Tensor:
        if not kept.offloaded:
            return kept.tensor  # on the device already: the original, or its slot in the buffer
        t = self._take_fetched(kept)
        prev = kept.prev() if kept.prev is not None else None
        if prev is not None and prev.offloaded and prev.fetched is None and is_accelerator(kept.device):
            self._fetch(prev)  # block i's recompute starts: bring block i-1's input back meanwhile
        return t

    # ---- copies (asynchronous on an accelerator) -------------------------------------------------
    def _home(self, x: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.cpu_checkpointing else x.device

    def _side_streams(self, device: torch.device):
        if self._streams is None:
            self._streams = (new_stream(device), new_stream(device))  # device -> host, host -> device
        return self._streams

    def _copy_out(self, kept: _Kept, x: torch.Tensor) -> None:
        if not (is_accelerator(x.device) and kept.offloaded):
            kept.tensor.copy_(x)
            return
        d2h = self._side_streams(x.device)[0]
        wait_stream(d2h, x.device)
        with use_stream(d2h):
            kept.tensor.copy_(x, non_blocking=True)
            kept.copied = event(x.device)
            kept.copied.record(d2h)
        x.record_stream(d2h)  # the allocator must not reuse x's memory before the copy has read it

    def _fetch(self, kept: _Kept) -> None:
        """Start copying an offloaded input back to its device."""
        if not is_accelerator(kept.device):
            kept.fetched = (kept.tensor.to(kept.device, copy=True), None)
            return
        h2d = self._side_streams(kept.device)[1]
        h2d.wait_event(kept.copied)
        with use_stream(h2d):
            t = torch.empty(kept.tensor.shape, dtype=kept.tensor.dtype, device=kept.device)
            t.copy_(kept.tensor, non_blocking=True)
            done = event(kept.device)
            done.record(h2d)
        kept.fetched = (t, done)

    def _take_fetched(self, kept: _Kept) -> torch.Tensor:
        if kept.fetched is None:
            self._fetch(kept)
        t, done = kept.fetched
        kept.fetched = None  # a second backward over the same graph fetches again
        if done is not None:
            current = current_stream(kept.device)
            current.wait_event(done)
            t.record_stream(current)
        return t

    # ---- the contiguous buffer ------------------------------------------------------------------
    def _take_slot(self, x: torch.Tensor, nbytes: int) -> int:
        home = self._home(x)
        in_use = self.buffer is not None and len(self._free) < self.number_checkpoints
        if self.buffer is None or nbytes > self.slot_bytes or self.buffer.device != home:
            if in_use:
                raise RuntimeError(
                    f"a checkpointed input of {nbytes} bytes on {home} does not fit the contiguous "
                    f"buffer's {self.slot_bytes}-byte slots on {self.buffer.device} while other "
                    "checkpoints still hold slots; run backward before changing the batch shape")
            self.slot_bytes = -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
            self.buffer = None
            self.buffer = torch.empty(self.number_checkpoints * self.slot_bytes, dtype=torch.uint8,
                                      device=home, pin_memory=self.cpu_checkpointing and is_accelerator(x.device))
            self._free = list(range(self.number_checkpoints))
            self.peak_bytes = max(self.peak_bytes, self.buffer.numel())
        if not self._free:
            raise RuntimeError(
                f"more than activation_checkpointing.number_checkpoints={self.number_checkpoints} "
                "checkpointed inputs are alive at once; set number_checkpoints to the number of "
                "checkpointed blocks (times the forwards run before one backward)")
        self._free.sort()
        return self._free.pop(0)

    def _release(self, kept: _Kept) -> None:
        if kept.slot is not None:
            self._free.append(kept.slot)
        else:
            self.live_bytes -= kept.nbytes

    def bytes(self) -> dict[str, int]:
        """High-water mark of bytes held for checkpointed inputs, on the host or on the device."""
        where = "host" if self.cpu_checkpointing else "device"
        return {f"checkpointed_activations_{where}": self.peak_bytes}

    # ---- wrapping a model's blocks --------------------------------------------------------------
    def wrap(self, model: nn.Module, block_types: tuple[type[nn.Module], ...]) -> "Checkpointer":
        """Checkpoint every submodule of `model` that is an instance of `block_types`."""
        if _ATTACHED.get(model) is not None:
            raise ValueError("this model's blocks are already checkpointed; call .remove() on the "
                             "Checkpointer returned by checkpoint_blocks first")
        blocks = [m for m in model.modules() if isinstance(m, block_types)]
        if not blocks:
            names = ", ".join(t.__name__ for t in block_types)
            raise ValueError(f"the model has no submodule of type {names}; nothing to checkpoint")
        for m in blocks:
            previous = m.__dict__.get("forward")  # an instance-level forward someone set before us
            m.forward = self._checkpointed(m.forward)
            self._blocks.append((m, previous))
        self._model = weakref.ref(model)
        _ATTACHED[model] = self
        return self

    def _checkpointed(self, forward: Callable) -> Callable:
        def checkpointed_forward(*args, **kwargs):
            return self(forward, *args, **kwargs)
        checkpointed_forward.__wrapped__ = forward
        return checkpointed_forward

    def remove(self) -> None:
        """Undo `wrap`: every block's forward is what it was before."""
        for m, previous in self._blocks:
            if previous is None:
                del m.forward
            else:
                m.forward = previous
        self._blocks.clear()
        model = self._model() if self._model is not None else None
        if model is not None:
            _ATTACHED.pop(model, None)


# The checkpointer of each wrapped model, for engine.memory_report(); weak, so nothing is kept alive.
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, Checkpointer]" = weakref.WeakKeyDictionary()


def checkpoint_blocks(model: nn.Module, block_types: Iterable[type[nn.Module]] | type[nn.Module],
                      config: ActivationCheckpointingConfig | dict | None = None) -> Checkpointer:
    """Checkpoint every `block_types` submodule of `model` without editing its code.

    Each block's `forward` is replaced on the instance by a checkpointed call of the original;
    `.remove()` on the returned Checkpointer puts them back. `config` is the config's
    `activation_checkpointing` block (or a dict of it): cpu_checkpointing, contiguous buffers.
    """
    types = (block_types,) if isinstance(block_types, type) else tuple(block_types)
    return Checkpointer.from_config(config).wrap(model, types)


def attached(model: nn.Module) -> Checkpointer | None:
    """The Checkpointer that checkpoint_blocks attached to `model`, if any."""
    return _ATTACHED.get(model)
