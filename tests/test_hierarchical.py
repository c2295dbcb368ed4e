"""Hierarchical sharding (zero_optimization.mics_shard_size = S): model states sharded within groups of S
ranks and replicated across N/S. The oracle at world 4 with S = 1, 2, 4 (the bytes each group moves
are in test_comm_volume.py); memory 2Ψ + 14Ψ/S at N = 64, S = 8 (fake process group); checkpoints
saved with S = 2 on 4 ranks resumed flat on 2 and with S = 4 on 8 (fake process group: each rank in
turn reads its share), exactly.

One spawn per world runs every case; the fake-process-group parts share one subprocess.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import oracle
import zerodp
from zerodp.engine.engine import inside
from spawn import run_ranks
from zerodp.plan import measure
from zerodp.plan import formulas
from zerodp.checkpoint.pieces import local_state, owned_pieces
from zerodp.config import ConfigError, ZeroConfig

STAGES = [1, 2, 3]
STAGE3_UNSUPPORTED = {"used_by_parent"}  # stage 3 runs it flat (test_engine.py)
# At S = 2 in fp32 the oracle cases whose partitioning differs (test_engine.py's WORLD4_CASES: shards split
# over several ranks, padding-only shards, unused/frozen/tied parameters, accumulation windows); the others
# change only which hooks fire (checkpointed, module_called_twice, used_by_parent) or which element-wise
# AdamW steps a shard (param_groups, fused_adamw), the same with or without replicas, and run flat at world
# 4 or every stage on 1 and 2 ranks in test_engine.py.
FP32_CASES = ["plain", "frozen", "unused", "tied", "indivisible", "tiny_group", "param_larger_than_bucket",
              "accumulation"]
# In bf16 (5 steps: oracle.LONG) the cases whose replica paths differ in what they reduce: padding-only shards
# and accumulation windows (unused and tied parameters reach the same replica reduction as in fp32, above).
BF16_CASES = ["plain", "tiny_group", "accumulation"]
ENDS = ["plain", "accumulation"]  # S = 1 (every rank holds everything) and S = 4 (flat)


def oracle_jobs() -> list[tuple]:
    """Every oracle case at S = 2 (fp32; bf16 for BF16_CASES); the two ends on fewer cases, and S = 4
    beside the flat default for a bit-for-bit comparison."""
    jobs = [(case, stage, "fp32", 2) for case in FP32_CASES for stage in STAGES
            if not (stage == 3 and case in STAGE3_UNSUPPORTED)]
    jobs += [(case + oracle.LONG, stage, "bf16", 2) for case in BF16_CASES for stage in STAGES]
    jobs += [(case, stage, "fp32", 1) for case in ENDS for stage in STAGES]
    jobs += [("plain", stage, "fp32", s) for s in (4, None) for stage in STAGES]
    return jobs


def _oracle(rank: int, world: int, case: str, stage: int, dtype: str, shard: int | None) -> dict:
    zero = {} if shard is None else {"mics_shard_size": shard}
    return oracle.train_engine(rank, world, case, stage, dtype, False, 0, **zero)


def mesh_run(rank: int, world: int) -> dict:
    """`plain` at stage 2 with the groups of a 2 x 2 DeviceMesh (replicate, shard) instead of the config key."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    real = zerodp.initialize
    zerodp.initialize = functools.partial(real, device_mesh=mesh)
    try:
        return oracle.train_engine(rank, world, "plain", 2)
    finally:
        zerodp.initialize = real


def bad_shard_size(rank: int, world: int) -> str:
    model = oracle.build(oracle.CASES["plain"])
    try:
        zerodp.initialize(model, oracle.one_group(model),
                          oracle.config_for(oracle.CASES["plain"], 2, world, mics_shard_size=3))
    except ConfigError as e:
        return str(e)
    return "no error"


def ckpt_engine(world: int, stage: int, shard: int):
    case = oracle.CASES["tied"]
    model = oracle.build(case)
    # Stage 3 keeps every (tiny) module gathered: a released parameter shows shape (0,) to the
    # checkpoint's model check, which is not what this test is about.
    cfg = oracle.config_for(case, stage, world, mics_shard_size=shard, stage3_param_persistence_threshold=10**9)
    cfg["gradient_accumulation_steps"] = 1
    return zerodp.initialize(model, case.optimizer(model), cfg)


def save_run(rank: int, world: int, path: str) -> dict:
    """Stage 2, S = 2 on 4 ranks: two steps on the global batch, then save."""
    engine = ckpt_engine(world, 2, 2)
    for micro in oracle.batches(world, 1)[:2]:
        x, y = micro[0]
        engine.backward(engine(x[rank * oracle.MICRO:(rank + 1) * oracle.MICRO],
                               y[rank * oracle.MICRO:(rank + 1) * oracle.MICRO]))
        engine.step()
    engine.save_checkpoint(path, tag="t")
    return _held(engine)


def _held(engine) -> dict:
    """Every piece of master and optimizer state this rank holds (replicas included), by saved name."""
    out = {}
    for pc in owned_pieces(engine):
        m = inside(engine).training.partitioned_optimizer.masters[pc.master]
        out[f"master/{pc.name}@{pc.start}"] = m.detach()[pc.offset:pc.offset + pc.numel].clone()
        for key, v in engine.optimizer.state.get(m, {}).items():
            if torch.is_tensor(v) and v.shape == m.shape:
                out[f"optim/{key}/{pc.name}@{pc.start}"] = v.detach()[pc.offset:pc.offset + pc.numel].clone()
    return {"pieces": out, "written": local_state(engine), "steps": engine.global_steps}


def load_run(rank: int, world: int, path: str, stage: int, shard: int) -> dict:
    engine = ckpt_engine(world, stage, shard)
    engine.load_checkpoint(path, tag="t")
    return _held(engine)


def _world4(rank: int, world: int, path: str) -> dict:
    out = {job: _oracle(rank, world, *job) for job in oracle_jobs()}
    out["bad"] = bad_shard_size(rank, world)
    out["mesh"] = mesh_run(rank, world)
    out["save"] = save_run(rank, world, path)
    return out


@functools.cache
def reference(case: str) -> dict:
    return oracle.train_reference(case, 4)


@functools.cache
def ckpt_dir() -> str:
    return tempfile.mkdtemp(prefix="zerodp-hier-")


@functools.cache
def world4() -> list[dict]:
    return run_ranks(_world4, 4, ckpt_dir())


# ---- the fake process group: N = 64 memory and N = 8 loads, in one subprocess ---------------------
MEM_MODEL = dict(n_layer=4, n_head=4, n_embd=256, vocab_size=512, block_size=64)


def _fake_main(path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    spec = {"world": 64, "stage": 2, "gas": 1, "model": MEM_MODEL, "micro_batch": 2, "seq": 32, "dtype": "bf16",
            "reduce_bucket_size": 2 ** 18, "mics_shard_size": 8}
    result = {"memory": measure._measure_here(spec), "flat2": [], "hier8": []}
    # Every rank in turn: flat stage 2 on 2 ranks; stage 3 with S = 4 on 8 (two copies of each shard).
    for key, world, stage, shard in (("flat2", 2, 2, -1), ("hier8", 8, 3, 4)):
        for rank in range(world):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            result[key].append(load_run(rank, world, path, stage, shard))
            dist.destroy_process_group()
    torch.save(result, out)


@functools.cache
def fake_runs() -> dict:
    world4()
    out = os.path.join(ckpt_dir(), "fake.pt")
    here = os.path.dirname(__file__)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_hierarchical as t; t._fake_main(sys.argv[1], sys.argv[2])"
    run = subprocess.run([sys.executable, "-c", code, ckpt_dir(), out], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out, weights_only=False)


# ---- the oracle ---------------------------------------------------------------------------------
@pytest.mark.parametrize("job", oracle_jobs(), ids=lambda j: f"{j[0]}-stage={j[1]}-{j[2]}-S={j[3] or 'unset'}")
def test_world4_matches_single_process(job):
    case, stage, dtype, shard = job
    ours, ref = world4()[0][job], reference(case)
    assert ours["steps"] == oracle.case_named(case).steps >= (5 if dtype == "bf16" else 3)
    tol = {"fp32": dict(rtol=1e-6, atol=1e-6), "bf16": dict(rtol=0, atol=4e-3)}[dtype]
    for k in ref["state"]:
        torch.testing.assert_close(ours["state"][k], ref["state"][k], **tol, msg=lambda m: f"{k}: {m}")
    if dtype == "fp32":
        assert ours["norms"] == pytest.approx(ref["norms"], rel=1e-5)


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage={s}")
def test_shard_size_equal_to_world_is_flat_bit_for_bit(stage):
    runs = world4()[0]
    a, b = runs[("plain", stage, "fp32", 4)], runs[("plain", stage, "fp32", None)]
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k
    assert a["norms"] == b["norms"]


def test_a_device_mesh_gives_the_same_training_as_the_config_key():
    a, b = world4()[0]["mesh"], world4()[0][("plain", 2, "fp32", 2)]
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k


def test_shard_size_must_divide_the_world_on_every_rank():
    messages = [r["bad"] for r in world4()]
    assert len(set(messages)) == 1
    assert "mics_shard_size 3 must divide the world size 4" in messages[0]


@pytest.mark.parametrize("value, match", [(0, "must divide"), (5, "must divide"), (-2, "greater than or equal")])
def test_shard_size_errors_name_the_key(value, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        ZeroConfig(stage=2, mics_shard_size=value).shard_size(4)


def test_shard_size_defaults_flat_and_stage0_refuses_it():
    assert ZeroConfig(stage=2).shard_size(8) == 8
    assert ZeroConfig(stage=2, mics_shard_size=8).shard_size(8) == 8
    with pytest.raises(ConfigError, match="stage 0"):
        ZeroConfig(stage=0, mics_shard_size=2).shard_size(4)


@pytest.mark.parametrize("key, value, match", [("mics_hierarchical_params_gather", True, "two-hop"),
                                                ("zero_hpz_partition_size", 8, "not implemented")])
def test_refused_deepspeed_keys_say_why(key, value, match):
    with pytest.raises(ConfigError, match=match):
        zerodp.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {key: value}})


# ---- memory at N = 64, S = 8 ---------------------------------------------------------------------
def test_stage2_bytes_per_rank_are_2psi_plus_14psi_over_s():
    r = fake_runs()["memory"]
    psi, rep = r["num_params"], r["report"]
    expected = formulas.formula(psi, 8, 2)  # 2Ψ + 14Ψ/S: the shard group is the world of the formula
    assert expected == pytest.approx(2 * psi + 14 * psi / 8, rel=1e-6)
    assert rep["model_states"] == pytest.approx(expected, rel=0.05), rep
    assert rep["model_states"] > formulas.formula(psi, 64, 2) * 1.5  # not the flat 2Ψ + 14Ψ/64


# ---- checkpoints stay layout-free -----------------------------------------------------------------
def _union(ranks: list[dict], what: str) -> dict:
    out = {}
    for r in ranks:
        for k, v in r[what].items():
            if k.startswith(("master/", "optim/")):
                assert k not in out or torch.equal(out[k], v), f"two ranks disagree on {k}"
                out[k] = v
    return out


def _by_param(pieces: dict) -> dict:
    """Pieces joined into whole flat tensors per (kind, parameter): independent of the layout."""
    parts: dict = {}
    for k, v in pieces.items():
        key, _, start = k.rpartition("@")
        parts.setdefault(key, []).append((int(start), v))
    return {k: torch.cat([v for _, v in sorted(p, key=lambda t: t[0])]) for k, p in parts.items()}


def test_checkpoint_saved_with_s2_on_4_ranks_is_written_once_per_piece():
    saved = world4()
    written = [k for r in saved for k in r["save"]["written"] if k.startswith("master/")]
    assert len(written) == len(set(written)), "a replica wrote a piece its first copy writes"
    written, held = (_by_param(_union([r["save"] for r in saved], what)) for what in ("written", "pieces"))
    assert written.keys() == held.keys()
    assert all(torch.equal(written[k], held[k]) for k in held)


@pytest.mark.parametrize("where", ["flat2", "hier8"], ids=["flat stage 2 on 2 ranks", "S=4 stage 3 on 8 ranks"])
def test_checkpoint_saved_with_s2_on_4_ranks_resumes_exactly(where):
    saved = _by_param(_union([r["save"] for r in world4()], "pieces"))
    loaded_ranks = fake_runs()[where]
    for r in loaded_ranks:  # every rank, replicas included, holds exactly the saved values of its pieces
        assert r["steps"] == 2
    loaded = _by_param(_union(loaded_ranks, "pieces"))
    assert loaded.keys() == saved.keys()
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
