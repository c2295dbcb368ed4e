"""`import zerodp.deepspeed as deepspeed` runs a DeepSpeed ZeRO script unchanged."""

from __future__ import annotations

import argparse
import gc
import json
import os
import weakref

import pytest
import torch
from torch import nn

import zerodp.deepspeed as deepspeed
from oracle import Toy
from scripts import ds_train
from spawn import run_ranks

# DeepSpeedExamples' training/cifar ds_config.json, with a short linear warmup so the lr moves.
SCRIPT_CONFIG = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 2000,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 4, "warmup_type": "linear"}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 200, "overlap_comm": True,
                          "contiguous_gradients": True},
}
MICRO = {"train_micro_batch_size_per_gpu": 4}


class SelfInitialised(nn.Module):
    """A model as DeepSpeed's tests and HF build it: its constructor sets its values (its layers'
    reset_parameters, then self.apply(self._init_weights) through `.data` and nn.init, a trunc_normal_, fills)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(17, 8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 5)
        self.norm = nn.LayerNorm(16)
        self.apply(self._init_weights)
        self.fc2.bias.data.fill_(0.25)
        with torch.no_grad():
            self.norm.weight.fill_(2.0)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(mean=0.0, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.trunc_normal_(m.weight, std=0.1)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(self.emb(x))))).float().pow(2).mean()


def _constructor_values_under_zero_init(rank: int) -> dict:
    """DeepSpeed's zero.Init at stage 3: the values the constructor set are what trains (rank 0's: a
    whole build's with the same seed), module by module."""
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = SelfInitialised()
    engine, *_ = deepspeed.initialize(model=model, config={**MICRO, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.backward(engine(torch.arange(4 * rank, 4 * rank + 4).view(4, 1)))
    engine.step()
    return {"kept": kept}


def _both_scripts_and_zero_features(rank: int, world: int, tmp: str) -> dict:
    path = os.path.join(tmp, "ds_config.json")
    if rank == 0:
        with open(path, "w") as f:
            json.dump(SCRIPT_CONFIG, f)
    torch.distributed.barrier()
    out = {"deepspeed": ds_train.main(deepspeed, ["--deepspeed", "--deepspeed_config", path],
                                      os.path.join(tmp, "ckpt")),
           "zerodp": ds_train.zerodp_main(SCRIPT_CONFIG)}
    # zero.GatheredParameters, stage 3: whole inside; rank 1's write is every rank's weight after.
    torch.manual_seed(0)
    model = Toy()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config={**MICRO, "zero_optimization": {
                                          "stage": 3, "stage3_param_persistence_threshold": 0}})
    out["released_numel"] = model.mid.weight.numel()
    with deepspeed.zero.GatheredParameters(model.mid.weight, modifier_rank=1):
        out["gathered_shape"] = tuple(model.mid.weight.shape)
        with torch.no_grad():
            model.mid.weight.fill_(float(rank + 1))
    x, y = torch.ones(4, 13), torch.zeros(4, 5)
    engine.backward(engine(x, y))
    engine.step()  # SGD: the update starts from the kept weight 2.0 on every rank
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["mid_after_step"] = model.mid.weight.detach().clone()
    out.update(_release_then_destroy(engine, model, x, y))
    out.update(_constructor_values_under_zero_init(rank))
    return out


def _release_then_destroy(engine, model, x, y) -> dict:
    """DeepSpeed's tests' ending, and its zero3 docs' empty_partition_cache, at stage 3."""
    out = {}
    held = engine(x, y)  # a forward whose backward never comes: its parameters stay gathered for it
    out["before"] = {p.ds_status.name for p in model.parameters()}
    engine.empty_partition_cache()
    out["after"] = {p.ds_status.name for p in model.parameters()}
    del held
    engine.backward(engine(x, y))  # training goes on: the next forward gathers what it needs
    engine.step()
    inner = weakref.ref(engine.engine)
    engine.destroy()
    out["hooks"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_pre_hooks)
                       + len(m._state_dict_hooks) for m in model.modules())
    out["grad_hooks"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    try:
        engine.step()
    except RuntimeError as e:
        out["after_destroy"] = str(e)
    del engine
    gc.collect()
    out["engine_freed"] = inner() is None  # the model, still held here, no longer keeps the engine alive
    return out


def test_deepspeed_script_with_only_its_import_changed_matches_zerodp_initialize_on_two_ranks(tmp_path):
    results = run_ranks(_both_scripts_and_zero_features, 2, str(tmp_path), timeout_s=60)
    for r in results:
        ds, native = r["deepspeed"], r["zerodp"]
        assert len(ds) == 8 + 2 and ds[-2] == 4  # 2 epochs of 32 samples: 2 ranks x 4 x 2 micro-steps a step
        assert ds == pytest.approx(native, abs=1e-6, rel=0)
        assert ds[-1] > 0  # the config's WarmupLR is stepped
        assert r["released_numel"] == 0 and r["gathered_shape"] == (37, 37)
    assert results[0]["deepspeed"][:8] != results[1]["deepspeed"][:8]  # each rank saw its own data
    mid0, mid1 = results[0]["mid_after_step"], results[1]["mid_after_step"]
    assert torch.equal(mid0, mid1) and (mid0 - 2.0).abs().max() < 0.5 and (mid0 != 2.0).any()
    for r in results:  # empty_partition_cache and destroy, as DeepSpeed's tests and zero3 docs call them
        assert r["before"] == {"AVAILABLE"} and r["after"] == {"NOT_AVAILABLE"}
        assert r["hooks"] == 0 and r["grad_hooks"] == 0 and r["engine_freed"]
        assert "destroyed (engine.destroy())" in r["after_destroy"]
    torch.manual_seed(0)
    whole = dict(SelfInitialised().named_parameters())
    for r in results:  # the constructor's values, not reset_parameters' (fc2.bias 0.25, norm.weight 2.0)
        assert r["kept"].keys() == whole.keys()
        assert all(torch.equal(r["kept"][n], whole[n].detach()) for n in whole)


# ---- initialize: DeepSpeed's arguments and 4-tuple (world of one, in-process) --------------------
def _batches(n: int = 2):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 13, generator=g), torch.randn(4, 5, generator=g)) for _ in range(n)]


def _train(engine, n: int = 2) -> list[float]:
    losses = []
    for x, y in _batches(n):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_initialize_returns_engine_optimizer_loader_scheduler_built_from_the_config_sections():
    model = Toy()
    data = torch.utils.data.TensorDataset(torch.randn(10, 13), torch.randn(10, 5))
    engine, opt, loader, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                      training_data=data, config={
        **MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}})
    assert isinstance(opt, torch.optim.AdamW) and opt is engine.optimizer
    assert sched is engine.lr_scheduler and sched is not None
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler) and loader.batch_size == 4
    assert engine.module is model and engine.train_batch_size() == 4 and engine.gradient_accumulation_steps() == 1
    assert (engine.global_rank, engine.world_size, engine.local_rank) == (0, 1, 0)
    assert engine.zero_optimization_stage() == 0 and engine.train_micro_batch_size_per_gpu() == 4
    _train(engine)
    assert engine.global_steps == 2 and engine.get_global_grad_norm() > 0 and engine.was_step_applied()
    assert 0 < engine.get_lr()[0] < 0.01  # warming up


def test_param_groups_of_model_parameters_keep_their_own_hyperparameters():
    model = Toy()
    groups = [{"params": [model.inp.weight, model.mid.weight, model.out.weight], "weight_decay": 0.5},
              {"params": [p for n, p in model.named_parameters() if "weight" not in n or "norm" in n],
               "weight_decay": 0.0}]
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config={
        **MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}})
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]


@pytest.mark.parametrize("form", ["object", "callable"])
def test_scheduler_given_as_an_object_or_a_callable_is_stepped_by_the_engine(form):
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if form == "object" else \
        (lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))
    engine, _, _, returned = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=MICRO)
    _train(engine)
    assert engine.get_lr() == [0.25] and returned is engine.lr_scheduler


def test_scheduler_object_on_another_optimizer_is_refused():
    model = Toy()
    other = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="built on another optimizer"):
        deepspeed.initialize(model=model, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1), config={
            **MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def test_args_deepspeed_config_is_read_and_a_second_config_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, opt, _, _ = deepspeed.initialize(args=args, model=Toy())
    assert isinstance(opt, torch.optim.SGD) and engine.train_micro_batch_size_per_gpu() == 4
    with pytest.raises(ValueError, match="both as args.deepspeed_config and as config="):
        deepspeed.initialize(args=args, model=Toy(), config=MICRO)
    with pytest.raises(ValueError, match="requires --deepspeed_config"):
        deepspeed.initialize(model=Toy())


def test_optimizer_factory_is_called_on_model_parameters():
    model = Toy()
    seen = []
    factory = lambda params: seen.append(params) or torch.optim.SGD(params, lr=0.1)  # noqa: E731
    groups = [{"params": list(model.parameters()), "momentum": 0.5}]
    _, opt, _, _ = deepspeed.initialize(model=model, optimizer=factory, model_parameters=groups, config=MICRO)
    assert seen == [groups] and opt.param_groups[0]["momentum"] == 0.5


# ---- the engine's DeepSpeed methods ---------------------------------------------------------------
def _engine(stage: int = 0, **cfg):
    torch.manual_seed(0)
    model = Toy()
    config = {**MICRO, "zero_optimization": {"stage": stage}, **cfg,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}}
    return deepspeed.initialize(model=model, config=config)[0]


def test_ds_persist_says_which_stage_3_parameters_stay_whole_as_deepspeeds_partition_cache_test_reads_it():
    """DeepSpeed's TestZeroPartitionCache sums p.numel() over the parameters with p.ds_persist."""
    for threshold, persist in ((0, False), (10 ** 6, True)):
        engine = _engine(3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": threshold})
        engine.backward(engine(*_batches(1)[0]))
        engine.step()
        assert {p.ds_persist for p in engine.module.parameters()} == {persist}
        persist_param_size = sum(p.numel() for p in engine.module.parameters() if p.ds_persist)
        assert persist_param_size == sum(p.numel() for p in engine.module.parameters()) * persist
        assert persist_param_size == sum(p.ds_numel for p in engine.module.parameters()) * persist
        engine.destroy()


def test_load_checkpoint_returns_path_and_client_state_and_none_when_there_is_none(tmp_path):
    engine = _engine()
    _train(engine)
    assert engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3}) is True
    fresh = _engine()
    path, client = fresh.load_checkpoint(str(tmp_path))
    assert path == os.path.join(str(tmp_path), "global_step2") and client == {"epoch": 3}
    assert fresh.global_steps == 2 and fresh.get_lr() == engine.get_lr()
    assert _train(fresh) == _train(engine)
    with pytest.warns(UserWarning, match="Unable to find latest file"):
        assert fresh.load_checkpoint(str(tmp_path / "empty")) == (None, None)


def test_load_module_only_and_without_optimizer_or_scheduler_states(tmp_path):
    engine = _engine()
    _train(engine)
    engine.save_checkpoint(str(tmp_path))
    weights = engine.full_state_dict()
    only = _engine()
    only.load_checkpoint(str(tmp_path), load_module_only=True)
    assert only.global_steps == 0 and not only.optimizer.state and only.get_lr() != engine.get_lr()
    assert all(torch.equal(v, weights[k]) for k, v in only.full_state_dict().items())
    no_opt = _engine()
    no_opt.load_checkpoint(str(tmp_path), load_optimizer_states=False, load_lr_scheduler_states=False)
    assert no_opt.global_steps == 2 and not no_opt.optimizer.state and no_opt.get_lr() != engine.get_lr()


def test_save_16bit_model_writes_the_working_precision_weights_on_rank_0(tmp_path):
    engine = _engine(bf16={"enabled": True})
    _train(engine)
    assert engine.save_16bit_model(str(tmp_path), "model.bin") is True
    saved = torch.load(tmp_path / "model.bin")
    assert saved["mid.weight"].dtype == torch.bfloat16
    assert torch.equal(saved["mid.weight"], engine.full_state_dict()["mid.weight"].bfloat16())


def test_save_16bit_model_at_stage_3_needs_the_gather_key_as_deepspeed(tmp_path):
    with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save"):
        assert _engine(3).save_16bit_model(str(tmp_path)) is False
    engine = _engine(3, zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    assert engine.save_16bit_model(str(tmp_path)) is True and (tmp_path / "pytorch_model.bin").exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_at_stage_2_and_3_raises_deepspeeds_reason(stage):
    with pytest.raises(AssertionError, match=f"incompatible with gradient partitioning logic of ZeRO stage {stage}"):
        with _engine(stage).no_sync():
            pass


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_backward_adds_to_the_next_reduced_backward(stage):
    (x1, y1), (x2, y2) = _batches()
    synced, summed = _engine(stage), _engine(stage)
    with synced.no_sync():
        synced.backward(synced(x1, y1))
        with pytest.raises(RuntimeError, match="inside no_sync"):
            synced.step()
    synced.backward(synced(x2, y2))
    synced.step()
    summed.backward(summed(x1, y1) + summed(x2, y2))
    summed.step()
    with synced.no_sync():
        synced.backward(synced(x1, y1))
    with pytest.raises(RuntimeError, match="no backward\\(\\) outside it has reduced yet"):
        synced.step()
    assert synced.get_global_grad_norm() == pytest.approx(summed.get_global_grad_norm(), rel=1e-6)
    for k, v in synced.full_state_dict().items():
        assert torch.allclose(v, summed.full_state_dict()[k], atol=1e-6), k


def test_gathered_parameters_is_a_no_op_for_parameters_of_no_engine():
    model = Toy()
    with deepspeed.zero.GatheredParameters(model.parameters(), modifier_rank=0):
        assert model.mid.weight.shape == (37, 37)


def test_gathered_parameters_modifier_keeps_the_other_parameters_fp32_masters():
    engine = _engine(1, bf16={"enabled": True})
    _train(engine)
    before = engine.full_state_dict()
    with deepspeed.zero.GatheredParameters([engine.module.out.bias], modifier_rank=0), torch.no_grad():
        engine.module.out.bias.fill_(0.25)
    after = engine.full_state_dict()
    assert torch.equal(after["out.bias"], torch.full((5,), 0.25))
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != "out.bias")


def test_zero_init_builds_on_meta_and_initialize_materialises_the_whole_builds_values():
    from zerodp.models.gpt import GPT, gpt_config
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = GPT(gpt_config("tiny"))
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="meta device.*hold no values until deepspeed.initialize"):
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            pass
    engine, *_ = deepspeed.initialize(model=model, config={**MICRO, "zero_optimization": {"stage": 3},
                                                           "optimizer": {"type": "AdamW", "params": {}}})
    torch.manual_seed(0)
    whole = GPT(gpt_config("tiny"))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters()))
    x = torch.randint(0, 256, (4, 16))
    engine.backward(engine(x, x))
    engine.step()
    with deepspeed.zero.Init(enabled=False):
        assert not any(p.is_meta for p in Toy().parameters())


class _WritesThroughAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        with torch.no_grad():
            self.lin.weight[0].fill_(1.0)  # one row: a view, which zero.Init cannot replay


class _DrawsOnMeta(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.randn(3))


@pytest.mark.parametrize("model, says", [(_WritesThroughAView, "module 'lin': 'weight'.*wrote through a view"),
                                         (_DrawsOnMeta, "drew randn of shape \\(3,\\) on the meta device")])
def test_zero_init_refuses_constructor_values_it_cannot_keep_naming_them(model, says):
    with deepspeed.zero.Init():
        built = model()
    with pytest.raises(ValueError, match=says):
        deepspeed.initialize(model=built, config={**MICRO, "zero_optimization": {"stage": 3},
                                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
