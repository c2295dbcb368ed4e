"""A model that trains nothing is a sharded module, nothing more (issue 40): `zerodp.shard` (and
`zerodp.initialize` with nothing to train) returns a ShardedModule from which no torch optimizer, no reducer,
no loss scaler and no gradient hook can be reached, and which still gathers (its forward equals the whole
model's), exports (full_state_dict, the weights stream) and syncs (weights written through
gathered_parameters(modifier_rank=0), as TRL's reference-model sync does). The engine users hold for training
shows at most 25 public names beyond nn.Module's own. Two gloo ranks at stage 3, and a world of one.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch
from torch import nn

import zerodp
from spawn import run_ranks
from zerodp.engine.engine import Engine, inside
from zerodp.engine.stepping.precision import LossScaler
from zerodp.engine.stepping.reducer import Reducer
from zerodp.engine.sharding.module import ShardedModule

STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
FACE_LIMIT = 25


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Sequential(nn.Linear(128, 128), nn.Tanh()), nn.Linear(128, 4))


def reachable(root: object) -> list[object]:
    """Every object reachable from `root` through attributes, containers, bound methods and closures
    (not through a function's globals, a module or a class, which reach the whole process)."""
    seen, stack, out = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type, torch.Tensor)):
            continue
        seen.add(id(obj))
        out.append(obj)
        if isinstance(obj, types.FunctionType):
            stack += [c.cell_contents for c in obj.__closure__ or () if _filled(c)] + list(obj.__defaults__ or ())
        elif isinstance(obj, types.MethodType):
            stack += [obj.__self__, obj.__func__]
        else:
            stack += gc.get_referents(obj)
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def training_parts(root: object) -> set[str]:
    kinds = (torch.optim.Optimizer, Reducer, LossScaler)
    return {type(o).__name__ for o in reachable(root) if isinstance(o, kinds)}


def _frozen(rank: int, world: int) -> dict:
    model, whole = _model(0).requires_grad_(False), _model(0)
    sharded = zerodp.shard(model, STAGE3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    out = {"type": type(sharded).__name__, "parts": training_parts(sharded),
           "hooks": sum(p._post_accumulate_grad_hooks is not None for p in model.parameters()),
           "frozen_bytes": sharded.memory_report()["frozen_params"],
           "numel": sum(p.numel() for p in whole.parameters()),
           "released": all(p.numel() == 0 for p in model.parameters())}
    with torch.no_grad():
        out["forward"] = (sharded(x) - whole(x)).abs().max().item()
    state = sharded.full_state_dict()
    out["export"] = max((state[n] - p).abs().max().item() for n, p in whole.state_dict().items())
    for call in ("backward", "step"):
        try:
            getattr(sharded, call)(torch.zeros(())) if call == "backward" else sharded.step()
        except RuntimeError as e:
            out[call] = str(e)
    new = _model(1)  # a policy's weights, written into the reference model as TRL's sync does
    with torch.no_grad(), sharded.gathered_parameters(modifier_rank=0):
        for p, q in zip(model.parameters(), new.parameters()):
            p.copy_(q if rank == 0 else torch.full_like(q, float("nan")))  # only rank 0's writes count
    with torch.no_grad():
        out["synced_forward"] = (sharded(x) - new(x)).abs().max().item()
    state = sharded.full_state_dict()
    out["synced_export"] = max((state[n] - p).abs().max().item() for n, p in new.state_dict().items())
    trained = _model(0)
    engine = zerodp.initialize(trained, torch.optim.SGD(trained.parameters(), lr=0.1),
                               {**STAGE3, "train_micro_batch_size_per_gpu": 4})
    out["engine_parts"] = training_parts(engine)  # the walk finds them where they exist
    return out


@pytest.fixture(scope="module")
def frozen_ranks() -> list[dict]:
    return run_ranks(_frozen, 2)


def test_a_frozen_model_at_stage_3_holds_no_optimizer_reducer_or_loss_scaler(frozen_ranks):
    for r in frozen_ranks:
        assert r["type"] == "ShardedModule"
        assert r["parts"] == set(), r["parts"]
        assert r["hooks"] == 0
        assert r["engine_parts"] >= {"SGD", "Reducer", "LossScaler"}


def test_a_frozen_model_gathers_exports_and_holds_one_nth(frozen_ranks):
    for r in frozen_ranks:
        assert r["released"]  # between forwards each parameter is an empty tensor: the shard is elsewhere
        assert r["forward"] == 0.0 and r["export"] == 0.0
        assert r["numel"] * 4 / 2 <= r["frozen_bytes"] < r["numel"] * 4 / 2 * 1.1


def test_weights_written_into_a_frozen_model_are_rank_0s_everywhere(frozen_ranks):
    for r in frozen_ranks:
        assert r["synced_forward"] == 0.0 and r["synced_export"] == 0.0


def test_a_frozen_model_refuses_backward_and_step_by_name(frozen_ranks):
    for r in frozen_ranks:
        assert "nothing to train" in r["backward"] and "requires_grad=False" in r["backward"]
        assert "step()" in r["step"]


def test_initialize_with_nothing_to_train_returns_the_sharded_module():
    model = _model(0).requires_grad_(False)
    wrapped = zerodp.initialize(model, None, STAGE3)
    assert isinstance(wrapped, ShardedModule) and inside(wrapped).training is None


@pytest.mark.parametrize("why", ["requires_grad", "optimizer"])
def test_shard_refuses_a_model_that_would_train(why):
    model = _model(0)
    config = dict(STAGE3)
    if why == "optimizer":
        model.requires_grad_(False)
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    with pytest.raises(ValueError, match="zerodp.shard wraps a model that trains nothing"):
        zerodp.shard(model, config)


def public_names(x: object) -> set[str]:
    """Public names of x (its class's and its own attributes) that nn.Module does not have."""
    module = set(dir(nn.Module)) | set(vars(nn.Module()))
    return {n for n in set(dir(type(x))) | set(vars(x)) if not n.startswith("_")} - module


@pytest.mark.parametrize("stage", [0, 3])
def test_the_engine_users_hold_shows_at_most_25_public_names(stage):
    model = _model(0)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}})
    assert isinstance(engine, Engine)
    names = public_names(engine)
    assert len(names) <= FACE_LIMIT, sorted(names)
    # DeepSpeed's face, which scripts call: still there
    assert {"backward", "step", "save_checkpoint", "load_checkpoint", "gathered_parameters", "memory_report", "device",
            "module", "optimizer", "lr_scheduler", "global_steps", "get_lr"} <= names


def test_the_face_count_sees_an_attribute_added_to_an_engine():
    model = _model(0)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"train_micro_batch_size_per_gpu": 2})
    before = public_names(engine)
    engine.extra = 1  # a planted public attribute is counted
    assert public_names(engine) == before | {"extra"}
