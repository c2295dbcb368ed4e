"""bf16 on a CPU without bf16 instructions: measured once, said once (rank 0).

A CPU without AVX512-BF16 or AMX runs bf16 matmuls through conversions, 10-20x slower than fp32
(measured on a 2-core AVX2 machine: a 256 x 256 matmul takes 20 ms in bf16 and 1.1 ms in fp32).
Instruction flags are not a reliable guide (oneDNN, the build and the torch version decide which
kernels run), so the engine measures the thing itself: the same small matmul in both dtypes, a few
milliseconds, once per process, and warns with the ratio when bf16 is the slower one by far.
"""

from __future__ import annotations

import time
import warnings

import torch

SLOW_RATIO = 3.0  # bf16 this many times slower than fp32 is worth a warning (fast bf16 is ~0.5-1x)
_SIZE, _REPEATS = 128, 5


class SlowBF16Warning(UserWarning):
    """bf16 working precision on a CPU where bf16 matmuls are much slower than fp32 ones."""


def bf16_slowdown() -> float:
    """Time of a matmul in bf16 over the same in fp32 on this CPU (best of a few)."""
    def best(dtype: torch.dtype) -> float:
        # Its own generator: drawing from the global one on rank 0 alone would leave rank 0's random
        # stream (dropout) different from every other rank's, and from a run without zerodp.
        a = torch.randn(_SIZE, _SIZE, generator=torch.Generator().manual_seed(0)).to(dtype)
        a @ a  # first call: kernel choice and allocation, not timed
        times = []
        for _ in range(_REPEATS):
            t0 = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t0)
        return min(times)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: a busy thread pool's wake-ups would drown a 0.1 ms matmul
    try:
        with unset_fake_temporarily(), torch.no_grad():  # estimate's fake-tensor runs time real tensors
            return best(torch.bfloat16) / max(best(torch.float32), 1e-9)
    finally:
        torch.set_num_threads(threads)


_checked = False


def warn_if_slow_bf16(device: torch.device, dtype: torch.dtype, rank: int) -> None:
    """Once per process, on rank 0: warn when bf16 on this CPU is SLOW_RATIO times slower than fp32."""
    global _checked
    if _checked or rank != 0 or device.type != "cpu" or dtype != torch.bfloat16:
        return
    _checked = True
    ratio = bf16_slowdown()
    if ratio >= SLOW_RATIO:
        warnings.warn(f"bf16 on this CPU is {ratio:.0f}x slower than fp32 (a {_SIZE}x{_SIZE} matmul, measured "
                      f"now; this CPU has no fast bf16 kernels, e.g. AVX512-BF16 or AMX): use fp32 on it "
                      "(zerodp train --dtype fp32, or bf16.enabled false); the memory per rank is then larger",
                      SlowBF16Warning, stacklevel=4)  # the caller of zerodp.initialize
