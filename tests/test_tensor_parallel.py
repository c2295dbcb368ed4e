"""ZeRO over the data-parallel dimension of a tensor-parallel model (torch's parallelize_module, DTensor
parameters): the oracle is one process training the whole model on the whole batch.

One 4-rank launch runs every check (the suite's budget): (dp 2, tp 2) at stages 1, 2 and 3 ((dp 4, tp 1)
and (dp 1, tp 4) at stage 2 with tp_titan's model, test_tp_titan.py), the same model split by hand the Megatron way and given with an `mpu` (both
initializes, both spellings), and the set-up errors. Each rank also trains the reference itself (the
model is tiny), so no result needs to travel between ranks.
"""

from __future__ import annotations

import atexit
import functools
import math
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tp_export
import tp_offload
import tp_titan
import tp_train
import zerodp
from zerodp.engine.engine import inside
import zerodp.deepspeed as zds
from spawn import run_ranks

# 3 steps: still several (AdamW's state and momentum carried across steps, a skipped step between two taken)
# at 3/5 of the launch's time for its ~20 runs.
D, HEAD_DIM, D_IN, D_OUT, SEQ, BATCH, STEPS, LR, CLIP = 16, 4, 6, 5, 3, 4, 3, 1e-3, 0.05
TOL = 2e-5


class Attention(nn.Module):
    """Heads split across tp ranks: q/k/v column-parallel (each rank its heads), out row-parallel."""

    def __init__(self):
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(D, D) for _ in range(3))
        # No key bias: softmax is invariant to it, so its gradient is rounding noise, which AdamW's
        # normalised step would turn into updates of size lr on both sides of the comparison.
        self.k = nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Net(nn.Module):
    """A pre-norm transformer stack: the input projection, the final norm and the head are replicated."""

    def __init__(self, sometimes: bool = False):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, D_OUT)
        if sometimes:  # a tensor-parallel pair that only odd steps use: no gradient, no step on the others
            self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.use_sometimes = False

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        if self.use_sometimes:
            h = h + self.down(torch.tanh(self.up(h)))
        return F.mse_loss(self.head(self.norm(h)), y)


def plan(sometimes: bool = False) -> dict:
    out = {"up": ColwiseParallel(), "down": RowwiseParallel()} if sometimes else {}
    for i in range(2):
        out.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in "qkv"})
        out.update({f"blocks.{i}.attn.o": RowwiseParallel(), f"blocks.{i}.fc1": ColwiseParallel(),
                    f"blocks.{i}.fc2": RowwiseParallel()})
    return out


def build(sometimes: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(sometimes)


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, D_IN, generator=g), torch.randn(BATCH, SEQ, D_OUT, generator=g)


def optimizer(model: nn.Module, sgd: bool = False) -> torch.optim.Optimizer:
    # AdamW's step is blind to a gradient's scale; SGD's is linear in it, so it checks the scale too.
    if sgd:
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def muon_and_adamw(model: nn.Module, muon=tp_titan.Fp32Muon) -> list[torch.optim.Optimizer]:
    """A shape-aware optimizer on the blocks' matrices (Megatron shards: each stepped whole, gathered over tp
    along its partition_dim) and AdamW on the rest, as a list of two."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n.startswith("blocks."))]
    return [muon(hidden, lr=10 * LR), torch.optim.AdamW(rest, lr=LR, weight_decay=0.1)]


def reference(sgd: bool = False, sometimes: bool = False, skip: int | None = None, muon: bool = False) -> dict:
    """One process, the whole model, the whole batch: plain AdamW (or SGD, or muon_and_adamw) and
    clip_grad_norm_; no update at step `skip`."""
    model = build(sometimes)
    opt = tp_titan.Together(muon_and_adamw(model)) if muon else optimizer(model, sgd)
    losses, norms = [], []
    for step in range(STEPS):
        model.use_sometimes = sometimes and step % 2 == 1
        loss = model(*data(step))
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if step != skip:
            opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def config(stage: int, dp: int, bf16: bool = False, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // dp, "gradient_clipping": CLIP, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, **zero}}


def train(mesh: DeviceMesh, stage: int, sgd: bool = False, sometimes: bool = False,
          poison: int | None = None, make=build, weights=None, bf16: bool = False, **zero) -> dict:
    """(dp, tp) training: world-mean losses, the engine's norms, whole weights, and checks of its state."""
    names = mesh.mesh_dim_names
    dp_dims = [n for n in names if n != "tp"]
    dp = mesh[tuple(dp_dims)].size() if len(dp_dims) > 1 else mesh[dp_dims[0]].size()
    model = make(sometimes)
    if "tp" in names:
        parallelize_module(model, mesh["tp"], plan(sometimes))
    engine = zerodp.initialize(model, optimizer(model, sgd), config(stage, dp, bf16, **zero), device_mesh=mesh,
                               weights=weights and weights(model))
    dp_rank = functools.reduce(lambda r, n: r * mesh.size(names.index(n)) + mesh.get_local_rank(n), dp_dims, 0)
    lo = dp_rank * (BATCH // dp)
    losses, norms, at = [], [], [0]
    if poison is not None and dist.get_rank() == 1:  # a nan in one tp shard's gradient, on one rank only
        model.blocks[0].fc1.weight.register_hook(lambda g: g * float("nan") if at[0] == poison else g)
    for step in range(STEPS):
        at[0] = step
        model.use_sometimes = sometimes and step % 2 == 1
        x, y = (t[lo:lo + BATCH // dp] for t in data(step))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # tp ranks of one dp rank hold the same loss: the world mean is the dp mean
        losses.append(float(mean) / dist.get_world_size())
        norms.append(engine.grad_norm)
    with engine.gathered_parameters():
        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()).float()
                   for n, p in model.named_parameters()}
    kinds = {n: type(p).__name__ for n, p in model.named_parameters()}
    out = {"losses": losses, "norms": norms, "weights": weights, "kinds": kinds, "skipped": engine.skipped_steps}
    if stage == 3:  # module.state_dict() gathers over dp: each DTensor entry joined over tp is whole
        out["state_dict"] = {n: t.full_tensor() if isinstance(t, DTensor) else t
                             for n, t in model.state_dict().items()}
    out["export"] = tp_export.exported(engine)
    out["offloaded"] = (inside(engine).training.partitioned_optimizer.host is not None, inside(engine).spec.offload_param)
    return out


def error_text(call) -> str:
    """'Type: message' of what call() raised, or "no error" (the tp tests read every rank's text)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads its text
        return f"{type(e).__name__}: {e}"
    return "no error"


def set_up_error(model: nn.Module, mesh, stage: int = 2, **zero) -> str:
    return error_text(lambda: zerodp.initialize(model, optimizer(model), config(stage, 2, **zero), device_mesh=mesh))


def bad_inputs(mesh: DeviceMesh) -> dict:
    out = {}
    tp_model = build()
    parallelize_module(tp_model, mesh["tp"], plan())
    out["no mesh"] = set_up_error(tp_model, None)
    other = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    out["other mesh"] = set_up_error(tp_model, init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp")))
    wrong = build()
    parallelize_module(wrong, other["tp"], plan())
    out["model on another mesh"] = set_up_error(wrong, mesh)
    out["sizes"] = set_up_error(build(), DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("dp", "tp")))
    out["names"] = set_up_error(build(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tp")))
    out["nothing split"] = set_up_error(build(), mesh)  # a tp mesh, the model never parallelized
    out["stage 0"] = set_up_error(tp_model, mesh, stage=0)
    # Muon steps each tp-sharded matrix whole, gathered over tp (test_tp_titan.py): a matrix whose tp shards are
    # of unequal sizes (5 rows over 2 ranks) cannot be, and is refused rather than orthogonalised as pieces
    uneven = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 4))
    parallelize_module(uneven, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    out["muon on uneven tp shards"] = error_text(lambda: zerodp.initialize(
        uneven, [torch.optim.Muon([uneven[0].weight, uneven[1].weight], lr=LR),
                 torch.optim.AdamW([uneven[0].bias, uneven[1].bias], lr=LR)], config(2, 2), device_mesh=mesh))
    return out


# ---- Megatron-style: plain local shards, marked, and an mpu ------------------------------------------

class _CopyToTp(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input's gradient over the tp group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTp(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the tp group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class SplitLinear(nn.Module):
    """One tp rank's part of a whole nn.Linear, cut by hand: column-parallel (rows of the weight, and of the
    bias) or row-parallel (columns of the weight; the bias whole, replicated, added after the sum)."""

    def __init__(self, whole: nn.Linear, column: bool, group, marking: str):
        super().__init__()
        self.column, self.group = column, group
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        dim = 0 if column else 1
        self.weight = nn.Parameter(whole.weight.detach().chunk(tp, dim)[r].clone())
        setattr(self.weight, marking, True)
        if marking == "tensor_model_parallel":  # Megatron says along which dimension; DeepSpeed's marking does not
            self.weight.partition_dim = dim
        self.bias = None
        if whole.bias is not None:
            self.bias = nn.Parameter(whole.bias.detach().chunk(tp)[r].clone() if column else whole.bias.detach().clone())
            if column:
                setattr(self.bias, marking, True)
                self.bias.partition_dim = 0

    def forward(self, x):
        if self.column:
            return F.linear(_CopyToTp.apply(x, self.group), self.weight, self.bias)
        out = _ReduceFromTp.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias

    def whole(self) -> dict:
        """The whole weight and bias, joined over the tp group (the model's original names' values)."""
        out = {}
        for name, p in (("weight", self.weight), ("bias", self.bias)):
            if p is None:
                continue
            if getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False):
                parts = [torch.empty_like(p) for _ in range(dist.get_world_size(self.group))]
                dist.all_gather(parts, p.detach().contiguous(), group=self.group)
                out[name] = torch.cat(parts, 0 if self.column else 1)
            else:
                out[name] = p.detach().clone()
        return out


def split_by_hand(model: Net, group, marking: str) -> Net:
    for block in model.blocks:
        for n in "qkvo":
            setattr(block.attn, n, SplitLinear(getattr(block.attn, n), n != "o", group, marking))
        block.fc1 = SplitLinear(block.fc1, True, group, marking)
        block.fc2 = SplitLinear(block.fc2, False, group, marking)
    return model


class ParallelState:
    """Megatron parallel_state's spelling of an mpu."""

    def __init__(self, dp, tp):
        self.dp, self.tp = dp, tp

    def get_data_parallel_group(self):
        return self.dp

    def get_tensor_model_parallel_group(self):
        return self.tp


class DeepSpeedMpu:
    """DeepSpeed's older spelling: the tensor-parallel group is the "model-parallel" one."""

    def __init__(self, dp, tp):
        self.dp, self.tp = dp, tp

    def get_data_parallel_group(self):
        return self.dp

    def get_model_parallel_group(self):
        return self.tp


def train_mpu(mesh: DeviceMesh, deepspeed: bool, muon: bool = False, **zero) -> dict:
    """(dp 2, tp 2) at stage 2, the model split by hand and given with an mpu (DeepSpeed's spelling and
    marking through zerodp.deepspeed.initialize, else Megatron's through zerodp.initialize); AdamW, or
    muon_and_adamw."""
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    marking = "model_parallel" if deepspeed else "tensor_model_parallel"
    model = split_by_hand(build(), tp_group, marking)
    opt, cfg = muon_and_adamw(model) if muon else optimizer(model), config(2, 2, **zero)
    if deepspeed:
        engine, *_ = zds.initialize(model=model, optimizer=opt, config=cfg,
                                    mpu=DeepSpeedMpu(dp_group, tp_group))
    else:
        engine = zerodp.initialize(model, opt, cfg, mpu=ParallelState(dp_group, tp_group))
    lo = mesh.get_local_rank("dp") * (BATCH // 2)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = (t[lo:lo + BATCH // 2] for t in data(step))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        norms.append(engine.grad_norm)
    weights = {}
    with engine.gathered_parameters():
        for name, module in model.named_modules():
            if isinstance(module, SplitLinear):
                weights.update({f"{name}.{k}": v for k, v in module.whole().items()})
        weights.update({n: p.detach().clone() for n, p in model.named_parameters() if n not in weights})
    return {"losses": losses, "norms": norms, "weights": weights, "kinds": {"Parameter": "Parameter"},
            "skipped": engine.skipped_steps, "export": tp_export.exported(engine),
            "offloaded": (inside(engine).training.partitioned_optimizer.host is not None, inside(engine).spec.offload_param)}


def bad_mpu(mesh: DeviceMesh) -> dict:
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")

    whole = build()  # not split: nothing marked as a tp shard

    def init(mpu, stage=2, zero=None, **kw):
        model = split_by_hand(build(), tp_group, "tensor_model_parallel")
        return lambda: zerodp.initialize(model, optimizer(model), config(stage, 2, **(zero or {})), mpu=mpu, **kw)
    return {"mpu sizes": error_text(init(ParallelState(dist.group.WORLD, tp_group))),
            "mpu and mesh": error_text(init(ParallelState(dp_group, tp_group), device_mesh=mesh)),
            "mpu lacks groups": error_text(init(object())),
            "mpu stage 0": error_text(init(ParallelState(dp_group, tp_group), stage=0)),
            "mpu hierarchical": error_text(init(ParallelState(dp_group, tp_group), zero={"mics_shard_size": 1})),
            "mpu nothing marked": error_text(lambda: zerodp.initialize(whole, optimizer(whole), config(2, 2),
                                                                  mpu=ParallelState(dp_group, tp_group))),
            "mpu muon on shards of unknown axis": error_text(lambda: _muon_on(
                split_by_hand(build(), tp_group, "model_parallel"), DeepSpeedMpu(dp_group, tp_group)))}


def _muon_on(model: nn.Module, mpu) -> None:
    """zerodp.initialize with torch's Muon on the hidden matrices (DeepSpeed's marking: no partition_dim), AdamW
    on the rest."""
    zerodp.initialize(model, muon_and_adamw(model, torch.optim.Muon), config(2, 2), mpu=mpu)


def _ranks(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {"reference": reference(), "reference sgd": reference(sgd=True), "bad": bad_inputs(mesh),
           "bad mpu": bad_mpu(mesh)}
    out["gpt"] = tp_train.gpt_oracle(mesh)  # zerodp's GPT and its tp plan: test_train_tp.py
    out["mpu dp2 tp2 stage 2"] = train_mpu(mesh, deepspeed=False)
    out["deepspeed mpu dp2 tp2 stage 2"] = train_mpu(mesh, deepspeed=True)
    out["reference muon"], out["mpu dp2 tp2 stage 2 muon"] = reference(muon=True), train_mpu(mesh, False, muon=True)
    for stage in (1, 2, 3):
        out[f"dp2 tp2 stage {stage}"] = train(mesh, stage)
    out["dp2 tp2 stage 2 sgd"] = train(mesh, 2, sgd=True)
    out.update(tp_offload.runs(mesh))
    out["reference sometimes"] = reference(sometimes=True)
    out["dp2 tp2 stage 2 sometimes"] = train(mesh, 2, sometimes=True)
    out["reference skip"] = reference(skip=SKIP)
    out["dp2 tp2 stage 2 skip"] = train(mesh, 2, poison=SKIP)
    # Hierarchical sharding by name: with tp (2 copies of 1 shard: replica and tp weights together), without
    hier = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    out["dp_replicate2 dp_shard1 tp2 stage 2"] = train(hier, 2)
    hier = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    out["dp_replicate2 dp_shard2 stage 3"] = train(hier, 3)
    # (dp 4, tp 1) and (dp 1, tp 4) at stage 2: tp_titan.runs trains them (test_tp_titan.py, the same code path)
    out.update(tp_export.checks(mesh))
    import tp_ckpt  # here: it imports this module's model and training helpers

    out["dp2 tp2 stage 2 bf16"] = train(mesh, 2, bf16=True)
    out["tp ckpt"] = tp_ckpt.saves(mesh)  # test_tp_ckpt.py's checkpoints
    out["titan"] = tp_titan.runs(mesh)  # test_tp_titan.py: torchtitan's plan, sequence and loss parallel
    tp_titan.save(mesh, out["tp ckpt"]["dir"])
    out["titan"]["hf own mesh"] = tp_titan.hf_own_mesh(mesh)  # last: transformers' own set-up of a mesh
    return out


@functools.lru_cache(maxsize=1)
def _results() -> list[dict]:
    out = run_ranks(_ranks, 4, timeout_s=120)
    atexit.register(shutil.rmtree, out[0]["tp ckpt"]["dir"], ignore_errors=True)  # test_tp_ckpt.py reads them
    return out


SKIP = 1  # the poisoned step: one taken before it, one after

RUNS = ["dp2 tp2 stage 1", "dp2 tp2 stage 2", "dp2 tp2 stage 3",
        "dp2 tp2 stage 2 sgd", *tp_offload.RUNS, "dp2 tp2 stage 2 sometimes", "dp2 tp2 stage 2 skip",
        "dp_replicate2 dp_shard1 tp2 stage 2", "dp_replicate2 dp_shard2 stage 3",
        "mpu dp2 tp2 stage 2", "deepspeed mpu dp2 tp2 stage 2", "mpu dp2 tp2 stage 2 muon"]


def _reference(run: str) -> str:
    return next((f"reference {k}" for k in ("sgd", "sometimes", "skip", "muon") if run.endswith(k)), "reference")


@pytest.mark.parametrize("run", RUNS)
def test_tp_x_dp_matches_one_process_on_the_whole_batch(run):
    for rank, result in enumerate(_results()):
        ref, got = result[_reference(run)], result[run]
        assert min(ref["norms"]) > CLIP  # clipping binds on every step
        assert got["losses"] == pytest.approx(ref["losses"], abs=TOL, rel=TOL), (run, rank)
        diffs = sorted(((got["weights"][n] - w).abs().max().item(), n) for n, w in ref["weights"].items())
        worst = diffs[-1][0]
        print(f"{run} rank {rank}: largest weight difference {worst:.2e}, loss difference "
              f"{max(abs(a - b) for a, b in zip(got['losses'], ref['losses'])):.2e}")
        for name, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, atol=TOL, rtol=TOL, msg=f"{run} rank {rank} {name}")
        if "state_dict" in got:
            for name, w in ref["weights"].items():
                torch.testing.assert_close(got["state_dict"][name], w, atol=TOL, rtol=TOL, msg=f"{run} state_dict")


def test_bf16_tp_x_dp_is_within_bf16_noise_of_one_fp32_process():
    # bf16 weights and gradients, fp32 masters: each step's gradient carries bf16 rounding (~0.4%), so the
    # losses and norms agree to about that, and each fp32 master's update (~lr per element and step) to a
    # few percent (measured: at most 8% of its norm, AdamW turning the rounding of near-zero gradients into
    # whole steps). The bf16 weights themselves are rounded further than a norm weight moves in STEPS steps.
    init = build_weights()
    for rank, result in enumerate(_results()):
        ref, got = result["reference"], result["dp2 tp2 stage 2 bf16"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-2), rank
        assert got["norms"] == pytest.approx(ref["norms"], rel=2e-2), rank
        for name, w in ref["weights"].items():
            moved, off = (w - init[name]).norm(), (got["export"]["full"][name] - w).norm()
            assert off < 0.15 * moved, (rank, name, float(off / moved))


@functools.lru_cache(maxsize=1)
def build_weights() -> dict:
    return {n: p.detach().clone() for n, p in build().named_parameters()}


@pytest.mark.parametrize("run", RUNS)
def test_global_norm_counts_tp_shards_once_and_replicated_parameters_once(run):
    # Replicate DTensors (row-parallel biases) and plain parameters (norms, input and head) are held alike
    # by every tp rank: counted once per tp rank, the norm would exceed clip_grad_norm_'s.
    result = _results()[0]
    kinds = set(result[run]["kinds"].values())
    assert kinds == ({"DTensor", "Parameter"} if "tp" in run and "mpu" not in run else {"Parameter"}), kinds
    for r in _results():
        ref, norms = r[_reference(run)], r[run]["norms"]
        if run.endswith("skip"):  # the poisoned step's norm is nan on every rank of the world, and skipped
            assert math.isnan(norms[SKIP]) and r[run]["skipped"] == 1, (norms, r[run]["skipped"])
            norms, ref = norms[:SKIP] + norms[SKIP + 1:], {"norms": ref["norms"][:SKIP] + ref["norms"][SKIP + 1:]}
        assert norms == pytest.approx(ref["norms"], rel=1e-5), run


def test_tp_setup_errors_on_every_rank_before_any_collective():
    for rank, result in enumerate(_results()):
        bad = result["bad"]
        assert "is a DTensor" in bad["no mesh"] and "no device_mesh with a 'tp' dimension" in bad["no mesh"], rank
        assert "is a DTensor on mesh" in bad["other mesh"], bad["other mesh"]
        assert "is a DTensor on mesh" in bad["model on another mesh"], bad["model on another mesh"]
        assert "must multiply to the world size" in bad["sizes"], bad["sizes"]
        assert "do not name the roles" in bad["names"], bad["names"]
        nothing = bad["nothing split"]
        assert "has 2 ranks, but no parameter of the model is split over it" in nothing, nothing
        assert "stage 0" in bad["stage 0"], bad["stage 0"]
        muon = bad["muon on uneven tp shards"]  # a tp shard is never stepped as if it were the matrix
        assert muon.startswith("ValueError: optimizer Muon steps whole parameters") and \
            "'0.weight' is split over tp along dimension 0 of size 5, which is not divisible by the tp size 2" in muon, muon


def test_mpu_setup_errors_on_every_rank_before_any_collective():
    for rank, result in enumerate(_results()):
        bad = result["bad mpu"]
        assert "dp x tp must be the world" in bad["mpu sizes"] and "has 4 ranks" in bad["mpu sizes"], bad
        assert "not both" in bad["mpu and mesh"], bad["mpu and mesh"]
        assert "get_data_parallel_group()" in bad["mpu lacks groups"], bad["mpu lacks groups"]
        assert "stage 0" in bad["mpu stage 0"], bad["mpu stage 0"]
        assert "shard size 1 of 2" in bad["mpu hierarchical"], bad["mpu hierarchical"]
        assert "the mpu's tensor-parallel group has 2 ranks, but no parameter" in bad["mpu nothing marked"], bad
        muon = bad["mpu muon on shards of unknown axis"]  # whole matrices cannot be joined: refused, not pieces
        assert muon.startswith("ValueError: optimizer Muon steps whole parameters") and \
            "'blocks.0.attn.q.weight'" in muon and "partition_dim is None" in muon, muon


