"""zerodp.initialize rejects bad input with errors that name what is wrong (world of one, in-process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from oracle import Toy, one_group

CFG = {"train_micro_batch_size_per_gpu": 2}


def test_config_typo_names_key_before_any_process_group_work():
    model = Toy()
    with pytest.raises(zerodp.ConfigError, match=r"zero_optimization\.stge.*did you mean 'stage'"):
        zerodp.initialize(model, one_group(model), {**CFG, "zero_optimization": {"stge": 2}})


def test_optimizer_holding_a_foreign_tensor_is_named():
    model = Toy()
    stray = nn.Parameter(torch.zeros(3, 4))
    opt = torch.optim.AdamW(list(model.parameters()) + [stray])
    with pytest.raises(ValueError, match=r"shape \(3, 4\) that is not a parameter of the model"):
        zerodp.initialize(model, opt, CFG)


def test_trainable_parameter_missing_from_optimizer_is_named():
    model = Toy()
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "mid.bias"])
    with pytest.raises(ValueError, match=r"'mid.bias' requires grad but is in no optimizer param group"):
        zerodp.initialize(model, opt, CFG)


def test_model_on_meta_device_is_rejected_saying_how_to_materialize_it():
    with torch.device("meta"):
        model = Toy()
    with pytest.raises(ValueError, match=r"'meta' device \(first: 'inp.weight'\).*model.to_empty\(device=...\)"):
        zerodp.initialize(model, one_group(model), CFG)


def test_model_with_only_a_meta_buffer_is_rejected():
    model = nn.BatchNorm1d(4)
    model.running_mean = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match=r"first: 'running_mean'"):
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), CFG)


@pytest.mark.parametrize("optimizer", ["instance", "factory"])
def test_model_without_trainable_parameters_is_rejected(optimizer):
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "instance" else \
        (lambda params: torch.optim.SGD(params, lr=0.1))
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters.*set requires_grad=True"):
        zerodp.initialize(model, opt, CFG)


def test_missing_optimizer_says_how_to_give_one():
    with pytest.raises(zerodp.ConfigError, match="no optimizer"):
        zerodp.initialize(Toy(), None, CFG)


def test_optimizer_from_config_section_is_built():
    model = Toy()
    engine = zerodp.initialize(model, None, {**CFG, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                                             "zero_optimization": {"stage": 2}})
    assert isinstance(engine.optimizer, torch.optim.AdamW) and engine.get_lr() == [0.01]


def test_optimizer_factory_is_called_with_the_master_shards():
    model = Toy()
    engine = zerodp.initialize(model, lambda params: torch.optim.SGD(params, lr=0.1), CFG)
    masters = engine.optimizer.param_groups[0]["params"]
    assert all(m.dtype == torch.float32 and m.dim() == 1 for m in masters)


def test_factory_returning_something_else_is_rejected():
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        zerodp.initialize(Toy(), lambda params: object(), CFG)


def test_optimizer_with_state_is_rejected():
    model = Toy()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 13), torch.randn(2, 5)).backward()
    opt.step()
    with pytest.raises(ValueError, match="already has state"):
        zerodp.initialize(model, opt, CFG)


def test_loss_backward_outside_engine_is_an_error():
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), CFG)
    with pytest.raises(RuntimeError, match=r"call engine.backward\(loss\)"):
        engine(torch.randn(2, 13), torch.randn(2, 5)).backward()


def test_step_between_accumulation_boundaries_does_nothing():
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), {**CFG, "gradient_accumulation_steps": 2,
                                                         "zero_optimization": {"stage": 2}})
    before = engine.full_state_dict()
    engine.backward(engine(torch.randn(2, 13), torch.randn(2, 5)))
    engine.step()
    assert engine.global_steps == 0
    assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    engine.backward(engine(torch.randn(2, 13), torch.randn(2, 5)))
    engine.step()
    assert engine.global_steps == 1 and engine.grad_norm > 0


def test_bf16_engine_casts_inputs_and_keeps_fp32_masters():
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), {**CFG, "bf16": {"enabled": True}})
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    loss = engine(torch.randn(2, 13), torch.randn(2, 5))
    engine.backward(loss)
    engine.step()
    assert all(m.dtype == torch.float32 for m in engine.partitioned_optimizer.masters)
    assert all(v.dtype == torch.float32 for v in engine.full_state_dict().values())
