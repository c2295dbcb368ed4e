"""Non-finite steps: a nan/inf global gradient norm skips the step on every rank; the config's
`non_finite` policy decides when skipping becomes an error.

Every rank decides from values all ranks already share, so all skip (and all raise) together:
the global squared norm (all-reduced in stages 1-3; in stage 0 computed from all-reduced
gradients), the loss scale, and two numbers that ride in the same all-reduce as the norm (stage 0:
a small all-reduce of their own): how many ranks had a non-finite loss in the step, and the sum of
their (rank + 1), which names the rank when there is one. A non-finite loss skips the step even when
every gradient is finite (a detached inf term adds nothing to the gradients but is no good step).

What counts toward `max_consecutive_skips`: every skipped step in fp32 and bf16, and in fp16 with a
static loss scale; in fp16 with dynamic loss scaling an overflow is the scaler's routine signal to
lower the scale, and counts only when the scale was already at `min_loss_scale` or a rank's loss
itself was non-finite (a lower scale cannot mend a non-finite forward pass). A finite step resets
the count; a routine overflow leaves it as it is.

When the host learns the decision (`non_finite.read_back`):
  same_step  step() reads it (one device-to-host sync per step: `step_is_finite`) and acts on it at
             once: the optimizer is stepped or not, the policy counts, logs and raises in that step.
  next_step  the step is skipped on the device: the decision is `skip_on_device`'s 0/1 tensor, handed
             to the fused optimizer as its `found_inf` (as torch's GradScaler does), whose kernel then
             leaves parameters, moments and step counts alone. Its host copy (pinned, behind an event:
             device.HostCopy) is read at the start of the next step(), or when the engine's state is
             read (skipped_steps, get_lr(), checkpoints), by which time it has long landed: the lr
             scheduler's step, skipped_steps and the log line come then, and a NonFiniteError from
             that next step() call, on every rank, before it changes anything. Needs an
             optimizer whose step takes `found_inf` (torch's fused Adam, AdamW, SGD, Adagrad), no
             offload (the host steps there, and has waited for the gradients anyway) and no dynamic
             fp16 loss scale (its scale lives on the host); a step where the used-parameter bits were
             read back (a parameter without gradient: unused.py) decides in the same step.
  auto       next_step on an accelerator wherever it is possible, same_step elsewhere (on the CPU the
             read costs nothing: its values exist once computed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from zerodp.config import Config, ConfigError
from zerodp.distributed.comm import Comm
from zerodp.distributed.device import HostCopy, is_accelerator
from zerodp.engine.stepping.precision import LossScaler

logger = logging.getLogger("zerodp")

# One log line names the step; the error adds where to look.
_ADVICE = ("look at the data and loss of {where}, the learning rate (lower it or lengthen the warmup), "
           "gradient_clipping, and for fp16 a switch to bf16 (fp16's range is 6.5e4); set "
           "non_finite.policy to \"skip\" to go on skipping, or raise non_finite.max_consecutive_skips")


class NonFiniteError(FloatingPointError):
    """Too many steps in a row had a non-finite gradient norm (config section 'non_finite').

    Raised by engine.step() on every rank at the same step, after that step was skipped: the
    parameters, fp32 masters and optimizer state are those of the last finite step. With
    non_finite.read_back next_step, by the step() call after it, before that one changes anything."""


def step_flags(loss: torch.Tensor | None, rank: int) -> torch.Tensor:
    """[non-finite loss on this rank (0/1), that flag x (rank + 1)] as fp64, on device, no sync."""
    if loss is None:  # no loss seen (a step with no backward): nothing to report
        return torch.zeros(2, dtype=torch.float64)
    bad = torch.isfinite(loss).logical_not().double()
    return torch.stack([bad, bad * (rank + 1)])


def step_is_finite(norm_sq: torch.Tensor, flags: torch.Tensor | None, comm: Comm) -> bool:
    """The step's one host sync: whether the agreed global squared norm is finite and no rank's loss
    was non-finite (the agreed `flags`; None where they are unknown)."""
    if comm.is_fake(norm_sq):  # peak.py measures memory on fake tensors: nothing to read
        return True
    finite = torch.isfinite(norm_sq)
    if flags is not None and flags.numel():
        finite = finite & (flags[0] == 0)
    return bool(finite)


def skip_on_device(norm_sq: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
    """step_is_finite's decision left on the device: 1.0 to skip, 0.0 to step (fp32, shape (), as a
    fused optimizer's `found_inf`), no sync."""
    bad = torch.isfinite(norm_sq).logical_not()
    if flags is not None and flags.numel():
        bad = bad | (flags[0] != 0)
    return bad.float()


def decides_on_device(config: Config, optimizer: Optimizer, offload: bool, scaler: LossScaler,
                      device: torch.device) -> bool:
    """Whether steps are skipped on the device and read back a step later (`non_finite.read_back`);
    next_step where it cannot be done is refused, naming what stands in the way."""
    mode = config.non_finite.read_back
    if mode == "same_step":
        return False
    obstacles = []
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        obstacles.append(f"the optimizer ({type(optimizer).__name__}) cannot skip a step on the device: "
                         "its step() takes no found_inf (torch's Adam, AdamW, SGD and Adagrad with fused=True do)")
    if offload:
        obstacles.append("zero_optimization.offload_optimizer steps on the host, which waits for the gradients")
    if scaler.dynamic:
        obstacles.append("fp16's dynamic loss scale is updated on the host from each step's decision")
    if mode == "next_step" and obstacles:
        raise ConfigError("non_finite.read_back \"next_step\" is not possible here: " + "; ".join(obstacles)
                          + "; use \"auto\" (next_step where possible) or \"same_step\"")
    return not obstacles and (mode == "next_step" or is_accelerator(device))


@dataclass
class PendingStep:
    """A step's decision until the host acts on it (Training.settle): left on the device (read_back
    next_step), read from `values` a step later; or decided on the host, `known` at once."""

    step: int             # its global step number
    scale_used: float     # the loss scale its backward used
    values: HostCopy | None = None  # on the device: [skip (0/1), its gradient norm, then the agreed flags if any]
    has_flags: bool = False
    known: tuple[bool, float, torch.Tensor | None] | None = None  # decided on the host: (finite, norm, flags)

    @property
    def on_device(self) -> bool:
        return self.known is None

    def read(self) -> tuple[bool, float, torch.Tensor | None]:
        """(finite, norm, flags): waits for the host copy only."""
        if self.known is not None:
            return self.known
        skip, norm, *flags = self.values.tolist()
        return not skip, norm, (torch.tensor(flags, dtype=torch.float64) if self.has_flags else None)


def pending_step(step: int, skip: torch.Tensor, norm: torch.Tensor, flags: torch.Tensor | None,
                 scale_used: float) -> PendingStep:
    """A step decided on the device: its decision, norm and flags copied to the host without a wait."""
    has_flags = flags is not None and flags.numel() > 0
    parts = [skip.reshape(1), norm.detach().reshape(1).to(skip.dtype)]
    if has_flags:
        parts.append(flags.to(skip.dtype))
    return PendingStep(step, scale_used, HostCopy(torch.cat(parts)), has_flags)


def decided_step(step: int, finite: bool, norm: torch.Tensor, flags: torch.Tensor | None,
                 scale_used: float) -> PendingStep:
    """A step decided on the host: the norm is read (a sync) only for a skipped step, whose line names it."""
    return PendingStep(step, scale_used, known=(finite, 0.0 if finite else float(norm), flags))


class NonFinitePolicy:
    """Counts consecutive skipped steps, logs each skip (rank 0 only), raises per the config."""

    def __init__(self, config: Config, rank: int):
        self.policy = config.non_finite.policy
        self.limit = config.non_finite.max_consecutive_skips
        self.rank = rank
        self.consecutive = 0

    def after_step(self, step: int, finite: bool, flags: torch.Tensor | None, scaler: LossScaler,
                   scale_used: float, norm: float) -> None:
        """Called by engine.step() once per optimizer step, on every rank, with agreed values."""
        if finite:
            self.consecutive = 0
            return
        count = _count(flags)
        where = _where(count, flags)
        routine = scaler.dynamic and scale_used > scaler.min_scale and not count
        if not routine:
            self.consecutive += 1
        if self.rank == 0:  # one line per job, not one per rank
            logger.log(logging.INFO if routine else logging.WARNING, "%s",
                       self._line(step, where, norm, scaler, scale_used, routine))
        if self.policy == "raise" and self.consecutive >= self.limit:
            raise NonFiniteError(
                f"{self.consecutive} steps in a row (the last: step {step}) had a non-finite global "
                f"gradient norm and were skipped on every rank (non_finite.max_consecutive_skips = "
                f"{self.limit}); the loss was non-finite on {where}. The model is unchanged since the "
                f"last finite step. To find the cause, " + _ADVICE.format(where=where if count else "every rank"))

    def _line(self, step: int, where: str, norm: float, scaler: LossScaler, scale_used: float,
              routine: bool) -> str:
        line = f"step {step} skipped: global gradient norm {norm}; loss non-finite on {where}"
        if scaler.dynamic:
            line += f"; fp16 loss scale {_number(scale_used)} -> {_number(scaler.scale)}"
        if routine:
            return line + " (fp16 overflow, not counted toward non_finite.max_consecutive_skips)"
        return line + f" ({self.consecutive} in a row, policy {self.policy!r}" + (
            f", raises at {self.limit})" if self.policy == "raise" else ")")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _count(flags: torch.Tensor | None) -> int | None:
    """How many ranks had a non-finite loss (None: not known), from the all-reduced step flags."""
    return None if flags is None else int(flags[0])  # a second sync, on the skip path only


def _where(count: int | None, flags: torch.Tensor | None) -> str:
    if count is None:
        return "an unknown rank (stage 0 over several ranks shares no per-rank flags)"
    if count == 0:
        return "no rank (the loss was finite everywhere: the gradients themselves overflowed)"
    return f"rank {int(flags[1]) - 1}" if count == 1 else f"{count} ranks"
