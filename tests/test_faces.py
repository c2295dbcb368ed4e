"""zerodp.engine.faces: the engine as a framework's model, optimizer and scheduler, and the one no_sync rule
(world of one, in-process; tests/test_hf_trainer.py and tests/test_lightning.py run them under the real
Trainer, Lightning and Fabric against DDP and plain torch)."""

from __future__ import annotations

import pytest
import torch

import zerodp
from oracle import D_IN, D_OUT, Toy
from zerodp.engine.engine import inside
from zerodp.engine.faces import EngineModule, EngineOptimizer, EngineScheduler, deferred_reduction


def _engine(stage: int = 2, halving: bool = False):
    torch.manual_seed(0)
    model = Toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)) if halving else None
    return zerodp.initialize(model, optimizer, {"train_micro_batch_size_per_gpu": 2,
                                                "zero_optimization": {"stage": stage}}, lr_scheduler=schedule)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, D_IN, generator=g), torch.randn(2, D_OUT, generator=g)


def test_the_module_face_runs_the_engine_and_names_the_users_model():
    engine = _engine()
    face = EngineModule(engine.module, engine)
    assert torch.equal(face(*_batch()), engine(*_batch()))
    assert face._get_name() == "Toy" and face.module is engine.module
    with face.no_sync():  # DDP's, as a loop calls it on its model: the engine's deferred reduction
        assert inside(engine).training.in_no_sync is False  # stage 2 keeps a gradient shard: nothing to defer
    waiting = EngineModule(engine.module, not_built="fabric.forward() before the optimizer is set up")
    with pytest.raises(RuntimeError, match="before the optimizer is set up"):
        waiting(*_batch())


def test_the_optimizer_face_steps_the_engine_after_its_closure():
    engine = _engine()
    face = EngineOptimizer(engine)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}

    def closure():
        loss = engine(*_batch())
        engine.backward(loss)
        return loss

    loss = face.step(closure)
    assert torch.is_tensor(loss) and engine.global_steps == 1
    assert any(not torch.equal(before[k], v) for k, v in engine.module.state_dict().items())  # it updated
    assert face.param_groups is engine.optimizer.param_groups and face.last_lr is None  # no lr read without a scheduler face
    assert face.state_dict() == {}
    with pytest.raises(ValueError, match="restored from its sharded checkpoint"):
        face.load_state_dict({"state": {0: {}}})


def test_the_scheduler_face_reports_the_lr_of_the_last_update():
    engine = _engine(halving=True)
    optimizer = EngineOptimizer(engine)
    scheduler = EngineScheduler(optimizer)
    assert scheduler.get_last_lr() == [1.0]
    for lr in (1.0, 0.5):
        engine.backward(engine(*_batch()))
        optimizer.step()
        scheduler.step()  # the engine stepped the real one already: nothing more
        assert scheduler.get_last_lr() == [lr] and engine.get_lr() == [lr / 2]


@pytest.mark.parametrize("stage, defers", [(1, True), (2, False)])
def test_deferred_reduction_is_no_sync_where_the_engine_keeps_whole_gradients(stage, defers):
    engine = _engine(stage)
    with deferred_reduction(engine):
        assert inside(engine).training.in_no_sync is defers
        engine.backward(engine(*_batch()))
    with EngineModule(engine.module, engine).no_sync():
        assert inside(engine).training.in_no_sync is defers
    engine.backward(engine(*_batch()))
    engine.step()
    assert engine.global_steps == 1
