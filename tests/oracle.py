"""The correctness oracle: N ranks with micro-batch b train exactly like one process with batch N*b.

Each `Case` is one behaviour the engine must handle (tied weights, frozen parameters, ...). The
engine runs every case on spawned gloo ranks; the reference is plain PyTorch in one process on the
concatenated batch, with the same optimizer, clipping via clip_grad_norm_, and the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerodp
from zerodp.engine.engine import inside

D_IN, D_OUT, MICRO, STEPS, LR = 13, 5, 3, 5, 1e-3
# The engine's cases train CASE_STEPS steps: "several" (a second step reads the optimizer state the first
# wrote, the third a state carried twice; the "unused" case's parameter gets a gradient on step 1 only).
# The optimizer cases keep issue 33's 5 steps, and the low-precision runs theirs (their tolerance must stay
# below what 5 steps move a weight). Steps are most of a job's time: 5 -> 3 is ~40% of the suite's oracle runs.
CASE_STEPS = 3


class Toy(nn.Module):
    """An MLP with sizes no world size divides; optional extras switch on one behaviour each."""

    def __init__(self, tied=False, frozen=False, unused=False, ckpt=False, reuse=False, parent=False,
                 hidden=37):
        super().__init__()
        self.ckpt, self.tied, self.reuse, self.parent = ckpt, tied, reuse, parent
        self.inp = nn.Linear(D_IN, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, D_OUT)
        self.norm = nn.LayerNorm(hidden)
        if tied:
            self.pair = TiedPair(hidden)  # one parameter used twice in one module's forward
            self.enc = nn.Linear(hidden, hidden, bias=False)
            self.dec = nn.Linear(hidden, hidden, bias=False)
            self.dec.weight = self.enc.weight  # one parameter registered in two modules (GPT's tie)
        if frozen:
            self.inp.weight.requires_grad_(False)
        self.use_sometimes = False
        if unused:
            self.never = nn.Linear(hidden, hidden)      # no gradient, ever
            self.sometimes = nn.Linear(hidden, hidden)  # a gradient on some steps only

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        if self.parent:  # the root's own forward uses a child's parameter before the child runs
            h = h + 0.5 * F.linear(h, self.mid.weight)
        if self.tied:
            h = self.pair(h)
            h = h + self.dec(torch.tanh(self.enc(h)))
        if self.ckpt:
            h = checkpoint(self._block, h, use_reentrant=False)
        else:
            h = self._block(h)
        if getattr(self, "sometimes", None) is not None and self.use_sometimes:
            h = h + self.sometimes(h)
        return F.mse_loss(self.out(h), y)

    def _block(self, h):
        if self.reuse:  # one submodule called twice per forward
            h = h + torch.tanh(self.mid(h))
        return self.norm(h + torch.tanh(self.mid(h)))


class TiedPair(nn.Module):
    """hidden -> D_IN -> hidden through the same matrix and its transpose."""

    def __init__(self, hidden):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D_IN, hidden) / hidden ** 0.5)

    def forward(self, h):
        return h + F.linear(torch.tanh(F.linear(h, self.w)), self.w.t())


def one_group(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)


def fused(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1,
                             fused=True)


def two_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and p.requires_grad]
    other = [p for n, p in model.named_parameters() if p.dim() <= 1 and p.requires_grad]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": other, "weight_decay": 0.0, "lr": LR / 3}], lr=LR)


def tiny_group(model):
    small = [model.out.bias]  # 5 elements: fewer than 64 per rank, some ranks own padding only
    rest = [p for p in model.parameters() if p.requires_grad and p is not model.out.bias]
    return torch.optim.AdamW([{"params": rest}, {"params": small, "lr": LR * 2}], lr=LR, weight_decay=0.1)


def _trained(model):
    return [p for p in model.parameters() if p.requires_grad]


class RowNormSGD(torch.optim.Optimizer):
    """A user's shape-aware optimizer: each row of a matrix (a vector: the whole) moves by its gradient over
    a running average of that row's gradient norm, kept as state of shape (rows,). On a flat shard its
    rows would be other rows."""

    def __init__(self, params, lr=LR, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.reshape(p.shape[0], -1) if p.dim() > 1 else p.grad.reshape(1, -1)
                state = self.state[p]
                norms = g.norm(dim=1)
                if "row_norm" not in state:
                    state["row_norm"] = norms.clone()
                state["row_norm"].mul_(group["beta"]).add_(norms, alpha=1 - group["beta"])
                p.sub_((g / (state["row_norm"][:, None] + 1e-3)).view_as(p), alpha=group["lr"])


def muon_and_adamw(model):
    """Muon as people run it: the hidden matrices; AdamW for the rest (here the first and last layers'
    weights, the norm and the biases)."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and p.requires_grad
              and not n.startswith(("inp.", "out."))]
    ids = {id(p) for p in hidden}
    rest = [p for p in _trained(model) if id(p) not in ids]
    return [torch.optim.Muon(hidden, lr=LR), torch.optim.AdamW(rest, lr=LR, weight_decay=0.1)]


# Every optimizer class of torch.optim (test_engine checks that none is missing), built on the Toy: None for
# the classes zerodp refuses at initialize (their step couples every parameter, or needs sparse gradients).
TORCH_OPTIMIZERS: dict[str, Callable | None] = {
    "Adam": lambda m: torch.optim.Adam(_trained(m), lr=LR),
    "AdamW": one_group,
    "SGD": lambda m: torch.optim.SGD(_trained(m), lr=LR * 10, momentum=0.9, nesterov=True),
    "Adagrad": lambda m: torch.optim.Adagrad(_trained(m), lr=LR * 10),
    "Adadelta": lambda m: torch.optim.Adadelta(_trained(m), lr=1.0),
    "RMSprop": lambda m: torch.optim.RMSprop(_trained(m), lr=LR, momentum=0.5, eps=1e-4),  # not 1e-8: v is tiny early
    "Adamax": lambda m: torch.optim.Adamax(_trained(m), lr=LR),
    "NAdam": lambda m: torch.optim.NAdam(_trained(m), lr=LR),
    "RAdam": lambda m: torch.optim.RAdam(_trained(m), lr=LR),
    "ASGD": lambda m: torch.optim.ASGD(_trained(m), lr=LR * 10, t0=2),
    "Rprop": lambda m: torch.optim.Rprop(_trained(m), lr=LR),
    "Adafactor": lambda m: torch.optim.Adafactor(_trained(m), lr=LR * 10),
    "Muon": muon_and_adamw,
    "LBFGS": None,
    "SparseAdam": None,
}
# Shape-aware: stepped on whole parameters (the rest step flat shards, as AdamW does in every case above).
WHOLE_PARAMETER_OPTIMIZERS = ("Adafactor", "Muon")


@dataclass
class Case:
    model: dict = field(default_factory=dict)
    optimizer: Callable = one_group
    config: dict = field(default_factory=dict)
    gas: int = 2
    clip: float = 1.0
    steps: int = CASE_STEPS


CASES = {
    "plain": Case(),
    "frozen": Case(model={"frozen": True}),
    "unused": Case(model={"unused": True}),
    "tied": Case(model={"tied": True}),
    "param_groups": Case(optimizer=two_groups),
    "indivisible": Case(model={"hidden": 7}),
    "tiny_group": Case(optimizer=tiny_group),
    "param_larger_than_bucket": Case(config={"reduce_bucket_size": 200}),
    "accumulation": Case(gas=4, clip=0.0),
    "checkpointed": Case(model={"ckpt": True}),
    "module_called_twice": Case(model={"reuse": True}),
    "used_by_parent": Case(model={"parent": True}),
    "fused_adamw": Case(optimizer=fused),
}
# One case per optimizer: "optim_{name}" (tests/test_engine.py runs them in the same launch).
OPTIMIZER_CASES = {f"optim_{name}": Case(optimizer=make, steps=STEPS) for name, make in TORCH_OPTIMIZERS.items()
                   if make}
OPTIMIZER_CASES["optim_row_norm"] = Case(optimizer=lambda m: RowNormSGD(_trained(m)), steps=STEPS)
# whole parameters with parameters unused on some steps, and tied ones
OPTIMIZER_CASES["optim_Adafactor_unused"] = Case(model={"unused": True}, optimizer=TORCH_OPTIMIZERS["Adafactor"],
                                                 steps=STEPS)
OPTIMIZER_CASES["optim_row_norm_tied"] = Case(model={"tied": True}, optimizer=lambda m: RowNormSGD(_trained(m)),
                                              steps=STEPS)
# Muon's whole matrices and AdamW's flat shards beside a frozen parameter (stage 3's frozen group, never whole)
OPTIMIZER_CASES["optim_Muon_frozen"] = Case(model={"frozen": True}, optimizer=muon_and_adamw, steps=STEPS)
# A case named with LONG after it trains STEPS steps: the low-precision runs, whose tolerance (bf16 4e-3) must
# stay below the ~1e-3 a step of AdamW moves a weight, times the steps (3 steps would let an untrained master
# pass).
LONG = "_long"
WHOLE_PARAMETER_CASES = {f"optim_{n}" for n in WHOLE_PARAMETER_OPTIMIZERS} | {
    "optim_row_norm", "optim_Adafactor_unused", "optim_row_norm_tied", "optim_Muon_frozen"}


def case_named(name: str) -> Case:
    if name.endswith(LONG):
        return replace(case_named(name.removesuffix(LONG)), steps=STEPS)
    return CASES[name] if name in CASES else OPTIMIZER_CASES[name]


def batches(world: int, gas: int, seed: int = 0, steps: int = STEPS):
    """steps x gas micro-batches of world*MICRO samples; large targets keep clipping active."""
    g = torch.Generator().manual_seed(seed)
    n = world * MICRO
    return [[(torch.randn(n, D_IN, generator=g), 5 * torch.randn(n, D_OUT, generator=g)) for _ in range(gas)]
            for _ in range(steps)]


def build(case: Case, seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy(**case.model)


def config_for(case: Case, stage: int, world: int, dtype: str = "fp32", offload: bool = False,
               top: dict | None = None, **zero) -> dict:
    """top: top-level sections beside zero_optimization (the disk tier's aio)."""
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if zero.get("offload_param") is True:  # a job's keys must be hashable: True stands for the section
        zero["offload_param"] = {"device": "cpu"}
    if stage == 3:  # gather and release every module, unless a test asks for persistence
        zero.setdefault("stage3_param_persistence_threshold", 0)
    low = {k: zero.pop(k) for k in [k for k in zero if k.startswith("bf16_")]}  # the bf16 section's optimizer keys
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": case.gas,
           "gradient_clipping": case.clip,
           "zero_optimization": {"stage": stage, **case.config, **zero}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True, **low}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return {**cfg, **(top or {})}


def train_engine(rank: int, world: int, name: str, stage: int, dtype: str = "fp32", offload: bool = False,
                 seed: int = 0, meta: bool = False, top: dict | None = None, **zero) -> dict:
    """Train one case on this rank; returns the gathered fp32 weights and the step norms. meta: the model
    is built on the meta device, each rank's random state seeded differently (rank 0's must be used)."""
    case = case_named(name)
    model = build(case, seed=seed + rank)  # different init per rank: the engine must broadcast rank 0's
    if meta:
        torch.manual_seed(seed + rank)
        with torch.device("meta"):
            model = Toy(**case.model)
    elif rank != 0:
        torch.manual_seed(seed)
        model = build(case, seed=seed)
        with torch.no_grad():  # then perturb, so a missing broadcast cannot go unnoticed
            for p in model.parameters():
                p.add_(0.5)
    engine = zerodp.initialize(model, case.optimizer(model), config_for(case, stage, world, dtype, offload, top,
                                                                          **zero))
    norms = []
    for step, micro in enumerate(batches(world, case.gas, seed, case.steps)):
        model.use_sometimes = step % 2 == 1
        for x, y in micro:
            sl = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(engine(x[sl], y[sl]))
            engine.step()
        norms.append(engine.grad_norm)
    with engine.gathered_parameters():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"state": engine.full_state_dict(), "norms": norms, "steps": engine.global_steps, "params": params,
            "memory": engine.memory_report()}


def train_reference(name: str, world: int, seed: int = 0, step_unused: bool = False) -> dict:
    """Plain PyTorch, one process, the full batch of all ranks and micro-steps at once. A parameter
    with no gradient is not stepped, as in PyTorch; `step_unused` gives it a zero gradient instead
    (DeepSpeed's behaviour, zero_optimization.step_unused_parameters)."""
    case = case_named(name)
    model = build(case, seed=seed)
    opts = case.optimizer(model)
    opts = opts if isinstance(opts, list) else [opts]  # Muon + AdamW: each steps its own parameters
    norms = []
    for step, micro in enumerate(batches(world, case.gas, seed, case.steps)):
        model.use_sometimes = step % 2 == 1
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        model(x, y).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params if step_unused else ():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if case.clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, case.clip)))
        else:
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"state": {k: v.float() for k, v in model.state_dict().items()}, "norms": norms}


def run_all(rank: int, world: int, jobs: list[tuple]) -> dict:
    """Many engine runs in one set of ranks, so spawning costs once per world size."""
    return {job: train_engine(rank, world, *job) for job in jobs}


def train_overflow(rank: int, world: int, stage: int) -> dict:
    """fp16 with an inf injected on the last rank at step 2: that step must be skipped everywhere."""
    case = CASES["plain"]
    model = build(case)
    cfg = config_for(Case(gas=1), stage, world, "fp16")
    cfg["fp16"].update(hysteresis=1, loss_scale_window=2)
    engine = zerodp.initialize(model, case.optimizer(model), cfg)
    record = []
    for step, micro in enumerate(batches(world, 1)):
        x, y = micro[0]
        x = x[rank * MICRO:(rank + 1) * MICRO].clone()
        if step == 2 and rank == world - 1:
            x[0, 0] = float("inf")
        engine.backward(engine(x, y[rank * MICRO:(rank + 1) * MICRO]))
        engine.step()
        with engine.gathered_parameters():
            working = [p.detach().clone() for p in model.parameters()]
        record.append({
            "scale": engine.loss_scale, "skipped": engine.skipped_steps, "steps": engine.global_steps,
            "master": [m.clone() for m in inside(engine).training.partitioned_optimizer.masters],
            "working": working,
            "state": [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()],
        })
    return record


def frozen_bytes(rank: int, world: int) -> dict:
    """memory_report of the frozen case at stage 3 (without, with offload_param): what the frozen
    weight costs this rank, and what is held whole (buffers and nothing else: the toy has no buffer)."""
    out = {}
    for offload in (False, True):
        case = CASES["frozen"]
        model = build(case)
        zero = {"offload_param": True} if offload else {}
        engine = zerodp.initialize(model, case.optimizer(model), config_for(case, 3, world, **zero))
        report = engine.memory_report()
        out[offload] = {"frozen_params": report["frozen_params"], "working_params": report["working_params"],
                        "whole": report["frozen_params_and_buffers"], "host": report.get("host_model_states"),
                        "whole_without_frozen": sum(b.numel() * b.element_size() for b in model.buffers()),
                        "shape": tuple(model.inp.weight.shape)}
    return out


def stage3_releases(rank: int, world: int) -> dict:
    """After a stage-3 step nothing but persistent buckets holds gathered parameters."""
    case = CASES["tied"]
    model = build(case)
    engine = zerodp.initialize(model, case.optimizer(model), config_for(case, 3, world))
    x, y = batches(world, 1)[0][0]
    engine.backward(engine(x[:MICRO], y[:MICRO]))
    engine.step()
    held = sum(b.data.untyped_storage().nbytes() for g in inside(engine).layout.groups for b in g.buckets)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    with engine.gathered_parameters():
        whole = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    owned = sum(g.data.numel() for g in inside(engine).layout.groups)
    total = sum(b.numel for g in inside(engine).layout.groups for b in g.buckets)
    return {"held": held, "shapes": shapes, "whole": whole, "owned": owned, "total": total}


def mismatched_models(rank: int, world: int) -> str:
    """Rank 1 wraps a wider model than rank 0: every rank must get the same clear error."""
    model = Toy(hidden=37 if rank == 0 else 38)
    try:
        zerodp.initialize(model, one_group(model), config_for(Case(), 2, world))
    except ValueError as e:
        return str(e)
    return "no error"


def refused_optimizer(rank: int, world: int, name: str) -> str:
    """initialize with an optimizer zerodp refuses: every rank must raise, naming it, before any collective."""
    model = build(Case())
    params = _trained(model)
    optimizer = torch.optim.LBFGS(params) if name == "LBFGS" else getattr(torch.optim, name)(params)
    try:
        zerodp.initialize(model, optimizer, config_for(Case(), 2, world))
    except ValueError as e:
        return str(e)
    return "no error"
