"""Optimizer precision below fp32: bf16 master weights kept exact by a 16-bit remainder, and optimizer
states kept in bf16 by stochastic rounding (DeepSpeed's bf16.bf16_master_weights_and_grads and
bf16.bf16_optimizer_states).

The optimizer still steps in fp32, one sub_group_size part at a time (optimizer.py): before a part is
stepped its masters and states are made fp32, after it they go back to their low-precision form. The
fp32 copies are transient (4 bytes x sub_group_size x the tensors per element), the at-rest cost is:

  master, `CompensatedMasters`: an fp32 number is its bf16 rounding (the working shard the model already
  holds, 2 bytes) plus the difference of the two bit patterns, which fits in 16 bits (an int16
  remainder, 2 bytes). It is Kahan's compensation term, kept exactly: the master is the fp32 value bit for
  bit, for 2 bytes instead of 4. (Megatron-Core's precision-aware optimizer keeps the same remainders.)
  A bf16 compensation term (Kahan in bf16, 2 bytes as well) would keep 8 of its 16 bits; stochastic
  rounding of the master (0 bytes) makes each update exact only in expectation, with an error of one bf16
  ulp (2^-8 relative) per step. The remainder costs what the first costs and loses nothing.

  states, `round_states`: Adam's m and v in bf16, stochastically rounded. Round-to-nearest would stall
  them: v moves by (1 - beta2) = 1e-3 of itself per step, less than half a bf16 ulp (2^-9), so v would
  round back to its old value and stop following the gradients; rounded up with probability equal to the
  fraction of an ulp, each stored value equals the fp32 one in expectation and the EMA keeps moving.
  (torchao's low-precision optimizers round their bf16 tensors stochastically for the same reason.)
  The noise comes from a generator of the engine's own, seeded by rank, never the global one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_LOW = 0xFFFF  # the 16 bits of an fp32 pattern that bf16 drops
_HALF = 0x8000


@dataclass(frozen=True)
class OptimizerPrecision:
    """How the partitioned optimizer keeps what it steps between steps (decided once, from the config)."""

    compensated_masters: bool = False  # masters as the bf16 working shard + an int16 remainder
    bf16_states: bool = False  # per-element optimizer states in bf16, stochastically rounded

    @property
    def low(self) -> bool:
        return self.compensated_masters or self.bf16_states


def split_master(master: torch.Tensor, working: torch.Tensor, remainder: torch.Tensor) -> None:
    """fp32 `master` -> its bf16 rounding in `working` (half away from zero) and the int16 `remainder` that
    join_master adds back: bits(master) = bits(working as fp32) + remainder, exactly."""
    bits = master.view(torch.int32)
    high = (bits + _HALF) & ~_LOW  # the low half dropped, rounded half away from zero (magnitude arithmetic)
    remainder.copy_(bits - high)  # within [-0x8000, 0x7fff]: fits int16
    working.copy_(high.view(torch.float32))  # exact: its low 16 bits are zero


def join_master(working: torch.Tensor, remainder: torch.Tensor, master: torch.Tensor) -> None:
    """The fp32 master from its two halves (split_master's inverse)."""
    master.copy_((working.float().view(torch.int32) + remainder.to(torch.int32)).view(torch.float32))


def first_remainder(master: torch.Tensor, working: torch.Tensor) -> torch.Tensor:
    """The remainder of `master` against a working shard set-up already rounded (to nearest even): exact
    but where the fp32 value lay exactly halfway between two bf16 numbers and was rounded down (+0x8000
    does not fit int16), where the master is then one fp32 ulp (2^-24 relative) below its value."""
    diff = master.view(torch.int32) - working.float().view(torch.int32)
    return diff.clamp_(-_HALF, _HALF - 1).to(torch.int16)


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x (fp32) in bf16, rounded up (in magnitude) with probability equal to the dropped fraction of an ulp:
    unbiased, E[result] = x."""
    noise = torch.randint(0, _LOW + 1, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((x.view(torch.int32) + noise) & ~_LOW).view(torch.float32).to(torch.bfloat16)


def per_element(state: dict, t: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """The keys of `state` holding a tensor of `dtype` with one value per element of t (Adam's m and v; not
    its step count)."""
    return [k for k, v in state.items()
            if torch.is_tensor(v) and v.dtype == dtype and v.dim() > 0 and v.shape == t.shape]


class StateRounding:
    """bf16 at rest, fp32 while stepped: the per-element optimizer states of the tensors stepped."""

    def __init__(self, rank: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0x5EED + rank)  # ranks draw different noise; the global stream is untouched

    @staticmethod
    def widen(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> None:
        """Before a step: each bf16 state back to fp32 for the optimizer's arithmetic."""
        for t in tensors:
            state = optimizer.state.get(t)
            for k in per_element(state, t, torch.bfloat16) if state else ():
                state[k] = state[k].float()

    def narrow(self, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> None:
        """After a step: each fp32 state to bf16, stochastically rounded."""
        for t in tensors:
            state = optimizer.state.get(t)
            for k in per_element(state, t, torch.float32) if state else ():
                state[k] = stochastic_round(state[k], self.generator)
