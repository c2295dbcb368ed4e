"""`deepspeed.accelerator.get_accelerator()`: the device a DeepSpeed script runs on, by DeepSpeed's names.

DeepSpeed's scripts ask the accelerator object rather than the CUDA module (`set_device(local_rank)`,
`device_name()`, `communication_backend_name()`, `is_bf16_supported()`, `manual_seed`, `synchronize`, ...),
so that the same script runs on any device. This is the subset scripts use, over `torch.accelerator`
(the current CUDA / XPU / ... device, or the CPU when there is none), answering as DeepSpeed's CUDA
and CPU accelerators do. Nothing here is used by the engine.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerodp.distributed import device


class Accelerator:
    """The accelerator of this process: torch's current one, or the CPU (with the gloo backend)."""

    def __init__(self) -> None:
        found = device.accelerator_type()
        self._name = found or "cpu"
        self._module = torch.get_device_module(found) if found is not None else None

    # ---- the device -----------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True  # the CPU is always there

    def device_name(self, device_index: int | None = None) -> str:
        """'cuda' (or 'cpu'); with an index, 'cuda:1'."""
        if device_index is None or self._module is None:
            return self._name
        return f"{self._name}:{device_index}"

    def current_device(self) -> int:
        """The index of the current device; on the CPU, as DeepSpeed's CPU accelerator, the LOCAL_RANK."""
        if self._module is None:
            return int(os.environ.get("LOCAL_RANK", "0"))
        return device.current().index

    def current_device_name(self) -> str:
        return self._name if self._module is None else f"{self._name}:{self.current_device()}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def _indexed(self, device_index: int | None) -> torch.device:
        """DeepSpeed's device_index (None: the current device) as the device zerodp's device module takes."""
        return self.device(self.current_device() if device_index is None and self._module is not None
                           else device_index)

    def set_device(self, device_index: int) -> None:
        if self._module is not None:
            device.set_device(device_index)

    def device_count(self) -> int:
        return 1 if self._module is None else device.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        device.synchronize(self._indexed(device_index))

    def is_synchronized_device(self) -> bool:
        """True where work runs when issued (the CPU): no streams or events to wait for."""
        return self._module is None

    def communication_backend_name(self) -> str:
        """The torch.distributed backend zerodp uses on this device ('nccl' on CUDA, 'gloo' on the CPU)."""
        return device.backend(None if self._module is None else self._name)

    # ---- precision ------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        check = getattr(self._module, "is_bf16_supported", None)
        return check() if check is not None else True

    def is_fp16_supported(self) -> bool:
        """False on the CPU, as DeepSpeed's CPU accelerator says (fp16 there is emulated and slow)."""
        return self._module is not None

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        dtypes += [torch.bfloat16] if self.is_bf16_supported() else []
        return dtypes + ([torch.float16] if self.is_fp16_supported() else [])

    # ---- random numbers -------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """The device's generator (the CPU's on a CPU), as the device module's manual_seed."""
        (self._module or torch).manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._module is None:
            torch.manual_seed(seed)
        else:
            self._module.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return (self._module or torch).initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._module is None:
            return torch.get_rng_state()
        return device.rng_state(self._indexed(device_index))

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._module is None:
            torch.set_rng_state(new_state)
        else:
            device.set_rng_state(new_state, self._indexed(device_index))

    def random(self) -> Any:
        return torch.random

    # ---- memory ---------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._module is not None:
            torch.accelerator.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors on the device; 0 on the CPU (no allocator statistics there)."""
        return device.memory_allocated(self._indexed(device_index))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return device.max_memory_allocated(self._indexed(device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        device.reset_peak_memory_stats(self._indexed(device_index))

    def total_memory(self, device_index: int | None = None) -> int:
        if self._module is None:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return self._module.get_device_properties(device_index or self.current_device()).total_memory

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._module is not None else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._module is not None else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---- streams, events, profiler ranges -------------------------------------------------------
    @property
    def Stream(self) -> Any:
        return torch.Stream

    @property
    def Event(self) -> Any:
        return torch.Event

    def current_stream(self, device_index: int | None = None) -> torch.Stream:
        if self._module is None:
            return torch.Stream("cpu")
        return device.current_stream(self._indexed(device_index))

    def range_push(self, msg: str) -> None:
        """A profiler range (nvtx on CUDA); nothing elsewhere."""
        nvtx = getattr(self._module, "nvtx", None)
        if nvtx is not None:
            nvtx.range_push(msg)

    def range_pop(self) -> None:
        nvtx = getattr(self._module, "nvtx", None)
        if nvtx is not None:
            nvtx.range_pop()


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator (one object, as DeepSpeed's)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR


def set_accelerator(accel: Any) -> None:
    raise ValueError("set_accelerator is not supported: zerodp.deepspeed's accelerator is torch's current "
                     "device (CUDA, XPU, ...) or the CPU; choose it with CUDA_VISIBLE_DEVICES or a CPU-only torch")
