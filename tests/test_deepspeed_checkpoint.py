"""DeepSpeed ZeRO checkpoints continue in zerodp: weights, Adam state, counters and schedule, on any world
size and stage, without DeepSpeed installed.

The fixtures in tests/data/deepspeed/ were written by DeepSpeed 0.19.8 on 2 gloo ranks (make_fixtures.py
there: the oracle's Toy, torch's AdamW in two param groups, WarmupLR, clipping 1.0, micro-batch 3, saved
after 3 steps). fixtures.json records DeepSpeed resuming each one and training 3 more steps on the same
global batches, and what it held right after loading. zerodp resumes each fixture on 2 ranks (on its own
stage and on another) and on 1 rank (two micro-batches of 3 accumulated: the same micro-batches as
DeepSpeed's two ranks), and must reproduce that: the first loss exactly (it depends only on the loaded
weights), the next two within the data-parallel floor (the gradient may be summed in another order;
measured here: all three are bit-identical to DeepSpeed's in every case, bf16 included).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import types

import pytest
import torch

import oracle
import test_train
import zerodp
from zerodp.engine.engine import inside
from spawn import run_ranks
from test_checkpoint import world_of_one
from zerodp import checkpoint as ck
from zerodp.checkpoint import deepspeed as ck_ds

HERE = os.path.join(os.path.dirname(__file__), "data", "deepspeed")
with open(os.path.join(HERE, "fixtures.json")) as _f:
    FIXTURES = json.load(_f)
MICRO, DS_WORLD = FIXTURES["micro_batch"], FIXTURES["world_size"]
SAVE_AT, CONTINUE = FIXTURES["save_at"], FIXTURES["continue"]
# The data-parallel floor: after the first step zerodp and DeepSpeed differ only in the order the
# gradient is summed (buckets, ranks, accumulation), relative ~1e-7 per step in fp32. bf16 rounds the
# working weights and activations to 8 bits of mantissa, and the two engines reduce in different
# precisions (DeepSpeed bf16 gradients, zerodp fp32 when accumulating): a few bf16 ulps.
FLOOR = {"fp32": 1e-5, "bf16": 2e-2}


def fixture_dir(name: str) -> str:
    return os.path.join(HERE, name)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """make_fixtures.batches: the fixed global batches of DeepSpeed's run, step by step."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(DS_WORLD * MICRO, oracle.D_IN, generator=g),
             5 * torch.randn(DS_WORLD * MICRO, oracle.D_OUT, generator=g)) for _ in range(SAVE_AT + CONTINUE)]


def config(name: str, world: int, stage: int) -> dict:
    ds = FIXTURES["fixtures"][name]["config"]
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": DS_WORLD // world,
           "gradient_clipping": ds["gradient_clipping"], "zero_optimization": {"stage": stage},
           "scheduler": ds["scheduler"]}
    if "bf16" in ds:
        cfg["bf16"] = ds["bf16"]
    return cfg


def make_engine(name: str, world: int, stage: int, hidden: int = 37):
    torch.manual_seed(1)  # other initial weights than DeepSpeed's: everything must come from the checkpoint
    model = oracle.Toy(hidden=hidden, **FIXTURES["fixtures"][name]["model"])
    return zerodp.initialize(model, oracle.two_groups(model), config(name, world, stage))


def resume_run(rank: int, world: int, name: str, stage: int) -> dict:
    """Load fixture `name`, record what was restored, train CONTINUE steps: the global-batch losses."""
    engine = make_engine(name, world, stage)
    client = engine.load_checkpoint(fixture_dir(name))
    loaded = {"pieces": ck.local_state(engine), "steps": (engine.global_steps, engine.skipped_steps),
              "lr": [g["lr"] for g in engine.optimizer.param_groups], "client": client,
              "sched": engine.lr_scheduler.state_dict()["last_epoch"], "scaler": inside(engine).training.scaler.state_dict(),
              "adam_step": [float(engine.optimizer.state[m]["step"]) for m in inside(engine).training.partitioned_optimizer.masters]}
    losses, data = [], batches()
    for step in range(SAVE_AT, SAVE_AT + CONTINUE):
        x, y = data[step]
        total = torch.zeros(())
        for k in range(inside(engine).spec.gas):
            sl = slice((rank * inside(engine).spec.gas + k) * MICRO, (rank * inside(engine).spec.gas + k + 1) * MICRO)
            loss = engine(x[sl], y[sl])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / DS_WORLD)  # the mean over the global batch, as DeepSpeed's record
    return {"loaded": loaded, "losses": losses}


def run_jobs(rank: int, world: int, jobs: list[tuple[str, int]]) -> dict:
    return {job: resume_run(rank, world, *job) for job in jobs}


# Each fixture on 2 ranks at its own stage and at another, and on 1 rank.
JOBS = {2: [("stage1_fp32", 1), ("stage1_fp32", 3), ("stage2_fp32", 2), ("stage2_fp32", 0), ("stage3_fp32", 3),
            ("stage3_fp32", 1), ("stage2_bf16", 2), ("stage2_bf16", 3), ("stage3_bf16", 3),
            ("stage3_bf16", 2), ("stage2_fp32_tied_frozen", 3), ("stage3_fp32_tied_frozen", 2),
            ("stage1_bf16_fp32_accum", 1)],
        1: [("stage1_fp32", 2), ("stage2_fp32", 1), ("stage3_fp32", 3), ("stage2_bf16", 2), ("stage3_bf16", 1),
            ("stage3_fp32_tied_frozen", 1), ("stage1_bf16_fp32_accum", 2)]}
CASES = [(world, job) for world, jobs in JOBS.items() for job in jobs]
IDS = [f"{name}-world={world}-stage={stage}" for world, (name, stage) in CASES]


@functools.cache
def runs() -> dict:
    out = {2: run_ranks(run_jobs, 2, JOBS[2])}
    with world_of_one():
        out[1] = [run_jobs(0, 1, JOBS[1])]
    return out


@pytest.mark.parametrize("world,job", CASES, ids=IDS)
def test_deepspeed_checkpoint_continues_like_deepspeed(world, job):
    name = job[0]
    expected = FIXTURES["fixtures"][name]["losses_after_resume"]
    losses = runs()[world][0][job]["losses"]
    assert losses[0] == expected[0]  # the same weights, the same micro-batches: bit for bit
    assert losses[1:] == pytest.approx(expected[1:], rel=FLOOR[FIXTURES["fixtures"][name]["dtype"][:4]])


def whole(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's master/optimizer pieces put together: 'master/inp.weight' -> the whole fp32 tensor."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for r in per_rank:
        for key, t in r["loaded"]["pieces"].items():
            if key.startswith(("master/", "optim/")):
                name, _, start = key.rpartition("@")
                parts.setdefault(name, {})[int(start)] = t
    return {name: torch.cat([p[s] for s in sorted(p)]) for name, p in parts.items()}


@pytest.mark.parametrize("world,job", CASES, ids=IDS)
def test_deepspeed_optimizer_state_counters_and_schedule_restored(world, job):
    name = job[0]
    fx = FIXTURES["fixtures"][name]
    per_rank = [r[job] for r in runs()[world]]
    state = whole(per_rank)
    for param, kinds in fx["loaded"].items():  # DeepSpeed's own full-tensor view after its load
        for kind, (total, squares) in kinds.items():
            t = state[f"master/{param}" if kind == "master" else f"optim/{kind}/{param}"].double()
            assert t.sum().item() == pytest.approx(total, rel=1e-9, abs=1e-12), (param, kind)
            assert t.square().sum().item() == pytest.approx(squares, rel=1e-9, abs=1e-18), (param, kind)
    for r in per_rank:
        loaded = r["loaded"]
        assert loaded["steps"] == (fx["global_steps"], 0)
        assert loaded["adam_step"] == [float(SAVE_AT)] * len(loaded["adam_step"])
        assert loaded["lr"] == pytest.approx(fx["lr_at_resume"], rel=1e-12)
        # DeepSpeed's WarmupLR position: its last_batch_iteration is one less than the steps taken,
        # zerodp's last_epoch is the steps taken (config/scheduler.py)
        assert loaded["sched"] == fx["lr_scheduler"]["last_batch_iteration"] - CONTINUE + 1 == SAVE_AT
        assert loaded["client"] == {"fixture": name}
        assert loaded["scaler"]["scale"] == 1.0  # fp32 / bf16: DeepSpeed's static scale of 1


def test_consolidate_deepspeed_checkpoint_command(tmp_path, capsys):
    from safetensors.torch import load_file
    out = str(tmp_path / "toy.safetensors")
    ck.main([fixture_dir("stage3_fp32"), out])
    assert "wrote" in capsys.readouterr().out
    state = load_file(out)
    model = oracle.Toy()
    model.load_state_dict(state, strict=True)
    assert list(ck.consolidate(fixture_dir("stage3_fp32"))[0]) == list(model.state_dict())  # module order
    for param, kinds in FIXTURES["fixtures"]["stage3_fp32"]["loaded"].items():
        assert state[param].double().sum().item() == pytest.approx(kinds["master"][0], rel=1e-9)
    # every stage's checkpoint of the same run consolidates to the same weights (up to the order
    # DeepSpeed's stage 3 sums the gradient in)
    for other in ("stage1_fp32", "stage2_fp32"):
        same = ck.consolidate(fixture_dir(other))[0]
        for k in state:
            torch.testing.assert_close(same[k], state[k], rtol=1e-6, atol=1e-7)


def test_consolidate_deepspeed_checkpoint_with_tied_and_frozen_parameters(tmp_path):
    for name in ("stage2_fp32_tied_frozen", "stage3_fp32_tied_frozen"):
        state, ties = ck.consolidate(fixture_dir(name))
        assert ties == {"dec.weight": "enc.weight"}
        assert state["dec.weight"] is state["enc.weight"]
        model = oracle.Toy(tied=True, frozen=True)
        assert list(state) == list(model.state_dict())
        model.load_state_dict(state, strict=True)
        torch.manual_seed(0)  # the DeepSpeed run's initial weights: the frozen one never changed
        assert torch.equal(state["inp.weight"], oracle.Toy(tied=True, frozen=True).inp.weight.detach())


def test_deepspeed_weights_are_made_whole_one_tensor_at_a_time(monkeypatch):
    """`zerodp consolidate` of a DeepSpeed checkpoint streams: nothing is assembled before the writer
    asks, and a tensor is gone once the writer has dropped it (the partitions stay memory-mapped)."""
    import weakref

    made = []
    whole = ck_ds.DeepSpeedCheckpoint.whole
    monkeypatch.setattr(ck_ds.DeepSpeedCheckpoint, "whole",
                        lambda self, kind, name: made.append(name) or whole(self, kind, name))
    tag_dir = ck_ds.find(fixture_dir("stage3_fp32_tied_frozen"))
    weights = ck_ds.weights(tag_dir)
    assert made == [] and weights.ties == {"dec.weight": "enc.weight"}
    previous = None
    for name, value in weights.stream:
        assert previous is None or previous() is None, "the last tensor is still alive"
        previous = weakref.ref(value) if made and made[-1] == name else None  # buffers stay in the checkpoint
        del value
    assert made == [n for n in weights.shapes if n in ck_ds.read(tag_dir).shapes and n not in weights.ties]


def _edited_copy(tmp_path, edit_optim, edit_model=None, ranks=(1,)) -> str:
    """The stage 2 fixture with its files re-saved after `edit_optim(optimizer_state_dict)` (and
    `edit_model(model states)`)."""
    d = str(tmp_path / "edited")
    shutil.copytree(fixture_dir("stage2_fp32"), d)
    for r in ranks:
        f = os.path.join(d, "global_step3", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        sd = ck_ds.torch_load(f)
        # The reader's stand-ins are no DeepSpeed globals: re-saved, they would be refused.
        sd["optimizer_state_dict"].update(zero_stage=2, loss_scaler=None)
        sd["optimizer_state_dict"].pop("param_slice_mappings")
        edit_optim(sd["optimizer_state_dict"])
        torch.save(sd, f)
    if edit_model is not None:
        f = os.path.join(d, "global_step3", "mp_rank_00_model_states.pt")
        sd = ck_ds.torch_load(f)
        edit_model(sd)
        torch.save(sd, f)
    return d


def _evil_copy(tmp_path) -> str:
    """The stage 2 fixture with one optimizer file carrying a pickled call to os.system."""
    return _edited_copy(tmp_path, lambda o: o.update(loss_scaler=_Evil()))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_deepspeed_pickle_with_global_outside_allow_list_is_refused_by_name(tmp_path, monkeypatch):
    d = _evil_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    with world_of_one():
        engine = make_engine("stage2_fp32", 1, 2)
        with pytest.raises(ck.CheckpointError, match=r"posix\.system.*not among the globals a DeepSpeed"):
            engine.load_checkpoint(d)
    with pytest.raises(ck.CheckpointError, match=r"posix\.system"):
        ck.consolidate(d)
    assert not os.path.exists(tmp_path / "PWNED")


def test_fp16_dynamic_loss_scale_restored(tmp_path, monkeypatch):
    """DeepSpeed on this CPU has no fp16, so no fixture has a loss scale to resume: one is written into
    the stage 2 fixture as DeepSpeed pickles it (a DynamicLossScaler object), under its own name."""
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))  # only for pickling it here
    cls = type("DynamicLossScaler", (), {"__module__": "deepspeed.runtime.fp16.loss_scaler"})
    monkeypatch.setattr(sys.modules["deepspeed.runtime.fp16.loss_scaler"], "DynamicLossScaler", cls, raising=False)
    scaler = cls()
    scaler.__dict__.update(cur_scale=1024.0, cur_iter=7, last_overflow_iter=4, scale_factor=2.0, scale_window=2,
                           min_scale=1, delayed_shift=2, cur_hysteresis=1, consecutive_hysteresis=False,
                           raise_error_at_min_scale=True, dynamic=True, dtype=torch.float16)
    d = _edited_copy(tmp_path, lambda o: o.update(loss_scaler=scaler, dynamic_loss_scale=True),
                     lambda m: m["ds_config"].update(fp16={"enabled": True}), ranks=(0, 1))
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler"):
        monkeypatch.delitem(sys.modules, name)  # read as without DeepSpeed
    cfg = {**config("stage2_fp32", 1, 2), "fp16": {"enabled": True, "loss_scale_window": 2, "hysteresis": 2}}
    with world_of_one():
        torch.manual_seed(1)
        model = oracle.Toy()
        engine = zerodp.initialize(model, oracle.two_groups(model), cfg)
        engine.load_checkpoint(d)
        state = inside(engine).training.scaler.state_dict()
    restored = (state["scale"], state["cur_iter"], state["last_overflow_iter"], state["cur_hysteresis"])
    assert restored == (1024.0, 7, 4, 1)
    assert state["dynamic"] and state["window"] == 2


def test_error_directory_neither_zerodp_nor_deepspeed_says_what_was_found(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0")
    (tmp_path / "notes").mkdir()
    with world_of_one():
        engine = make_engine("stage2_fp32", 1, 2)
        with pytest.raises(ck.CheckpointError, match=r"neither a zerodp nor a DeepSpeed checkpoint: found: notes/, "
                                                     r"weights\.bin"):
            engine.load_checkpoint(str(tmp_path))
        (tmp_path / "latest").write_text("notes")
        with pytest.raises(ck.CheckpointError, match=r"neither a zerodp nor a DeepSpeed checkpoint.*it is empty"):
            engine.load_checkpoint(str(tmp_path))


def _sgd(model):
    return torch.optim.SGD([{"params": g["params"]} for g in oracle.two_groups(model).param_groups], lr=0.1)


@pytest.mark.parametrize("change,expected", [
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 6}}}, "was trained with scheduler"),
    ({"scheduler": None}, "has an lr scheduler and the engine has none"),
    ({"optimizer": _sgd}, r"holds Adam state \(exp_avg, exp_avg_sq, step\); the optimizer is SGD"),
], ids=["other_schedule", "no_scheduler", "sgd"])
def test_error_deepspeed_checkpoint_needs_the_same_optimizer_and_schedule(change, expected):
    cfg = {k: v for k, v in {**config("stage2_fp32", 1, 2), **change}.items() if v is not None and k != "optimizer"}
    with world_of_one():
        torch.manual_seed(1)
        model = oracle.Toy()
        engine = zerodp.initialize(model, change.get("optimizer", oracle.two_groups)(model), cfg)
        with pytest.raises(ck.CheckpointError, match=expected):
            engine.load_checkpoint(fixture_dir("stage2_fp32"))


def test_deepspeed_constant_lr_checkpoint_continues_the_engine_schedule_at_its_step(tmp_path):
    def no_scheduler(m):
        m["lr_scheduler"] = None
        del m["ds_config"]["scheduler"]
    d = _edited_copy(tmp_path, lambda o: None, no_scheduler, ranks=(0, 1))
    with world_of_one():
        engine = make_engine("stage2_fp32", 1, 2)  # WarmupLR: 1e-4 -> 1e-2 linearly over 5 steps
        engine.load_checkpoint(d)
        lrs = [g["lr"] for g in engine.optimizer.param_groups]
        assert engine.lr_scheduler.state_dict()["last_epoch"] == engine.global_steps == SAVE_AT
    # optimizer step SAVE_AT runs at DeepSpeed's WarmupLR get_lr(SAVE_AT - 1) (config/scheduler.py)
    assert lrs == pytest.approx([1e-4 + (1e-2 - 1e-4) * (SAVE_AT - 1) / 5] * 2, rel=1e-12)


def test_error_deepspeed_checkpoint_truncated_or_incomplete(tmp_path):
    def shorten(o):
        o["single_partition_of_fp32_groups"][0] = o["single_partition_of_fp32_groups"][0][:-10]
    d = _edited_copy(tmp_path, shorten)
    with pytest.raises(ck.CheckpointError, match=r"rank 1's DeepSpeed partition has 1007 elements, 'out.weight' "
                                                 r"needs 1017"):
        ck.consolidate(d)
    os.remove(os.path.join(d, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with world_of_one():
        engine = make_engine("stage2_fp32", 1, 2)
        with pytest.raises(ck.CheckpointError, match=r"incomplete: no optimizer file for data-parallel rank 1"):
            engine.load_checkpoint(d)


def test_error_deepspeed_checkpoint_of_another_model_names_the_parameter():
    with world_of_one():
        engine = make_engine("stage2_fp32", 1, 2, hidden=38)
        with pytest.raises(ck.CheckpointError, match=r"'inp.weight' has shape \(37, 13\) in the checkpoint and "
                                                     r"\(38, 13\) in the model"):
            engine.load_checkpoint(fixture_dir("stage2_fp32"))


def test_train_resume_from_reads_a_deepspeed_checkpoint(tmp_path):
    """`zerodp train --resume-from` goes through the same reader: the Toy's checkpoint is refused for
    the GPT, naming the difference (a DeepSpeed GPT checkpoint would continue)."""
    proc = test_train.train(*test_train.TINY, "--steps", "1", "--nproc", "1", "--data", test_train.corpus(tmp_path),
                            "--out", str(tmp_path / "run"), "--resume-from", fixture_dir("stage2_fp32"), check=False)
    assert proc.returncode != 0
    assert "DeepSpeed checkpoint" in proc.stderr and "different model" in proc.stderr, proc.stderr[-2000:]


def _corrupt_record(file: str, record: str) -> None:
    """Overwrite the middle of one tensor record of a torch.save zip with 0x67 bytes (floats of ~1e24),
    leaving the file's size and the zip's directory as they were."""
    import zipfile
    with zipfile.ZipFile(file) as z:
        name = next(n for n in z.namelist() if n.endswith(record))
        payload = z.read(name)
    from pathlib import Path
    raw = bytearray(Path(file).read_bytes())
    at = raw.find(payload)
    assert at > 0 and len(payload) >= 64
    raw[at + len(payload) // 2:at + len(payload) // 2 + 32] = b"\x67" * 32
    Path(file).write_bytes(bytes(raw))


def test_error_deepspeed_checkpoint_with_a_corrupted_tensor_record_names_the_file(tmp_path):
    d = str(tmp_path / "flipped")
    shutil.copytree(fixture_dir("stage2_fp32"), d)
    bad = os.path.join(d, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    _corrupt_record(bad, "data/1")
    expected = r"zero_pp_rank_1_mp_rank_00_optim_states\.pt.*fails its CRC-32 check"
    with pytest.raises(ck.CheckpointError, match=expected):
        ck.consolidate(d)
    with world_of_one():
        engine = make_engine("stage2_fp32", 1, 2)
        with pytest.raises(ck.CheckpointError, match=expected):
            engine.load_checkpoint(d)


def test_error_deepspeed_model_states_of_another_shape_than_param_shapes_names_the_file(tmp_path):
    def transpose(model):
        model["module"]["inp.weight"] = model["module"]["inp.weight"].t().contiguous()
    d = _edited_copy(tmp_path, lambda o: None, transpose, ranks=())
    with pytest.raises(ck.CheckpointError, match=r"mp_rank_00_model_states\.pt.*'inp\.weight' has shape \(13, 37\) "
                                                 r"where its param_shapes say \(37, 13\)"):
        ck.consolidate(d)
