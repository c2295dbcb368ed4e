"""How far Adam(W) may carry two runs apart that differ only in the order their gradients were summed
(N ranks' shares averaged against one process's whole batch), element by element.

Adam moves an element by lr * m_hat / (sqrt(v_hat) + eps). At the first step that is lr * g / (|g| + eps),
whose slope in g is lr * eps / (|g| + eps)^2: negligible where |g| >> eps (4e-13 at |g| = 5e-4, lr = 1e-3)
but lr / eps = 1e5 where g is zero. Two sums of the same fp32 terms differ by rounding, delta <= ~10 u
max|g| (u = 2^-24; test_peft's DPO case measured 9.3 at its largest elements, 0.09 at its near-zero ones).
An element whose gradient meets zero turns that into a move far over 1e-6: test_peft's DPO lm_head[207, 31]
had g = 2.6e-8 = 2.6 eps at step 0, and its two summation orders (the 2 ranks', or the same halves summed
in one process) moved it 1.18e-6 apart (AVX-512 machines' matmuls round it so; others did not). At later
steps sqrt(v_hat) carries the earlier gradients and the slope is smaller; the slack takes each step's own.

The slack is that slope times delta, summed over the steps, from the reference's own state: 1e-6 stays the
tolerance wherever the gradient keeps clear of zero, and only the few elements that meet it get more (at
most lr * 10 u max|g| / eps a step, and never more than twice what a step can move an element: there the
rounding decides the step's sign). A bug moves every element (test_peft's planted ones: thousands).
"""

from __future__ import annotations

import torch

U = 2.0 ** -24  # fp32's unit roundoff
SUM_ORDER_ULPS = 10  # two orders of one fp32 sum differ by up to this many u * max|g| (measured: 9.3)


def largest_step(t: int, b1: float, b2: float) -> float:
    """The most |m_hat / sqrt(v_hat)| can be at step t, in units of lr: m_hat = sum w_i g_i and v_hat =
    sum w'_i g_i^2 (bias-corrected weights summing to 1), so by Cauchy-Schwarz |m_hat| <= sqrt(sum w_i^2 / w'_i)
    sqrt(v_hat): 1 at the first step, 1.0014 at the second."""
    w = [(1 - b1) * b1 ** (t - i) / (1 - b1 ** t) for i in range(1, t + 1)]
    w2 = [(1 - b2) * b2 ** (t - i) / (1 - b2 ** t) for i in range(1, t + 1)]
    return sum(a * a / b for a, b in zip(w, w2)) ** 0.5


class AdamSlack:
    """A one-process reference's Adam(W): call `record` between backward and step; `slack` is then, per
    state-dict name, how far each element may move apart in another summation order."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Adam):
        assert isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and not optimizer.defaults["amsgrad"]
        self.names = {p: n for n, p in model.named_parameters()}
        self.optimizer = optimizer
        self.slack: dict[str, torch.Tensor] = {}

    def record(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    name = self.names[p]
                    self.slack[name] = self.slack.get(name, 0) + self._step_slack(p, group)

    def _step_slack(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """lr * delta * |d(m_hat / (sqrt(v_hat) + eps)) / dg| at this step (torch's Adam: bias-corrected)."""
        (b1, b2), eps, state, g = group["betas"], group["eps"], self.optimizer.state.get(p, {}), p.grad.double()
        t = int(state["step"]) + 1 if "step" in state else 1
        m = state["exp_avg"].double() if state else torch.zeros_like(g)
        v = state["exp_avg_sq"].double() if state else torch.zeros_like(g)
        m_hat, v_hat = (b1 * m + (1 - b1) * g) / (1 - b1 ** t), (b2 * v + (1 - b2) * g * g) / (1 - b2 ** t)
        root = v_hat.sqrt()
        d_root = torch.where(root > 0, (1 - b2) / (1 - b2 ** t) * g / root.clamp_min(1e-300), 0.0)
        slope = ((1 - b1) / (1 - b1 ** t) / (root + eps) - m_hat * d_root / (root + eps) ** 2).abs()
        delta, lr = SUM_ORDER_ULPS * U * g.abs().max(), float(group["lr"])
        # never more than the step can move it: rounding decides its sign at worst
        slack = (lr * delta * slope).clamp(max=2 * lr * largest_step(t, b1, b2))
        # an exact zero is a sum of no terms (an embedding row no token used): zero in any order
        return torch.where(g == 0, 0.0, slack).float()


def assert_close_after_adam(ours: dict, theirs: dict, slack: dict[str, torch.Tensor], tol: float = 1e-6,
                            rtol: float | None = None) -> None:
    """Every tensor of `theirs` equal in `ours` to atol = tol and rtol (default: tol), plus each element's Adam
    slack (a name the slack lacks has none)."""
    assert ours.keys() == theirs.keys()
    rtol = tol if rtol is None else rtol
    for k, ref in theirs.items():
        diff = (ours[k].double() - ref.double()).abs()
        allowed = tol + rtol * ref.double().abs() + slack.get(k, torch.zeros(())).double()
        over = diff > allowed
        if over.any():
            i = int((diff - allowed).argmax())
            at = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), diff.shape))
            there = slack.get(k, torch.zeros(diff.shape)).flatten()[i].item()
            raise AssertionError(f"{k}: {int(over.sum())} of {diff.numel()} elements apart; the worst at {at}: "
                                 f"{diff.flatten()[i].item():.3g} apart, {allowed.flatten()[i].item():.3g} allowed "
                                 f"(Adam's slack there {there:.3g})")
