"""How far Adam(W) may carry two runs apart that differ only in the order their gradients were summed
(N ranks' shares averaged against one process's whole batch), element by element.

Adam's first step moves an element by lr * g / (|g| + eps), whose slope in g is lr * eps / (|g| + eps)^2:
negligible where |g| >> eps (lr * eps / g^2: 4e-13 at |g| = 5e-4, lr = 1e-3), but lr / eps = 1e5 where g
is zero. Two sums of the same fp32 terms differ by rounding, delta <= ~10 u max|g| (u = 2^-24; test_peft's
DPO case measured 9.3 at its largest elements, 0.09 at its near-zero ones). An element whose gradient
meets zero turns that into an lr-scale move: test_peft's DPO lm_head[207, 31] had g = 2.6e-8 = 2.6 eps at
step 0, and its two summation orders (the 2 ranks', and the same halves summed in one process) moved it
1.18e-6 apart, over 1e-6 (the AVX-512 machines' matmuls round it that way; others did not). Later steps
divide by sqrt(v_hat), which carries the earlier gradients, so the first step's slope bounds theirs too.

The slack is that slope times delta, summed over the steps, from the reference's own gradients: 1e-6 stays
the tolerance wherever the gradient keeps clear of zero (|g| >= 1e-6 adds under 1e-9), and only the few
elements that meet zero get more (at most lr * 10 u max|g| / eps per step). A bug moves every element.
"""

from __future__ import annotations

import torch

U = 2.0 ** -24  # fp32's unit roundoff
SUM_ORDER_ULPS = 10  # two orders of one fp32 sum differ by up to this many u * max|g| (measured: 9.3)


class GradientLog:
    """A one-process reference's gradients at each optimizer step, by state-dict name: call `record`
    between backward and step."""

    def __init__(self, model: torch.nn.Module):
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.steps: list[dict[str, torch.Tensor]] = []

    def record(self) -> None:
        self.steps.append({n: p.grad.detach().clone() for n, p in self.named if p.grad is not None})

    def slack(self, lr: float, eps: float = 1e-8) -> dict[str, torch.Tensor]:
        """Per element: how far Adam(lr, eps) may move it apart in the other summation order."""
        out: dict[str, torch.Tensor] = {}
        for grads in self.steps:
            for name, g in grads.items():
                delta = SUM_ORDER_ULPS * U * g.abs().max()
                # an exact zero is a sum of no terms (an embedding row no token used): zero in any order
                out[name] = out.get(name, 0) + torch.where(g == 0, 0.0, lr * delta * eps / (g.abs() + eps) ** 2)
        return out


def assert_close_after_adam(ours: dict, theirs: dict, slack: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    """Every tensor of `theirs` equal in `ours` to rtol = atol = tol, plus each element's Adam slack."""
    assert ours.keys() == theirs.keys()
    for k, ref in theirs.items():
        diff = (ours[k].double() - ref.double()).abs()
        allowed = tol + tol * ref.double().abs() + slack.get(k, torch.zeros(())).double()
        over = diff > allowed
        if over.any():
            i = int((diff - allowed).argmax())
            at = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), diff.shape))
            raise AssertionError(f"{k}: {int(over.sum())} of {diff.numel()} elements apart; the worst at {at}: "
                                 f"{diff.flatten()[i].item():.3g} apart, {allowed.flatten()[i].item():.3g} allowed "
                                 f"(Adam's slack there {slack.get(k, torch.zeros(diff.shape)).flatten()[i].item():.3g})")
