"""torch.compile of the user's model: compiled runs match the eager single-process oracle, and compile
once. The model is compiled the ways a user does it: `model.compile()` (in place) or `torch.compile(model)`
(a wrapper) before `zerodp.initialize`, `model.compile()` after it, or every block on its own (what
`zerodp bench --compile` does). "aot_eager" runs dynamo, AOTAutograd and zerodp's hooks without code
generation; one inductor run checks the generated kernels too. Stage 3's gather hooks stay out of the
graph (torch.compiler.disable in sharding/gather.py), so its forward is compiled in pieces between modules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import oracle
import zerodp
from spawn import run_ranks

GAS, CLIP = 2, 1.0
WAYS = ["model.compile", "torch.compile", "blocks", "after_initialize"]


class Block(nn.Module):
    """A residual block of user code. Per-block compile needs one: dynamo skips torch.nn's own
    modules (nn.Linear.compile() compiles nothing)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h):
        return self.norm(h + torch.tanh(self.lin(h)))


class Stack(nn.Module):
    """Embedding, blocks, head: a transformer's outline at the oracle's sizes (37: no world divides it)."""

    def __init__(self, hidden: int = 37, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(oracle.D_IN, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, oracle.D_OUT)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.out(h), y)


def build() -> Stack:
    torch.manual_seed(0)
    return Stack()


@dataclass(frozen=True)
class Job:
    stage: int
    way: str = "model.compile"
    backend: str = "aot_eager"
    overlap_param_gather: bool = False


def train_compiled(rank: int, world: int, job: Job) -> dict:
    """One engine run on a compiled model: its fp32 weights and the compiled-frame count after each step."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # each job compiles afresh: no cache entries (or recompile limit) carried over
    counter = CompileCounterWithBackend(job.backend)
    model = build()
    wrapped = model
    if job.way == "model.compile":
        model.compile(backend=counter)
    elif job.way == "torch.compile":
        wrapped = torch.compile(model, backend=counter)  # an OptimizedModule around `model`
    elif job.way == "blocks":
        for block in model.blocks:
            block.compile(backend=counter)
    zero = {"overlap_param_gather": True} if job.overlap_param_gather else {}
    cfg = oracle.config_for(oracle.Case(gas=GAS, clip=CLIP), job.stage, world, **zero)
    try:
        engine = zerodp.initialize(wrapped, oracle.one_group(model), cfg)
        if job.way == "after_initialize":
            model.compile(backend=counter)
        frames = []
        for micro in oracle.batches(world, GAS):
            for x, y in micro:
                sl = slice(rank * oracle.MICRO, (rank + 1) * oracle.MICRO)
                engine.backward(engine(x[sl], y[sl]))
                engine.step()
            frames.append(counter.frame_count)
        state = engine.full_state_dict()
    except RuntimeError as e:  # reported to the test, so one failing job does not hide the others
        return {"error": str(e)}
    # A wrapper's state dict names the model's weights "_orig_mod.<name>", as torch's own does.
    return {"state": {k.removeprefix("_orig_mod."): v for k, v in state.items()}, "frames": frames}


def _run_jobs(rank: int, world: int, jobs: list[Job]) -> dict:
    return {job: train_compiled(rank, world, job) for job in jobs}


# The ways of compiling are crossed with stage 2; stages 0-2 run compiled in place. Stage 3 runs on
# 2 ranks, where its gathers are real collectives.
JOBS = {1: [Job(0), Job(1), Job(2)] + [Job(2, w) for w in WAYS[1:]] + [Job(2, "model.compile", "inductor")],
        2: [Job(0), Job(1), Job(2), Job(2, "blocks"), Job(2, overlap_param_gather=True), Job(3), Job(3, "blocks")]}


@functools.cache
def _warm_up() -> None:
    """One compile here, before any rank forks: dynamo's and AOTAutograd's first compile in a process costs
    ~6 CPU s of imports and set-up (sympy, trace rules), which each of the 3 forked ranks paid again before;
    and the engine's modules, which zerodp.initialize imports on first use. Nothing of it is compiled code the
    ranks reuse: each job starts with torch._dynamo.reset()."""
    import zerodp.engine.engine  # noqa: F401
    block = Block(4)
    torch.compile(block, backend="aot_eager")(torch.randn(2, 4, requires_grad=True)).sum().backward()
    torch._dynamo.reset()


@functools.cache
def runs(world: int) -> dict:
    """Every compiled run of one world size, in one set of forked ranks (starting ranks is the slow part)."""
    _warm_up()
    return run_ranks(_run_jobs, world, JOBS[world])[0]


@functools.cache
def reference(world: int) -> dict[str, torch.Tensor]:
    """Plain eager PyTorch, one process, the whole batch of all ranks and micro-steps at once."""
    model = build()
    opt = oracle.one_group(model)
    for micro in oracle.batches(world, GAS):
        model(torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.float() for k, v in model.state_dict().items()}


def compiled_run(world: int, job: Job) -> dict:
    run = runs(world)[job]
    assert "error" not in run, run["error"]
    return run


def assert_matches_reference(run: dict, world: int) -> None:
    ref = reference(world)
    assert run["state"].keys() == ref.keys()
    for k in ref:
        # aot_eager runs the same aten ops as eager. Inductor's fused C++ kernels (layer norm, tanh,
        # the loss) sum in another order: a few ulp per gradient, measured 3e-8 after 5 AdamW steps.
        torch.testing.assert_close(run["state"][k], ref[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _ids(job: Job) -> str:
    extra = "-overlap_param_gather" if job.overlap_param_gather else ""
    return f"stage={job.stage}-{job.way}-{job.backend}{extra}"


@pytest.mark.parametrize("job", [j for j in JOBS[1] if j.backend == "aot_eager"], ids=_ids)
def test_compiled_matches_single_process_fp32_world1(job):
    assert_matches_reference(compiled_run(1, job), 1)


@pytest.mark.parametrize("job", JOBS[2], ids=_ids)
def test_compiled_matches_single_process_fp32_world2(job):
    assert_matches_reference(compiled_run(2, job), 2)


def test_inductor_stage2_matches_single_process_fp32():
    assert_matches_reference(compiled_run(1, Job(2, "model.compile", "inductor")), 1)


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world={w}")
def test_compiles_in_the_first_step_only(world):
    """Re-pointing parameters into flat buckets, the gradient hooks and the step never recompile."""
    for job, run in runs(world).items():
        if "error" in run:
            continue  # reported by the oracle tests
        frames = run["frames"]
        assert frames[0] > 0, f"{job}: nothing was compiled"
        if job.overlap_param_gather:
            # its wait hooks are registered after the first forward, and dynamo traces them
            # (guarding on their state): one recompile in step 2, then none
            frames = frames[1:]
        assert frames == [frames[0]] * len(frames), f"{job}: recompiled after the first step: {frames}"
        if job.stage < 3 and job.way != "blocks" and not job.overlap_param_gather:
            # the whole forward is one graph: nothing of zerodp's runs inside it to break it
            assert frames[0] == 1, f"{job}: {frames[0]} graphs"
