"""`deepspeed.ops.adam`: FusedAdam and DeepSpeedCPUAdam, DeepSpeed's two kernels of one update, as torch's.

Both are AdamW by default (DeepSpeed's adam_w_mode / adamw_mode) and Adam with an L2 penalty without
it: here torch.optim.Adam with `decoupled_weight_decay` set accordingly, which with it is exactly
torch.optim.AdamW's algorithm (torch's AdamW is that subclass). torch's fused kernel steps them where
it exists (CUDA, the CPU). Passed to initialize, either is rewired like any torch optimizer to step
the engine's fp32 master shards: on the device, or in host memory with offload_optimizer (where
DeepSpeed would use its CPUAdam).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zerodp.config.optimizer import fused_adam_fits

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


def _groups_and_fused(params: Iterable[Any]) -> tuple[list[Any], bool]:
    """The params as a list (tensors, (name, tensor) pairs or param-group dicts), and whether torch's
    fused kernel can step all of them."""
    if torch.is_tensor(params):
        return params, False  # torch's own error: params must be an iterable
    groups = list(params)
    tensors = []
    for g in groups:
        if isinstance(g, dict):
            inner = g["params"]
            g["params"] = inner = [inner] if torch.is_tensor(inner) else list(inner)
            tensors += [t[1] if isinstance(t, tuple) else t for t in inner]
        else:
            tensors.append(g[1] if isinstance(g, tuple) else g)
    return groups, fused_adam_fits(tensors) and all(t.is_floating_point() for t in tensors)


def _check_bias_correction(name: str, bias_correction: bool) -> None:
    if bias_correction is not True:
        raise ValueError(f"{name}(bias_correction=False) is not supported: torch's Adam always corrects the "
                         "moments' bias (DeepSpeed's default); remove the argument")


class FusedAdam(torch.optim.Adam):
    """deepspeed.ops.adam.FusedAdam, DeepSpeed's names and defaults: AdamW unless adam_w_mode=False.

    set_grad_none has no effect: torch's zero_grad() sets gradients to None as DeepSpeed's does with
    it (and the engine owns the gradients anyway). amsgrad, which DeepSpeed's kernel refuses, is torch's."""

    zerodp_element_wise = True  # torch's Adam: the engine steps it on flat shards (optimizer_view.py)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        _check_bias_correction("FusedAdam", bias_correction)
        groups, fused = _groups_and_fused(params)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode, fused=fused or None)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(torch.optim.Adam):
    """deepspeed.ops.adam.DeepSpeedCPUAdam, DeepSpeed's names and defaults: AdamW unless adamw_mode=False.

    It steps wherever the engine keeps the masters: host memory with zero_optimization.offload_optimizer
    (DeepSpeed requires that for its CPUAdam; zerodp does not need it). fp32_optimizer_states=False
    (states in the parameters' 16-bit dtype) is refused: the states stay fp32, next to fp32 masters."""

    zerodp_element_wise = True  # torch's Adam: the engine steps it on flat shards (optimizer_view.py)

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        _check_bias_correction("DeepSpeedCPUAdam", bias_correction)
        if fp32_optimizer_states is not True:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: zerodp keeps "
                             "optimizer states in fp32, next to the fp32 master weights; remove the argument")
        groups, fused = _groups_and_fused(model_params)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adamw_mode, fused=fused or None)
        self.adamw_mode = adamw_mode
