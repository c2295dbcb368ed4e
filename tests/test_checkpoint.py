"""Checkpoints: resume on other world sizes and stages exactly, atomic saves, consolidation, errors.

Two sets of spawned gloo ranks (4, then 2) do the distributed runs and a world of one runs in this
process; one more pair of ranks is SIGKILLed in the middle of a save. Every run trains on the same global batch of 12 samples per step however it is split
(world x gradient accumulation = 4), so a resumed run must continue exactly like an uninterrupted one.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import oracle
import zerodp
from zerodp.engine.engine import inside
from spawn import run_ranks
from zerodp import checkpoint as ck
from zerodp.checkpoint import files as ck_files

MICRO, GLOBAL, SAVE_AT, STEPS = 3, 12, 2, 5


# ---- one training run, on any world size -------------------------------------------------------
def config(world: int, stage: int, dtype: str = "fp32", offload: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL // MICRO // world,
           "gradient_clipping": 1.0, "seed": 5,
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu" if offload else "none"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear",
                                                         "warmup_max_lr": 1e-2}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        # window 1: the scale doubles after each clean step (DeepSpeed's count), so it has moved by SAVE_AT
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1}
    return cfg


def global_batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL, oracle.D_IN, generator=g), 5 * torch.randn(GLOBAL, oracle.D_OUT, generator=g))
            for _ in range(steps)]


class WithExtra(oracle.Toy):
    """The toy model plus one parameter: a different model."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.extra = nn.Parameter(torch.zeros(3))

    def forward(self, x, y):
        return super().forward(x, y) + self.extra.sum()


def make_engine(world: int, stage: int, dtype: str = "fp32", seed: int = 0, model_kw: dict | None = None,
                offload: bool = False, optimizer: str | None = None):
    """optimizer: a name of oracle.TORCH_OPTIMIZERS (default: AdamW in two groups)."""
    torch.manual_seed(seed)
    kw = dict(model_kw or {})
    model = (WithExtra if kw.pop("extra", False) else oracle.Toy)(**kw)
    built = oracle.two_groups(model) if optimizer is None else oracle.TORCH_OPTIMIZERS[optimizer](model)
    return zerodp.initialize(model, built, config(world, stage, dtype, offload))


def train(engine, rank: int, world: int, steps: range) -> None:
    gas, batches = inside(engine).spec.gas, global_batches()
    for step in steps:
        x, y = batches[step]
        for k in range(gas):
            sl = slice((rank * gas + k) * MICRO, (rank * gas + k + 1) * MICRO)
            engine.backward(engine(x[sl], y[sl]))
            engine.step()


def rng_draws() -> list[float]:
    import random

    import numpy as np
    return [torch.rand(()).item(), random.random(), float(np.random.rand())]


def snapshot(engine) -> dict:
    return {"pieces": ck.local_state(engine), "full": engine.full_state_dict(),
            "scaler": inside(engine).training.scaler.state_dict(), "lr": engine.get_lr(), "steps": engine.global_steps,
            "working": working_params(engine)}


def working_params(engine) -> dict[str, torch.Tensor]:
    with engine.gathered_parameters():  # stage 3 holds only shards outside a forward
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def save_run(rank: int, world: int, stage: int, path: str, dtype: str = "fp32", offload: bool = False,
             optimizer: str | None = None, model_kw: dict | None = None) -> dict:
    """Train SAVE_AT steps, save, train on to STEPS: the snapshot at the save and at the end."""
    engine = make_engine(world, stage, dtype, offload=offload, optimizer=optimizer, model_kw=model_kw)
    train(engine, rank, world, range(SAVE_AT))
    engine.save_checkpoint(path, client_state={"data": {"step": SAVE_AT, "rank": rank}})
    at_save = {**snapshot(engine), "rng": rng_draws()}
    train(engine, rank, world, range(SAVE_AT, STEPS))
    return {"at_save": at_save, "end": snapshot(engine)}


def resume_run(rank: int, world: int, stage: int, path: str, dtype: str = "fp32", offload: bool = False,
               optimizer: str | None = None, model_kw: dict | None = None) -> dict:
    """A fresh engine (other initial weights, the frozen ones too) loads the checkpoint and trains on to STEPS."""
    engine = make_engine(world, stage, dtype, seed=1, offload=offload, optimizer=optimizer, model_kw=model_kw)
    client = engine.load_checkpoint(path)
    loaded = {**snapshot(engine), "rng": rng_draws()}
    train(engine, rank, world, range(SAVE_AT, STEPS))
    return {"client": client, "loaded": loaded, "end": snapshot(engine)}


def wrong_model_run(rank: int, world: int, stage: int, path: str) -> list[str]:
    """Loading into a wider model must raise the same error on every rank, and nobody hangs."""
    engine = make_engine(world, stage, model_kw={"hidden": 38})
    errors = []
    for where in (path, path + "-missing"):
        try:
            engine.load_checkpoint(where)
            errors.append("no error")
        except ck.CheckpointError as e:
            errors.append(str(e))
    return errors


# A checkpoint written by older code (tests/data/zerodp_checkpoint/make_fixture.py says which and how).
FROZEN = {"frozen": True}  # the toy's first layer frozen: stage 3 shards it, with no master
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "zerodp_checkpoint")


def fixture_run(rank: int, world: int, path: str) -> dict:
    """Load the fixture into a fresh engine (other initial weights), save it again to `path` at once,
    then train one step: the weights after the load and after that step."""
    engine = make_engine(world, 2, "bf16", seed=1)
    engine.load_checkpoint(os.path.join(FIXTURE, "ckpt"))
    loaded = engine.full_state_dict()
    engine.save_checkpoint(path, "step2")
    train(engine, rank, world, range(SAVE_AT, SAVE_AT + 1))
    return {"loaded": loaded, "after": engine.full_state_dict()}


def run_jobs(rank: int, world: int, jobs: list[tuple]) -> dict:
    """Many runs in one set of ranks, in order: ('save'|'resume'|'wrong'|'fixture', key, stage or path, ...)."""
    fns = {"save": save_run, "resume": resume_run, "wrong": wrong_model_run, "fixture": fixture_run}
    return {job[1]: fns[job[0]](rank, world, *job[2:]) for job in jobs}


# ---- the runs, shared by the tests ---------------------------------------------------------------
@functools.cache
def workdir() -> str:
    path = tempfile.mkdtemp(prefix="zerodp-ckpt-test-")
    atexit.register(shutil.rmtree, path, True)
    return path


def ckpt(name: str) -> str:
    return os.path.join(workdir(), name)


@contextlib.contextmanager
def world_of_one():
    """A one-rank process group in this process: no spawn needed for world = 1."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1  # else another test of this session left a bigger group up
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


@functools.cache
def runs() -> dict:
    """{world: {job key: [result per rank]}}, run once in dependency order: 4 -> 1 -> 2."""
    out = {4: _by_key(run_ranks(run_jobs, 4, [("save", "s2", 2, ckpt("w4")), *WHOLE_SAVES]))}
    with world_of_one():
        out[1] = _by_key([run_jobs(0, 1, [("resume", "from4", 2, ckpt("w4")),
                                          ("save", "s1", 1, ckpt("w1")), *WHOLE_RESUMES[1],
                                          ("save", "s1frozen", 1, ckpt("w1f"), "fp32", False, None, FROZEN)])])
    out[2] = _by_key(run_ranks(run_jobs, 2, [
        ("resume", "from4", 2, ckpt("w4")), ("resume", "from1", 1, ckpt("w1")),
        ("save", "stage2", 2, ckpt("st2")), ("resume", "2to0", 0, ckpt("st2")),
        ("save", "stage0", 0, ckpt("st0")), ("resume", "0to2", 2, ckpt("st0")),
        ("save", "stage3", 3, ckpt("st3")), ("resume", "3to1", 1, ckpt("st3")), ("resume", "2to3", 3, ckpt("st2")),
        ("resume", "2to1offload", 1, ckpt("st2"), "fp32", True), ("save", "offload", 2, ckpt("off"), "fp32", True),
        ("resume", "offloadto3", 3, ckpt("off")),
        ("save", "bf16_save", 2, ckpt("bf16"), "bf16"), ("resume", "bf16_resume", 1, ckpt("bf16"), "bf16"),
        ("save", "fp16_save", 1, ckpt("fp16"), "fp16"), ("resume", "fp16_resume", 2, ckpt("fp16"), "fp16"),
        ("wrong", "wrong", 2, ckpt("w4")), ("fixture", "fixture", ckpt("fixture")), *WHOLE_RESUMES[2],
        # stage 3 saves its frozen parameters' shards once (frozen/ pieces); below it they are saved whole
        ("save", "stage3frozen", 3, ckpt("st3f"), "fp32", False, None, FROZEN),
        ("resume", "3fto3", 3, ckpt("st3f"), "fp32", False, None, FROZEN),
        ("resume", "3fto1", 1, ckpt("st3f"), "fp32", False, None, FROZEN),
        ("resume", "1fto3", 3, ckpt("w1f"), "fp32", False, None, FROZEN),
    ]))
    return out


# Optimizers that step whole parameters (their state in the parameter's shape, or Adafactor's row and column
# factors, or a user's per-row state), saved on 4 ranks and resumed on 1 and 2, at other stages.
WHOLE_SAVES = [("save", "Muon", 2, ckpt("muon"), "fp32", False, "Muon"),
               ("save", "Adafactor", 3, ckpt("adafactor"), "fp32", False, "Adafactor")]
WHOLE_RESUMES = {1: [("resume", "Muon_to1", 1, ckpt("muon"), "fp32", False, "Muon"),
                     ("resume", "Adafactor_to1", 0, ckpt("adafactor"), "fp32", False, "Adafactor")],
                 2: [("resume", "Muon_to2", 3, ckpt("muon"), "fp32", True, "Muon"),
                     ("resume", "Adafactor_to2", 2, ckpt("adafactor"), "fp32", False, "Adafactor")]}


def _by_key(per_rank: list[dict]) -> dict:
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The layout-free model + optimizer state: every saved piece of every rank, put together."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for snap in per_rank:
        for key, t in snap["pieces"].items():
            if key.startswith(("master/", "optim/")):
                name, _, start = key.rpartition("@")
                parts.setdefault(name, {})[int(start)] = t
    out = {name: torch.cat([p[s] for s in sorted(p)]) for name, p in parts.items()}
    out.update({k: t for snap in per_rank for k, t in snap["pieces"].items() if k.startswith("optim_param/")})
    out.update({k: t for k, t in per_rank[0]["pieces"].items() if k.startswith("optim_scalar/")})
    return out


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_close(a: dict, b: dict, tol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")


# ---- resume on other world sizes and stages ------------------------------------------------------
RESUMES = {  # test id: ((resumed on world, job key), (saved on world, job key))
    "world=4->2": ((2, "from4"), (4, "s2")), "world=4->1": ((1, "from4"), (4, "s2")),
    "world=1->2": ((2, "from1"), (1, "s1")), "stage=2->0": ((2, "2to0"), (2, "stage2")),
    "stage=0->2": ((2, "0to2"), (2, "stage0")), "stage=3->1": ((2, "3to1"), (2, "stage3")),
    "stage=2->3": ((2, "2to3"), (2, "stage2")), "stage=2->1+offload": ((2, "2to1offload"), (2, "stage2")),
    "stage=2+offload->3": ((2, "offloadto3"), (2, "offload")),
    "frozen,stage=3->3": ((2, "3fto3"), (2, "stage3frozen")), "frozen,stage=3->1": ((2, "3fto1"), (2, "stage3frozen")),
    "frozen,world=1,stage=1->3": ((2, "1fto3"), (1, "s1frozen")),
}


@pytest.mark.parametrize("resumed,saved", list(RESUMES.values()), ids=list(RESUMES))
def test_resume_restores_state_exactly_and_continues(resumed, saved):
    before = runs()[saved[0]][saved[1]]
    after = runs()[resumed[0]][resumed[1]]
    pieces = assemble([r["at_save"] for r in before])
    assert any(k.startswith("optim/exp_avg_sq/") for k in pieces) and any("/step" in k for k in pieces)
    assert_identical(assemble([r["loaded"] for r in after]), pieces)
    for r in after:
        assert_identical(r["loaded"]["full"], before[0]["at_save"]["full"])
        assert r["loaded"]["lr"] == before[0]["at_save"]["lr"] and r["loaded"]["steps"] == SAVE_AT
        assert r["client"] == {"data": {"step": SAVE_AT, "rank": 0}}
    for rank, r in enumerate(after):  # RNG: restored per rank; extra ranks reseed from seed + rank
        if rank < saved[0]:
            assert r["loaded"]["rng"] == before[rank]["at_save"]["rng"]
        else:
            assert r["loaded"]["rng"] == reseeded_draws(5 + rank)
    for r in after:  # the uninterrupted run and the resumed one end on the same weights
        assert_close(r["end"]["full"], before[0]["end"]["full"])
        assert r["end"]["lr"] == before[0]["end"]["lr"]


@pytest.mark.parametrize("optimizer,world", [(o, w) for o in ("Muon", "Adafactor") for w in (1, 2)])
def test_whole_parameter_optimizer_state_resumes_on_other_world_sizes(optimizer, world):
    before, after = runs()[4][optimizer], runs()[world][f"{optimizer}_to{world}"]
    pieces = assemble([r["at_save"] for r in before])
    whole = {k: t.shape for k, t in pieces.items() if k.startswith("optim_param/")}
    if optimizer == "Muon":  # the hidden matrix's momentum, in its shape; AdamW's state in flat pieces
        assert whole == {"optim_param/momentum_buffer/mid.weight": (37, 37)}
        assert any(k.startswith("optim/exp_avg_sq/") for k in pieces)
    else:  # a matrix's row and column factors, a vector's full variance, each parameter's step
        assert whole["optim_param/row_var/mid.weight"] == (37, 1) and whole["optim_param/col_var/mid.weight"] == (1, 37)
        assert whole["optim_param/variance/mid.bias"] == (37,) and whole["optim_param/step/mid.bias"] == ()
    assert_identical(assemble([r["loaded"] for r in after]), pieces)
    for r in after:
        assert_identical(r["loaded"]["full"], before[0]["at_save"]["full"])
        assert_close(r["end"]["full"], before[0]["end"]["full"], tol=2e-4 if optimizer == "Muon" else 1e-6)


def reseeded_draws(seed: int) -> list[float]:
    import random

    import numpy as np
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    draws = rng_draws()
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])
    return draws


def _saved_tensors(path: str, tmp) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, str(tmp / "all.pt"))
    return torch.load(str(tmp / "all.pt"), weights_only=True)


def test_reads_a_checkpoint_saved_before_and_writes_it_unchanged(tmp_path):
    """A checkpoint saved by older code (the fixture) loads to the weights that code had, training goes
    on from it as it did, and saving it again writes the same tensors and zerodp.json."""
    expected = torch.load(os.path.join(FIXTURE, "expected.pt"), weights_only=True)
    got = runs()[2]["fixture"][0]
    assert_identical(got["loaded"], expected["saved"])
    # The step after is floating point of this CPU: its bf16 products round otherwise where it has AVX512-BF16
    # (this Xeon: 19 of 2188 weights off by up to 7.5e-9). One bf16 rounding (2^-8 of a gradient) moves
    # AdamW's third step by at most lr (1 - b1) / (1 - b1^3) 2^-8 |g| / sqrt(v_hat), |g| / sqrt(v_hat) <= sqrt(3):
    # 2.5e-6. A state restored wrong moves it by a part of the step itself (the step count one off: 27% of
    # it, ~1e-4).
    step_rounding = oracle.LR * 0.1 / (1 - 0.9 ** 3) * 2 ** -8 * 3 ** 0.5
    assert_close(got["after"], expected["after"], tol=step_rounding)
    old, new = os.path.join(FIXTURE, "ckpt", "step2"), os.path.join(ckpt("fixture"), "step2")
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    assert_identical(_saved_tensors(new, tmp_path / "new"), _saved_tensors(old, tmp_path / "old"))
    with open(os.path.join(old, "zerodp.json")) as f, open(os.path.join(new, "zerodp.json")) as g:
        before, after = json.load(f), json.load(g)
    for meta in (before, after):
        del meta["files"]  # sizes and checksums of the DCP files, which carry pickled write plans
    assert after == before


def test_bf16_round_trip_masters_exact_working_params_rounded():
    saved = runs()[2]["bf16_save"][0]["at_save"]
    for r in runs()[2]["bf16_resume"]:
        loaded = r["loaded"]
        assert_identical(loaded["full"], saved["full"])
        for name, w in loaded["working"].items():
            assert w.dtype == torch.bfloat16
            assert torch.equal(w, loaded["full"][name].to(torch.bfloat16)), name
        assert_close(r["end"]["full"], runs()[2]["bf16_save"][0]["end"]["full"], tol=1e-2)
    assert_identical(assemble([r["loaded"] for r in runs()[2]["bf16_resume"]]),
                     assemble([r["at_save"] for r in runs()[2]["bf16_save"]]))


def test_fp16_loss_scaler_state_restored():
    saved = runs()[2]["fp16_save"][0]["at_save"]
    assert saved["scaler"]["dynamic"] and saved["scaler"]["cur_iter"] == SAVE_AT
    assert saved["scaler"]["scale"] != 2.0 ** 8, "the scale must have moved before the save"
    for r in runs()[2]["fp16_resume"]:
        assert r["loaded"]["scaler"] == saved["scaler"]
        assert_identical(r["loaded"]["full"], saved["full"])
        assert r["end"]["scaler"] == runs()[2]["fp16_save"][0]["end"]["scaler"]


def test_errors_are_raised_on_every_rank_without_a_hang():
    per_rank = runs()[2]["wrong"]
    assert per_rank[0] == per_rank[1]
    mismatch, missing = per_rank[0]
    assert "different model" in mismatch and "'inp.weight' has shape (37, 13)" in mismatch
    assert "does not exist" in missing


# ---- consolidation --------------------------------------------------------------------------------
class TiedLM(nn.Module):
    """Tied embedding/head (one parameter, two names), BatchNorm buffers and a frozen layer."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, y):
        h = self.norm(self.emb(idx))
        return nn.functional.cross_entropy(self.head(h + self.frozen(h)), y)


def tied_engine(stage: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    model = TiedLM()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}}
    return zerodp.initialize(model, opt, cfg)


def load_file(path: str) -> dict:
    if path.endswith(".pt"):
        return torch.load(path, weights_only=True)
    from safetensors.torch import load_file as load_safetensors
    return load_safetensors(path)


def test_consolidate_sharded_checkpoint_equals_full_state_dict(tmp_path):
    runs()
    out = str(tmp_path / "w4.safetensors")
    ck.main([ckpt("w4"), out])
    assert_identical(load_file(out), runs()[4]["s2"][0]["at_save"]["full"])


@pytest.mark.parametrize("ext", [".safetensors", ".pt"])
def test_consolidate_round_trip_tied_weights_buffers_strict(tmp_path, ext):
    with world_of_one():
        engine = tied_engine()
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            idx, y = torch.randint(0, 11, (8,), generator=g), torch.randint(0, 11, (8,), generator=g)
            engine.backward(engine(idx, y))
            engine.step()
        engine.save_checkpoint(str(tmp_path / "c"))
        full = engine.full_state_dict()
    out = str(tmp_path / f"model{ext}")
    from zerodp import cli
    cli.main(["consolidate", str(tmp_path / "c"), out])
    sd = load_file(out)
    assert_identical(sd, full)
    assert not torch.equal(sd["norm.running_mean"], torch.zeros(6)), "buffers must be the trained ones"
    fresh = TiedLM()
    fresh.load_state_dict(sd, strict=True)
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.head.weight, full["head.weight"])
    if ext == ".safetensors":
        from safetensors import safe_open
        with safe_open(out, "pt") as f:
            assert json.loads(f.metadata()["zerodp_tied"]) == {"head.weight": "emb.weight"}


# ---- atomic saves --------------------------------------------------------------------------------
def crash(*args, **kwargs):
    raise RuntimeError("simulated crash")


def write_then_crash(real):
    def save(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("simulated crash after the tensor files were written")
    return save


@pytest.mark.parametrize("where", ["tensor_files", "before_rename", "before_latest"])
def test_crash_mid_save_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch, where):
    d = str(tmp_path / "c")
    with world_of_one():
        engine = make_engine(1, 2)
        train(engine, 0, 1, range(1))
        engine.save_checkpoint(d, client_state={"data": 1})
        before = engine.full_state_dict()
        train(engine, 0, 1, range(1, 2))
        with monkeypatch.context() as m:
            if where == "tensor_files":
                m.setattr(dcp, "save", write_then_crash(dcp.save))
            elif where == "before_rename":
                m.setattr(ck_files, "commit", crash)
            else:
                real = ck_files.write_atomic
                m.setattr(ck_files, "write_atomic", lambda p, t: crash() if p.endswith("latest") else real(p, t))
            with pytest.raises((RuntimeError, ck.CheckpointError), match="simulated crash"):
                engine.save_checkpoint(d)
        assert open(os.path.join(d, "latest")).read() == "global_step1"
        assert ck.resolve(d)[0] == os.path.join(d, "global_step1")
        if where != "before_latest":
            # An error while writing: the save removes its own temp dir; later, rank 0's rename failed.
            assert (".tmp.global_step2" in os.listdir(d)) == (where != "tensor_files")
            assert "global_step2" not in os.listdir(d)
            with pytest.raises(ck.CheckpointError, match="does not exist"):
                ck.resolve(d, "global_step2")
        fresh = make_engine(1, 2, seed=1)
        assert fresh.load_checkpoint(d) == {"data": 1}
        assert_identical(fresh.full_state_dict(), before)
        engine.save_checkpoint(d)  # the next save succeeds and clears the leftovers
    assert sorted(os.listdir(d)) == ["global_step1", "global_step2", "latest"]
    assert open(os.path.join(d, "latest")).read() == "global_step2"


def killed_mid_save(rank: int, world: int, path: str) -> None:
    """Save at step 1; at step 2 every rank is SIGKILLed once its tensor files are on disk."""
    import signal
    engine = make_engine(world, 2)
    train(engine, rank, world, range(1))
    engine.save_checkpoint(path)
    train(engine, rank, world, range(1, 2))
    ck_files.record = lambda file: os.kill(os.getpid(), signal.SIGKILL)
    engine.save_checkpoint(path)


def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    d = str(tmp_path / "c")
    with pytest.raises(Exception, match="signal"):
        run_ranks(killed_mid_save, 2, d)
    assert open(os.path.join(d, "latest")).read() == "global_step1"
    assert any(f.endswith(".distcp") for f in os.listdir(os.path.join(d, ".tmp.global_step2")))
    with world_of_one():
        reference = make_engine(1, 2)
        train(reference, 0, 1, range(1))
        fresh = make_engine(1, 2, seed=1)
        fresh.load_checkpoint(d)
        assert fresh.global_steps == 1
        assert_close(fresh.full_state_dict(), reference.full_state_dict())


def test_saving_the_same_tag_again_replaces_it(tmp_path):
    d = str(tmp_path / "c")
    with world_of_one():
        engine = make_engine(1, 2)
        engine.save_checkpoint(d, tag="best", client_state={"v": 1})
        train(engine, 0, 1, range(1))
        engine.save_checkpoint(d, tag="best", client_state={"v": 2})
        after = engine.full_state_dict()
        fresh = make_engine(1, 2, seed=1)
        assert fresh.load_checkpoint(d) == {"v": 2}
        assert_identical(fresh.full_state_dict(), after)
    assert sorted(os.listdir(d)) == ["best", "latest"]


def test_crash_while_re_saving_a_tag_keeps_the_old_one(tmp_path, monkeypatch):
    d = str(tmp_path / "c")
    with world_of_one():
        engine = make_engine(1, 2)
        engine.save_checkpoint(d, tag="best")
        before = engine.full_state_dict()
        train(engine, 0, 1, range(1))
        real = os.replace

        def replace(src, dst):  # the old `best` is moved aside, then the crash
            if src.endswith(".tmp.best"):
                raise RuntimeError("simulated crash")
            real(src, dst)
        with monkeypatch.context() as m:
            m.setattr(os, "replace", replace)
            with pytest.raises(ck.CheckpointError, match="simulated crash"):
                engine.save_checkpoint(d, tag="best")
        assert "best" not in os.listdir(d)
        fresh = make_engine(1, 2, seed=1)
        fresh.load_checkpoint(d)
        assert_identical(fresh.full_state_dict(), before)


# ---- errors ----------------------------------------------------------------------------------------
@functools.cache
def small_checkpoint() -> str:
    d = ckpt("small")
    with world_of_one():
        engine = make_engine(1, 1)
        train(engine, 0, 1, range(1))
        engine.save_checkpoint(d)
    return d


def load_error(path: str, tag: str | None = None, model_kw: dict | None = None) -> str:
    """The error a fresh engine raises loading `path`; its weights must be untouched."""
    with world_of_one():
        engine = make_engine(1, 1, seed=3, model_kw=model_kw)
        before = engine.full_state_dict()
        with pytest.raises(ck.CheckpointError) as e:
            engine.load_checkpoint(path, tag)
        assert_identical(engine.full_state_dict(), before)
    return str(e.value)


def corrupted_copy(tmp_path, edit) -> str:
    d = str(tmp_path / "c")
    shutil.copytree(small_checkpoint(), d)
    edit(os.path.join(d, "global_step1"))
    return d


def test_error_no_checkpoint_directory(tmp_path):
    assert "does not exist" in load_error(str(tmp_path / "nowhere"))


def test_error_directory_without_checkpoint(tmp_path):
    (tmp_path / ".tmp.global_step5").mkdir()  # an interrupted save is not a checkpoint
    msg = load_error(str(tmp_path))
    assert "no checkpoint in" in msg and "'latest'" in msg


def test_error_latest_names_missing_tag(tmp_path):
    d = corrupted_copy(tmp_path, lambda p: None)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("global_step99")
    assert "'global_step99'" in load_error(d) and "does not exist" in load_error(d)
    assert "'nope'" in load_error(d, tag="nope")


def test_error_latest_is_not_a_tag(tmp_path):
    d = corrupted_copy(tmp_path, lambda p: None)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("../../elsewhere")
    assert "is corrupt" in load_error(d) and "'../../elsewhere'" in load_error(d)


def test_consolidate_command_reports_errors_and_takes_a_tag(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ck.main([str(tmp_path / "nowhere"), str(tmp_path / "out.pt")])
    assert e.value.code == 1 and "does not exist" in capsys.readouterr().err
    ck.main([small_checkpoint(), str(tmp_path / "out.pt"), "--tag", "global_step1"])
    assert "wrote" in capsys.readouterr().out and os.path.isfile(tmp_path / "out.pt")


@pytest.mark.parametrize("model_kw,expected", [
    ({"hidden": 38}, "'inp.weight' has shape (37, 13) in the checkpoint and (38, 13) in the model"),
    ({"extra": True}, "parameter 'extra' (3,) is not in the checkpoint"),
], ids=["shape", "extra_parameter"])
def test_error_different_model_names_first_mismatch(model_kw, expected):
    msg = load_error(small_checkpoint(), model_kw=model_kw)
    assert "different model" in msg and expected in msg


def test_error_checkpoint_has_parameter_model_lacks(tmp_path):
    d = str(tmp_path / "tied")
    with world_of_one():
        make_engine(1, 1, model_kw={"extra": True}).save_checkpoint(d)
    assert "it has parameter 'extra' (3,), which the model does not have" in load_error(d)


def _truncate(p):
    f = os.path.join(p, "__0_0.distcp")
    os.truncate(f, os.path.getsize(f) // 2)


def _flip(p):
    f = os.path.join(p, "__0_0.distcp")
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(f, "wb").write(bytes(data))


def _garbage_json(p):
    open(os.path.join(p, "zerodp.json"), "w").write('{"format": 1, "model": [')


def _evil_metadata(p):
    """A pickle that would run a command: refused, even with a matching size and checksum."""
    import pickle
    evil = pickle.dumps(type("Evil", (), {"__reduce__": lambda self: (os.system, ("echo pwned",))})())
    open(os.path.join(p, ".metadata"), "wb").write(evil)
    meta = json.load(open(os.path.join(p, "zerodp.json")))
    meta["files"][".metadata"] = ck_files.record(os.path.join(p, ".metadata"))
    json.dump(meta, open(os.path.join(p, "zerodp.json"), "w"))


def _pickle_distcp(p):
    """A pickle where the tensor file should be, with a matching size and checksum."""
    import pickle
    from pathlib import Path
    f, meta_file = Path(p) / "__0_0.distcp", Path(p) / "zerodp.json"
    f.write_bytes(pickle.dumps({"weights": [1.0, 2.0, 3.0]}))
    meta = json.loads(meta_file.read_text())
    meta["files"]["__0_0.distcp"] = ck_files.record(str(f))
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize("edit,expected", [
    (_truncate, "__0_0.distcp has"), (_flip, "__0_0.distcp does not match its checksum"),
    (_garbage_json, "zerodp.json cannot be read"), (_evil_metadata, "refusing to load posix.system"),
    (_pickle_distcp, "__0_0.distcp cannot be read"),
], ids=["truncated", "flipped_byte", "bad_json", "malicious_metadata", "pickle_as_distcp"])
def test_error_corrupt_checkpoint_names_the_file(tmp_path, edit, expected):
    msg = load_error(corrupted_copy(tmp_path, edit))
    assert "is corrupt" in msg and expected in msg, msg


# ---- no path out of the checkpoint directory ------------------------------------------------------
_opened: list[str] | None = None


@functools.cache
def _audit_opens() -> None:
    """Every open() of this process (builtins, io, os.open) is seen by an audit hook; it records
    paths only while `opened_files` is active. Hooks cannot be removed, hence installed once."""
    def hook(event: str, args: tuple) -> None:
        if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
            _opened.append(os.path.realpath(os.fsdecode(args[0])))
    sys.addaudithook(hook)


@contextlib.contextmanager
def opened_files():
    global _opened
    _audit_opens()
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def _escape(how: str, outside: str):
    """Point the tensor file of a checkpoint at `outside` (a real copy of it, so that reading it
    would succeed): by an absolute path or a `../` path in .metadata and zerodp.json, or by a symlink."""
    import dataclasses
    import pickle

    def edit(p):
        name = "__0_0.distcp"
        shutil.copy(os.path.join(p, name), outside)
        if how == "symlink":
            os.remove(os.path.join(p, name))
            os.symlink(outside, os.path.join(p, name))
            return
        rel = outside if how == "absolute" else os.path.relpath(outside, p)
        md = ck.read.read_metadata(p)
        md.storage_data = {idx: dataclasses.replace(info, relative_path=rel) if info.relative_path == name else info
                           for idx, info in md.storage_data.items()}
        with open(os.path.join(p, ".metadata"), "wb") as f:
            pickle.dump(md, f)
        meta = json.load(open(os.path.join(p, "zerodp.json")))
        meta["files"][rel] = ck_files.record(outside)  # a matching size and checksum: only the path is wrong
        meta["files"][".metadata"] = ck_files.record(os.path.join(p, ".metadata"))
        json.dump(meta, open(os.path.join(p, "zerodp.json"), "w"))
    return edit


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_tensor_path_out_of_the_checkpoint_is_refused_before_any_file_opens(tmp_path, how):
    outside = str(tmp_path / "outside.distcp")
    d = corrupted_copy(tmp_path, _escape(how, outside))
    with opened_files() as opened:
        msg = load_error(d)
    assert "is unsafe" in msg and "outside the checkpoint directory" in msg, msg
    assert any(f.endswith("zerodp.json") for f in opened)  # the hook sees the opens that do happen
    assert os.path.realpath(outside) not in opened
    with opened_files() as opened, pytest.raises(ck.CheckpointError, match="outside the checkpoint directory"):
        ck.read.read_metadata(os.path.join(d, "global_step1"))  # the .metadata check alone, for consolidate
    assert os.path.realpath(outside) not in opened


# ---- zerodp.json: every field by type and range -----------------------------------------------------
def _set(keys: tuple, value):
    def edit(p):
        meta = json.load(open(os.path.join(p, "zerodp.json")))
        node = meta
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        json.dump(meta, open(os.path.join(p, "zerodp.json"), "w"))
    return edit


@pytest.mark.parametrize("keys,value,expected", [
    (("counters", "global_steps"), "forty", "field 'counters.global_steps' = 'forty': Input should be a valid integer"),
    (("counters", "global_steps"), -3, "field 'counters.global_steps' = -3: Input should be greater than or equal to 0"),
    (("stage",), 7, "field 'stage' = 7: Input should be less than or equal to 3"),
    (("stage",), "2", "field 'stage' = '2': Input should be a valid integer"),
    (("world_size",), 0, "field 'world_size' = 0: Input should be greater than or equal to 1"),
    (("files", "__0_0.distcp", "size"), "12", "field 'files.__0_0.distcp.size' = '12'"),
    (("model", 0, "kind"), "weights", "field 'model.0.kind' = 'weights'"),
], ids=["step_string", "step_negative", "stage_7", "stage_string", "world_0", "size_string", "model_kind"])
def test_bad_zerodp_json_field_is_refused_naming_the_field_and_file(tmp_path, keys, value, expected):
    msg = load_error(corrupted_copy(tmp_path, _set(keys, value)))
    assert "zerodp.json is not a valid zerodp checkpoint description" in msg and expected in msg, msg


# ---- housekeeping ------------------------------------------------------------------------------------
def test_keep_last_keeps_the_newest_by_global_step_and_never_latest(tmp_path):
    d = tmp_path / "c"
    (d / "notes").mkdir(parents=True)  # not a checkpoint: never removed
    with world_of_one():
        engine = make_engine(1, 2)
        for tag in ("zz", "mm", "aa"):  # names sort against the steps (1, 2, 3)
            train(engine, 0, 1, range(engine.global_steps, engine.global_steps + 1))
            engine.save_checkpoint(d, tag=tag, keep_last=2)
        assert sorted(os.listdir(d)) == ["aa", "latest", "mm", "notes"]
        rewound = make_engine(1, 2, seed=1)
        rewound.load_checkpoint(d, "mm")
        rewound.save_checkpoint(d, tag="rewound", keep_last=1)  # step 2 again: `latest`, not the newest
        with pytest.raises(ck.CheckpointError, match="keep_last=0: expected a positive integer"):
            rewound.save_checkpoint(d, keep_last=0)
    assert sorted(os.listdir(d)) == ["aa", "latest", "notes", "rewound"]
    assert ck.resolve(d)[0] == str(d / "rewound")


def test_keep_last_and_the_fallback_choose_among_the_current_runs_checkpoints_only():
    from zerodp.checkpoint.files import Saved, doomed, newest_first, only_run

    theirs = [Saved(f"global_step{n}", n, 1.0, "A") for n in (50, 100, 110)]  # a finished run's: higher steps
    ours = [Saved(f"global_step{n}", n, 2.0 + n, "B") for n in (2, 4, 6)]
    assert doomed(theirs + ours, 2, "global_step6", "B") == ["global_step2"]
    # Rewound to step 4 (`latest`): its step 6 is newer and stays, `latest` is never removed.
    assert doomed(theirs + ours, 1, "global_step4", "B") == ["global_step2"]
    assert doomed(theirs + ours, 5, "global_step6", "B") == []
    assert [s.name for s in newest_first(theirs + ours, "B")] == ["global_step6", "global_step4", "global_step2"]
    again = Saved("rewound", 4, 99.0, "B")  # the same step saved later: newer
    assert [s.name for s in newest_first([*ours, again], "B")][:2] == ["global_step6", "rewound"]
    assert only_run(ours, "d") == "B"
    with pytest.raises(ck.CheckpointError, match=r"'d' holds the checkpoints of 2 runs and its 'latest' does not say "
                       r"which is the current one \(run A: global_step110, global_step100, global_step50; run B: "
                       r"global_step6, global_step4, global_step2\); pick one by its tag"):
        only_run(theirs + ours, "d")


def _train_and_save(engine, d, steps: int, **kw) -> None:
    for _ in range(steps):
        train(engine, 0, 1, range(engine.global_steps, engine.global_steps + 1))
        engine.save_checkpoint(d, **kw)


def test_keep_last_in_a_folder_shared_with_another_run_keeps_that_runs_checkpoints(tmp_path):
    """engine.save_checkpoint(keep_last=N) beside another run's global_stepN (a finished run of more steps):
    this run's N newest stay, the other run's all stay, and the fallback never takes the other run's."""
    d = str(tmp_path / "c")
    with world_of_one():
        first = make_engine(1, 2)
        _train_and_save(first, d, 4, tag=None)  # global_step1..4 of one run
        for step in (1, 2):  # the names a second run will use: the first run's go by other names
            os.rename(os.path.join(d, f"global_step{step}"), os.path.join(d, f"first{step}"))
        second = make_engine(1, 2, seed=1)  # a fresh engine: its first save starts a run
        _train_and_save(second, d, 2, keep_last=1)
        with pytest.raises(ck.CheckpointError, match=r"global_step3' is a checkpoint of another run .*which this "
                           "save would replace; save under another tag"):
            _train_and_save(second, d, 1)
    assert sorted(os.listdir(d)) == ["first1", "first2", "global_step2", "global_step3", "global_step4", "latest"]
    runs = {name: json.load(open(os.path.join(d, name, "zerodp.json")))["run"] for name in os.listdir(d)
            if name != "latest"}
    assert len(set(runs.values())) == 2 and runs["global_step2"] != runs["global_step4"]
    _truncate(os.path.join(d, "global_step2"))
    with pytest.raises(ck.CheckpointError, match=f"no intact checkpoint of run {runs['global_step2']} in .*"
                       r"truncated.*\(other runs' checkpoints there, not taken: first1, first2, global_step3, "
                       r"global_step4\)"):
        ck.newest_intact(d)  # the run `latest` names: its one checkpoint is broken
    assert ck.newest_intact(d, runs["global_step4"])[0] == os.path.join(d, "global_step4")


def test_a_checkpoint_saved_before_runs_had_names_is_run_unnamed_and_so_is_its_resume(tmp_path):
    from zerodp.checkpoint.read import current_run

    d = tmp_path / "c"
    shutil.copytree(os.path.join(FIXTURE, "ckpt"), d)
    assert current_run(str(d)) == "unnamed"
    with world_of_one():
        engine = make_engine(1, 2, "bf16", seed=1)
        engine.load_checkpoint(str(d))
        _train_and_save(engine, str(d), 2, keep_last=2)  # steps 3 and 4: the same run as the fixture's step2
        fresh = make_engine(1, 2, "bf16", seed=1)
        _train_and_save(fresh, str(tmp_path / "other"), 1)
    assert sorted(os.listdir(d)) == ["global_step3", "global_step4", "latest"]  # step2, of the same run, pruned
    assert "run" not in json.load(open(d / "global_step4" / "zerodp.json"))
    assert json.load(open(tmp_path / "other" / "global_step1" / "zerodp.json"))["run"] != "unnamed"


def test_resume_past_an_unreadable_latest_in_a_folder_of_two_runs_takes_the_run_its_metrics_name(tmp_path, capsys):
    import argparse

    from zerodp.train.resume import choose_resume
    d = tmp_path / "run" / "checkpoints"
    d.mkdir(parents=True)
    for tag, run, step in (("theirs", "20260101-000000-aaaaaa", 9), ("ours", "20260102-000000-bbbbbb", 1)):
        shutil.copytree(os.path.join(small_checkpoint(), "global_step1"), d / tag)
        meta = json.loads((d / tag / "zerodp.json").read_text())
        meta["tag"], meta["run"], meta["counters"]["global_steps"] = tag, run, step
        (d / tag / "zerodp.json").write_text(json.dumps(meta))
    (d / "latest").write_text("??")
    with pytest.raises(ck.CheckpointError, match="holds the checkpoints of 2 runs"):
        ck.newest_intact(str(d))  # which run is current cannot be told from the checkpoints alone
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"kind": "run", "step": 0, "id": "20260102-000000-bbbbbb"}))
    opts = argparse.Namespace(resume=True, resume_from=None, out=str(tmp_path / "run"), grad_accum=1,
                              micro_batch=2, explicit=set(), steps=10, warmup=0, tp=1)
    choose_resume(opts, 1)
    assert opts.resume_path == str(d / "ours") and opts.run == "20260102-000000-bbbbbb"  # never step 9 of theirs
    assert "resuming from the newest intact checkpoint of run 20260102-000000-bbbbbb" in capsys.readouterr().err


def test_next_save_removes_the_temp_dirs_of_killed_saves(tmp_path):
    d = tmp_path / "c"
    with world_of_one():
        engine = make_engine(1, 2)
        engine.save_checkpoint(d, tag="a")
        for junk in (".tmp.global_step9", ".tmp.a", ".old.a", ".old.gone"):
            (d / junk).mkdir()
            (d / junk / "__0_0.distcp").write_bytes(b"half")
        engine.save_checkpoint(d, tag="b")
    # .old.gone is the only copy of tag 'gone' (a crash between a re-save's renames): kept
    assert sorted(os.listdir(d)) == [".old.gone", "a", "b", "latest"]


def test_newest_intact_skips_a_corrupt_latest(tmp_path):
    d = str(tmp_path / "c")
    with world_of_one():
        engine = make_engine(1, 2)
        for step in range(2):
            train(engine, 0, 1, range(step, step + 1))
            engine.save_checkpoint(d)
    _truncate(os.path.join(d, "global_step2"))
    with pytest.raises(ck.CheckpointError, match="truncated"):
        ck.resolve(d)
    path, meta = ck.newest_intact(d)
    assert path == os.path.join(d, "global_step1") and meta["counters"]["global_steps"] == 1
    open(os.path.join(d, "latest"), "w").write("??")
    assert ck.newest_intact(d)[0] == path


def test_resume_falls_back_past_a_latest_whose_file_fails_its_checksum(tmp_path, capsys):
    import argparse

    from zerodp.train.resume import choose_resume
    d = tmp_path / "run" / "checkpoints"
    with world_of_one():
        engine = make_engine(1, 2)
        for step in range(2):
            train(engine, 0, 1, range(step, step + 1))
            engine.save_checkpoint(str(d))
    _flip(str(d / "global_step2"))  # same size: only the checksum tells
    with pytest.raises(ck.CheckpointError, match="global_step2.*does not match its checksum"):
        ck.resolve(str(d), checksums=True)
    assert ck.newest_intact(str(d))[0] == str(d / "global_step1")
    opts = argparse.Namespace(resume=True, resume_from=None, out=str(tmp_path / "run"), grad_accum=1,
                              micro_batch=2, explicit=set(), steps=10, warmup=0, tp=1)
    choose_resume(opts, 1)
    assert opts.resume_path == str(d / "global_step1")
    assert "does not match its checksum; resuming from the newest intact checkpoint" in capsys.readouterr().err


def test_stage3_saves_each_frozen_element_once_in_pieces_of_every_rank():
    """Stage 3's frozen weight is saved as each rank's pieces (frozen/), together exactly the tensor, and
    not whole by rank 0 (model/) as below stage 3."""
    saved = runs()[2]["stage3frozen"]
    keys = [[k for k in r["at_save"]["pieces"] if k.startswith("frozen/")] for r in saved]
    assert all(keys) and not set(keys[0]) & set(keys[1])
    assert not any(k.startswith("model/inp.weight") for r in saved for k in r["at_save"]["pieces"])
    pieces = {k: t for r in saved for k, t in r["at_save"]["pieces"].items() if k.startswith("frozen/")}
    whole = torch.cat([pieces[k] for k in sorted(pieces, key=lambda k: int(k.rpartition("@")[2]))])
    assert torch.equal(whole.view(-1, oracle.D_IN), saved[0]["at_save"]["full"]["inp.weight"])
    assert not any(k.startswith("frozen/") for k in runs()[1]["s1frozen"][0]["at_save"]["pieces"])
