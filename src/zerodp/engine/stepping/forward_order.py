"""overlap_param_gather (stages 1-2): the next forward waits for each bucket's parameter all-gather
just before the bucket is first used, instead of step() waiting for all of them.

The first forward is traced once: a TorchFunctionMode sees every torch call and notes, for each
bucket, the module whose forward pre-hook fired last before one of the bucket's parameters was
first passed to a torch function. That catches parameters a module uses without owning them (a tied
output head, a parameter read by a parent's forward), which ownership alone would miss. Afterwards:
  * step() gathers buckets in that first-use order and returns with them in flight;
  * each module that is a wait point has a forward pre-hook that waits for every bucket up to its
    place in the order (a prefix, so a module skipped in some forward cannot strand a bucket);
  * the root module's pre-hook waits for buckets the trace never saw used, its post-hook for all
    (also when forward raises, so the trace never outlives its forward).
The hooks live on a few modules (the wait points), not on every one, and only wait.
"""

from __future__ import annotations

from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from zerodp.engine.stepping.optimizer import PartitionedOptimizer


class _FirstUse(TorchFunctionMode):
    """Records, per bucket, how many module pre-hooks had fired when it was first used."""

    def __init__(self, bucket_of: dict[int, int]):
        super().__init__()
        self.bucket_of = bucket_of
        self.fired: list[int] = []           # module position of each pre-hook fired, in order
        self.first_use: dict[int, int] = {}  # bucket index -> hooks fired before its first use

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            k = self.bucket_of.get(id(t)) if isinstance(t, nn.Parameter) else None
            if k is not None and k not in self.first_use:
                self.first_use[k] = len(self.fired)
        return func(*args, **(kwargs or {}))


class ForwardOrder:
    def __init__(self, module: nn.Module, partitioned: PartitionedOptimizer):
        self.module, self.partitioned_optimizer = module, partitioned
        self.bucket_of = {id(s.param): b.index for b in partitioned.buckets for s in b.slots}
        self.unseen = 0      # buckets the trace saw no use of: gathered first, waited for at the root
        self._handles = [module.register_forward_pre_hook(self._root_pre),
                         module.register_forward_hook(self._root_post, always_call=True)]
        self._trace: _FirstUse | None = None
        self._trace_handles: list = []
        self.traced = False

    def remove_hooks(self) -> None:
        """The forward waits for no gather any more (the engine is being destroyed)."""
        for h in self._handles + self._trace_handles:
            h.remove()
        self._handles, self._trace_handles = [], []

    # ---- the one traced forward -----------------------------------------------------------------
    def _root_pre(self, module, args) -> None:
        if not self.traced and self._trace is None:
            self._begin_trace()
        self.partitioned_optimizer.wait_for_parameters(upto=self.unseen)

    def _root_post(self, module, args, output) -> None:
        if self._trace is not None:
            self._end_trace()
        self.partitioned_optimizer.wait_for_parameters()

    def _begin_trace(self) -> None:
        self.partitioned_optimizer.wait_for_parameters()
        self._trace = _FirstUse(self.bucket_of)
        self._modules = [m for m in self.module.modules() if m is not self.module]
        for i, m in enumerate(self._modules):
            self._trace_handles.append(m.register_forward_pre_hook(self._counter(i)))
        self._trace.__enter__()

    def _counter(self, i: int):
        def hook(module, args):
            self._trace.fired.append(i)
        return hook

    def _end_trace(self) -> None:
        trace, self._trace = self._trace, None
        trace.__exit__(None, None, None)
        for h in self._trace_handles:
            h.remove()
        self._trace_handles = []
        self.traced = True
        n = len(self.partitioned_optimizer.buckets)
        unseen = [k for k in range(n) if k not in trace.first_use]
        seen = sorted((k for k in trace.first_use), key=lambda k: (trace.first_use[k], k))
        order = unseen + seen
        self.partitioned_optimizer.set_gather_order(order)
        # A bucket first used after the j-th pre-hook fired is waited for in that hook's module;
        # used before any (by the root's own forward): at the root, like an unseen one. Those sort
        # first in `order`, so the root waits for a prefix too.
        self.unseen = sum(1 for k in order if trace.first_use.get(k, 0) == 0)
        wait_at: dict[int, int] = {}  # module position -> prefix of `order` to wait for
        for pos, k in enumerate(order[self.unseen:], start=self.unseen):
            wait_at[trace.fired[trace.first_use[k] - 1]] = pos + 1
        for i, upto in wait_at.items():
            self._handles.append(self._modules[i].register_forward_pre_hook(self._waiter(upto)))

    def _waiter(self, upto: int):
        def hook(module, args):
            self.partitioned_optimizer.wait_for_parameters(upto=upto)
        return hook
