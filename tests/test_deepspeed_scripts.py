"""DeepSpeed scripts as people write them run on zerodp.deepspeed when `deepspeed` is replaced by
`zerodp.deepspeed` in their import lines, and nothing else: the accelerator, deepspeed.comm,
deepspeed.utils (logger, log_dist, zero_to_fp32) and the engine's rank properties included."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch
from torch.utils.data import DistributedSampler

import zerodp
from zerodp.config import load_config
from spawn import run_ranks

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
WORLD = 2
CIFAR_CONFIG = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 2000,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 300, "overlap_comm": True},
}
BERT_CONFIG = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 2, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def port(name: str, out_dir: str) -> str:
    """The script with `deepspeed` replaced by `zerodp.deepspeed` in its import lines, and only there."""
    with open(os.path.join(SCRIPTS, name), encoding="utf-8") as f:
        source = f.read()
    source = re.sub(r"^import deepspeed$", "import zerodp.deepspeed as deepspeed", source, flags=re.M)
    source = re.sub(r"^from deepspeed([ .])", r"from zerodp.deepspeed\1", source, flags=re.M)
    path = os.path.join(out_dir, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    return path


def load(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_both_scripts(rank: int, world: int, tmp: str) -> dict:
    cifar, bert = load(os.path.join(tmp, "ds_cifar.py")), load(os.path.join(tmp, "ds_bert.py"))
    return {"cifar": cifar.main(["--deepspeed", "--deepspeed_config", os.path.join(tmp, "cifar.json")]),
            "bert": bert.main(["--deepspeed_config", os.path.join(tmp, "bert.json"),
                               "--checkpoint_dir", os.path.join(tmp, "ckpt")])}


def _reference(model: torch.nn.Module, config: dict, data, steps_of: int, forward) -> tuple[list[float], dict]:
    """One process, the whole batch of every rank and micro-step at once (the oracle)."""
    cfg = load_config(config)
    opt = cfg.optimizer.build(list(model.parameters()))
    sched = cfg.scheduler.build(opt) if cfg.scheduler is not None else None
    order = list(DistributedSampler(data, num_replicas=1, rank=0, seed=0))
    losses = []
    for start in range(0, len(order), steps_of):
        batch = data[order[start:start + steps_of]]
        loss = forward(model, *batch)
        loss.backward()
        if cfg.gradient_clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clipping)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _per_step(ranks: list[list[float]], micro_per_step: int) -> list[float]:
    """The mean of every rank's micro-batch losses in each optimizer step."""
    steps = len(ranks[0]) // micro_per_step
    return [sum(sum(r[s * micro_per_step:(s + 1) * micro_per_step]) for r in ranks) / (len(ranks) * micro_per_step)
            for s in range(steps)]


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ds_scripts"))
    for name in ("ds_cifar.py", "ds_bert.py"):
        port(name, tmp)
    for name, cfg in (("cifar.json", CIFAR_CONFIG), ("bert.json", BERT_CONFIG)):
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(cfg, f)
    return tmp, run_ranks(_run_both_scripts, WORLD, tmp)


def test_the_port_changes_import_lines_only(tmp_path):
    for name in ("ds_cifar.py", "ds_bert.py"):
        with open(os.path.join(SCRIPTS, name)) as f:
            before = f.read().splitlines()
        with open(port(name, str(tmp_path))) as f:
            after = f.read().splitlines()
        changed = [(a, b) for a, b in zip(before, after) if a != b]
        assert len(before) == len(after) and changed
        assert all(a.startswith(("import deepspeed", "from deepspeed")) for a, _ in changed), changed


def test_cifar_script_with_only_its_imports_ported_matches_one_process_on_two_ranks(script_runs):
    tmp, runs = script_runs
    cifar = load(os.path.join(tmp, "ds_cifar.py"))
    torch.manual_seed(42)
    losses, _ = _reference(cifar.Net(), CIFAR_CONFIG, cifar.trainset(), 8,
                           lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))
    got = _per_step([r["cifar"]["losses"] for r in runs], 1)
    assert len(got) == len(losses) == 8
    assert max(abs(a - b) for a, b in zip(got, losses)) < 1e-6, (got, losses)
    for rank, r in enumerate(runs):
        c = r["cifar"]
        assert (c["rank"], c["global_rank"], c["world_size"]) == (rank, rank, WORLD)
        assert (c["device"], c["backend"]) == ("cpu", "gloo")
        assert c["mean_last"] == pytest.approx(sum(x["cifar"]["losses"][-1] for x in runs) / WORLD, abs=1e-6)


def test_bert_script_at_stage_3_matches_one_process_and_its_zero_to_fp32_weights_too(script_runs):
    tmp, runs = script_runs
    bert = load(os.path.join(tmp, "ds_bert.py"))
    torch.manual_seed(7)
    model = bert.BertMLM()
    losses, weights = _reference(model, BERT_CONFIG, bert.masked_corpus(), 8, lambda m, x, y: m(x, y))
    got = _per_step([r["bert"]["losses"] for r in runs], 2)
    assert len(got) == len(losses) == 4 and runs[0]["bert"]["steps"] == 4
    assert max(abs(a - b) for a, b in zip(got, losses)) < 1e-6, (got, losses)
    fp32 = runs[0]["bert"]["weights"]
    assert set(fp32) == set(weights)
    worst = max((fp32[k] - weights[k]).abs().max().item() for k in weights)
    print(f"zero_to_fp32 weights vs one process: {worst:.2e}")
    assert worst < 1e-5
    assert runs[0]["bert"]["saved"] == ["final", "latest"]


def test_engine_knows_its_global_rank_local_rank_and_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = torch.nn.Linear(3, 2)
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {"train_micro_batch_size_per_gpu": 1})
    assert (engine.global_rank, engine.local_rank, engine.world_size) == (0, 0, 1)


def test_accelerator_answers_for_the_cpu_as_deepspeeds_cpu_accelerator():
    from zerodp.deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc is get_accelerator()
    if torch.accelerator.is_available():
        pytest.skip("a GPU machine: the CPU answers are checked where there is none")
    assert (acc.device_name(), acc.device_name(0), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.device_count() == 1
    assert acc.is_bf16_supported() and not acc.is_fp16_supported()
    state = torch.get_rng_state()
    acc.manual_seed(5)
    a = torch.rand(3)
    acc.manual_seed(5)
    assert torch.equal(a, torch.rand(3))
    torch.set_rng_state(state)
    acc.synchronize()
    assert acc.on_accelerator(torch.zeros(1)) and not acc.is_pinned(torch.zeros(1))


def test_deepspeed_moe_is_refused_on_import_with_the_reason():
    with pytest.raises(ImportError, match="mixture of experts.*data parallel only"):
        import zerodp.deepspeed.moe  # noqa: F401
