"""The one owner of the device: which accelerator this process runs on, its process-group backend,
streams and events, synchronize, pinned memory, memory statistics and random state.

Everything goes through `torch.accelerator` and `torch.get_device_module`, so CUDA, ROCm (which
PyTorch presents as cuda), XPU and any other accelerator PyTorch knows take the same code path; no
other module of zerodp names one. The CPU is the test bed: there, streams are None and their
context does nothing, copies are synchronous, events read the host clock, and memory statistics
are 0 (the CPU has no device allocator: callers report the process's resident set instead).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import random
import time
from contextlib import nullcontext
from typing import Any, ContextManager

import numpy as np
import torch
import torch.distributed as dist

CPU = torch.device("cpu")


# ---- which device -------------------------------------------------------------------------------
def accelerator_type() -> str | None:
    """The accelerator's device type ("cuda", "xpu", ...), or None on a host without one."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


def is_accelerator(device: torch.device) -> bool:
    """Whether tensors on `device` live in an accelerator's memory (not the host's, not meta)."""
    return device.type not in ("cpu", "meta")


def current() -> torch.device | None:
    """This process's current accelerator device, or None without one."""
    kind = accelerator_type()
    if kind is None:
        return None
    return torch.device(kind, torch.accelerator.current_device_index())


def local(local_rank: int) -> torch.device:
    """The device of local rank `local_rank`: its accelerator, or the CPU."""
    kind = accelerator_type()
    return torch.device(kind, local_rank) if kind is not None else CPU


def device_count() -> int:
    """Accelerators this process sees (0 on the CPU)."""
    return torch.accelerator.device_count() if accelerator_type() is not None else 0


def set_device(local_rank: int) -> None:
    """Make accelerator `local_rank` this process's current device (one per rank)."""
    torch.accelerator.set_device_index(local_rank)


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name, e.g. 'NVIDIA H100 80GB HBM3'."""
    return str(_module(device).get_device_name(device))


# ---- process group --------------------------------------------------------------------------------
def backend(device_type: str | None = None) -> str:
    """The collective backend PyTorch maps to a device type (nccl for cuda, xccl for xpu, gloo for
    the CPU); by default, for this host's accelerator."""
    kind = device_type or accelerator_type() or "cpu"
    return dist.Backend.default_device_backend_map.get(kind, "gloo")


def device_of_backend(name: str) -> torch.device | None:
    """The current accelerator device when `name` is that accelerator's own backend (the process
    group's tensors must live there), None for a host backend such as gloo."""
    kind = accelerator_type()
    if kind is None or name == "gloo" or name != backend(kind):
        return None
    return current()


# ---- streams, events, synchronize ---------------------------------------------------------------
def new_stream(device: torch.device) -> Any:
    """A side stream on an accelerator `device`; None on the CPU (copies there are synchronous)."""
    return _module(device).Stream(device=device) if is_accelerator(device) else None


def current_stream(device: torch.device) -> Any:
    """The stream work on `device` is queued on now; None on the CPU."""
    return _module(device).current_stream(device) if is_accelerator(device) else None


def use_stream(stream: Any) -> ContextManager:
    """Queue the enclosed work on `stream` (from new_stream); does nothing for None."""
    return nullcontext() if stream is None else _module(stream.device).stream(stream)


def wait_stream(waiter: Any, device: torch.device) -> None:
    """Make `waiter` wait for the work queued so far on `device`'s current stream."""
    if waiter is not None:
        waiter.wait_stream(current_stream(device))


class HostEvent:
    """An event on the CPU, where work is done when it is queued: it records the host clock."""

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self) -> None:
        """Nothing to wait for: the work before record() is done."""

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to `end`, as torch.Event.elapsed_time."""
        return (end.at - self.at) * 1e3


def event(device: torch.device, timing: bool = False) -> Any:
    """An event on `device`'s streams (timing=True: elapsed_time works); a HostEvent on the CPU."""
    if not is_accelerator(device):
        return HostEvent()
    return _module(device).Event(enable_timing=timing)


class HostCopy:
    """A device tensor's values for the host, taken without blocking: on an accelerator a copy into
    pinned memory queued on the current stream, with an event recorded behind it; `tolist()` waits
    for that event alone (read a step later, the copy has long landed) and reads host memory. On the
    CPU the tensor itself, whose values are there once it exists."""

    def __init__(self, t: torch.Tensor):
        t = t.detach()
        if is_accelerator(t.device):
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
        else:
            self.host = t
        self.landed = event(t.device)
        self.landed.record()

    def ready(self) -> bool:
        """Whether the copy has landed (never waits)."""
        return self.landed.query()

    def tolist(self) -> Any:
        self.landed.synchronize()
        return self.host.tolist()


def synchronize(device: torch.device | None = None) -> None:
    """Wait for every stream of `device` (default: the current accelerator); nothing on the CPU."""
    if device is None:
        device = current() or CPU
    if is_accelerator(device):
        torch.accelerator.synchronize(device)


def synchronize_stream(device: torch.device) -> None:
    """Wait for the work queued so far on `device`'s current stream only; nothing on the CPU."""
    if is_accelerator(device):
        current_stream(device).synchronize()


# ---- host memory ----------------------------------------------------------------------------------
def can_pin() -> bool:
    """Whether page-locked host memory helps here: only with an accelerator to copy to and from."""
    return accelerator_type() is not None


def return_freed_host_memory(keep: int = 0) -> None:
    """Hand the host heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere).
    glibc keeps freed blocks under its mmap threshold (which rises to 32 MiB as large blocks are
    freed) in the heap, and which rank keeps how much depends on its heap's history: materialising a
    350M GPT on 4 ranks, one random rank kept up to 0.7 GiB more than the others, 1.5x its live
    tensors. Called once per bucket at set-up, and before each large module initialiser runs
    (engine/setup/initialisers.py), it holds every rank to its live tensors. `keep`: bytes left at the heap's top for
    an allocation about to be made, which then reuses them instead of faulting fresh pages in."""
    trim = _malloc_trim()
    if trim is not None:
        trim(keep)


@functools.cache
def _malloc_trim() -> Any:
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): their allocators return memory themselves
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int  # ctypes' default int stops at 2 GiB
    return trim


# ---- memory statistics (bytes of the device's caching allocator) --------------------------------
def memory_allocated(device: torch.device) -> int:
    """Bytes of tensors on `device` now (0 on the CPU)."""
    return _memory("memory_allocated", device)


def max_memory_allocated(device: torch.device) -> int:
    """Peak bytes of tensors on `device` since the last reset_peak_memory_stats (0 on the CPU)."""
    return _memory("max_memory_allocated", device)


def max_memory_reserved(device: torch.device) -> int:
    """Peak bytes the allocator held from the device, cache included (0 on the CPU)."""
    return _memory("max_memory_reserved", device)


def reset_peak_memory_stats(device: torch.device) -> None:
    """Start the peak statistics of `device` afresh (nothing on the CPU)."""
    if is_accelerator(device):
        _memory_api("reset_peak_memory_stats", device)(device)


def empty_cache(device: torch.device) -> None:
    """Give the allocator's cached free blocks back to `device` (nothing on the CPU): one process
    that builds model after model (benchmarks) then starts each from the same free memory."""
    if is_accelerator(device):
        (getattr(torch.accelerator, "empty_cache", None) or _module(device).empty_cache)()


def _memory(name: str, device: torch.device) -> int:
    return int(_memory_api(name, device)(device)) if is_accelerator(device) else 0


def _memory_api(name: str, device: torch.device) -> Any:
    # torch.accelerator's memory statistics (torch >= 2.9) serve every accelerator; before them,
    # the device module's of the same name.
    return getattr(torch.accelerator, name, None) or getattr(_module(device), name)


# ---- random state -------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed every generator a job draws from: Python's, numpy's and torch's (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> torch.Tensor | None:
    """The generator state of an accelerator `device`; None on the CPU (torch.get_rng_state has it)."""
    return _module(device).get_rng_state(device) if is_accelerator(device) else None


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Restore what rng_state(device) returned."""
    if is_accelerator(device):
        _module(device).set_rng_state(state, device)


def _module(device: torch.device) -> Any:
    return torch.get_device_module(device.type)
