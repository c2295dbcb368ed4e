"""zerodp.initialize rejects bad input with errors that name what is wrong (world of one, in-process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from zerodp.engine.engine import inside
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


def test_model_on_meta_with_a_parameter_nothing_can_initialise_names_it_and_says_how():
    with torch.device("meta"):
        model = Toy(tied=True)  # TiedPair makes its weight in __init__ and has no reset_parameters()
    with pytest.raises(ValueError, match=r"'meta' device and nothing can initialise 'pair.w'.*"
                                         r"reset_parameters\(\).*param_init_fn"):
        zerodp.initialize(model, one_group(model), CFG)


class _Table(nn.Module):
    """A computed buffer and no reset_parameters(): on meta, nothing can fill it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def test_meta_buffer_nothing_can_initialise_is_named():
    with torch.device("meta"):
        model = _Table()
    with pytest.raises(ValueError, match=r"nothing can initialise 'table'"):
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), CFG)


def test_meta_buffer_is_filled_by_param_init_fn():
    def init(m):
        if isinstance(m, _Table):
            m.table = torch.arange(4.0)
        else:
            m.reset_parameters()
    with torch.device("meta"):
        model = _Table()
    zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), CFG, param_init_fn=init)
    assert torch.equal(model.table, torch.arange(4.0)) and not model.lin.weight.is_meta


def test_meta_batchnorm_statistics_come_from_reset_parameters():
    with torch.device("meta"):
        model = nn.BatchNorm1d(4)
    zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), CFG)
    assert torch.equal(model.running_mean, torch.zeros(4)) and torch.equal(model.running_var, torch.ones(4))
    assert int(model.num_batches_tracked) == 0


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


def test_an_optimizer_that_has_stepped_brings_its_state_onto_the_shards():
    """A DDP script's resume loads the optimizer's state before wrapping (nanoGPT): initialize keeps it."""
    model = Toy()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 13), torch.randn(2, 5)).backward()
    opt.step()
    before = opt.state_dict()
    engine = zerodp.initialize(model, opt, CFG)
    after = engine.optimizer.state_dict()
    assert after["state"].keys() == before["state"].keys() and after["state"]
    for i, state in before["state"].items():
        for key, v in state.items():
            assert torch.equal(after["state"][i][key], v), (i, key)


def test_loss_backward_outside_engine_is_an_error():
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), CFG)
    with pytest.raises(RuntimeError, match=r"call engine.backward\(loss\)"):
        engine(torch.randn(2, 13), torch.randn(2, 5)).backward()


@pytest.mark.parametrize("stage", [0, 3])
def test_users_own_optimizer_step_is_an_error_naming_engine_step(stage):
    model = Toy()
    opt = one_group(model)
    engine = zerodp.initialize(model, opt, {**CFG, "zero_optimization": {"stage": stage}})
    engine.backward(engine(torch.randn(2, 13), torch.randn(2, 5)))
    with pytest.raises(RuntimeError, match=r"call engine.step\(\)"):
        opt.step()  # the usual port of a PyTorch loop: it would step nothing
    before = engine.full_state_dict()
    engine.step()  # the engine's own step still runs the same optimizer
    assert engine.global_steps == 1
    assert any(not torch.equal(before[k], v) for k, v in engine.full_state_dict().items())


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
    assert all(m.dtype == torch.float32 for m in inside(engine).training.partitioned_optimizer.masters)
    assert all(v.dtype == torch.float32 for v in engine.full_state_dict().values())


def _rng_states() -> tuple:
    import random

    import numpy as np
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _same_rng_states(a: tuple, b: tuple) -> bool:
    import numpy as np
    (ta, pa, na), (tb, pb, nb) = a, b
    return (torch.equal(ta, tb) and pa == pb and na[0] == nb[0] and np.array_equal(na[1], nb[1])
            and na[2:] == nb[2:])


def _set_up_leaves_rng(rank: int, world: int) -> dict[str, bool]:
    """Every RNG as initialize() found it, for each working precision, and the bf16 probe itself."""
    from zerodp.engine.stepping.cpu_bf16 import bf16_slowdown
    out = {}
    for dtype in ("fp32", "bf16", "fp16"):
        torch.manual_seed(1234)
        model = Toy()
        before = _rng_states()
        cfg = {**CFG, "zero_optimization": {"stage": 3 if dtype == "fp16" else 2}}
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True}
        zerodp.initialize(model, one_group(model), cfg)
        out[dtype] = _same_rng_states(before, _rng_states())
    before = _rng_states()
    bf16_slowdown()  # the probe rank 0 runs once per process: whether it ran above depends on the order
    out["probe"] = _same_rng_states(before, _rng_states())
    return out


def test_set_up_leaves_every_random_generator_as_it_found_it_on_every_rank():
    from spawn import run_ranks
    for rank, result in enumerate(run_ranks(_set_up_leaves_rng, 2)):  # rank 0 alone ran the bf16 probe
        assert all(result.values()), f"rank {rank}: generators changed by set-up: {result}"


@pytest.mark.parametrize("api", ["zerodp", "zerodp.deepspeed"])
def test_set_up_says_stage_offload_and_dtype_at_info(api, caplog):
    import zerodp.deepspeed
    model = Toy()
    cfg = {**CFG, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True}}
    with caplog.at_level("INFO", logger="zerodp"):
        if api == "zerodp":
            zerodp.initialize(model, one_group(model), cfg)
        else:
            zerodp.deepspeed.initialize(model=model, optimizer=one_group(model), config=cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "zerodp" and r.levelname == "INFO"]
    assert lines == [("zerodp: ZeRO stage 2 (optimizer state and gradients sharded over 1 of 1 ranks); offload: "
                      "optimizer to cpu; dtype bf16; batch 2 per rank x 1 accumulation x 1 ranks = 2")]


def test_hugging_face_model_from_config_on_meta_initialises_with_its_own_init_weights():
    """HF layers (Conv1D, RMSNorm) have no reset_parameters(): HF's own `_init_weights(module)` is the
    default param_init_fn of a PreTrainedModel; it also fills the rotary tables (non-persistent buffers)
    as the whole build does."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    whole = transformers.AutoModelForCausalLM.from_config(config)
    states = []
    for explicit in (False, True):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        torch.manual_seed(0)
        engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), CFG,
                                   **({"param_init_fn": model._init_weights} if explicit else {}))
        states.append(engine.full_state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])  # the default is HF's own
    for name, b in whole.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], b), name
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    x = torch.randint(0, 300, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()


def test_param_init_fn_for_a_model_not_on_meta_is_refused():
    model = Toy()
    with pytest.raises(ValueError, match=r"param_init_fn initialises a model built on the 'meta' device"):
        zerodp.initialize(model, one_group(model), CFG, param_init_fn=lambda m: None)
