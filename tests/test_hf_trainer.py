"""ZeroTrainer: Hugging Face's Trainer with zerodp doing the data parallelism trains like the plain Trainer
on one process with the whole batch, and resumes from its own checkpoints to the same losses.

One tiny Llama made from a config (no network), fp32, AdamW + linear schedule + clipping from
TrainingArguments, loss normalised by the token count (the Trainer's default for causal LMs). The plain
Trainer runs in this process (world 1); every world-2 run shares one spawn of two gloo ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # accelerate collects at every set-up (conftest.py)

import logs  # noqa: E402
from spawn import run_ranks  # noqa: E402

from zerodp import ConfigError  # noqa: E402
from zerodp.engine.engine import inside

MICRO, GAS, STEPS, SAVE_AT = 2, 2, 3, 2  # 24 samples: 3 steps an epoch at 8 samples a step; resumed for 1
STAGE3_OFFLOAD = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                        "stage3_param_persistence_threshold": 0}}
RUNS = {"stage1": {"zero_optimization": {"stage": 1}},
        "stage2_offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "stage3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}}


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16))


def dataset(n: int = 24, seq: int = 8, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": x, "labels": x} for x in ids]


class Record(transformers.TrainerCallback):
    """(step, loss, grad_norm, learning_rate) of every logged step."""

    def __init__(self):
        self.steps = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.steps.append((state.global_step, logs["loss"], logs["grad_norm"], logs["learning_rate"]))


def train(trainer_cls, out: str, per_device: int, save: bool = False, resume: str | None = None,
          evaluate: bool = False, model=None, optim: str | None = None,
          **kwargs) -> tuple[list, dict[str, torch.Tensor], float | None]:
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=GAS,
        max_steps=STEPS, learning_rate=1e-2, warmup_steps=1, max_grad_norm=0.5, logging_steps=1,
        save_strategy="steps" if save else "no", save_steps=SAVE_AT, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, log_level="error", **({"optim": optim} if optim else {}))
    record = Record()
    trainer = trainer_cls(model=model or tiny_llama(), args=args, train_dataset=dataset(), callbacks=[record], **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    engine = getattr(trainer, "engine", None)
    weights = engine.full_state_dict() if engine is not None else {k: v.detach().clone()
                                                                     for k, v in trainer.model.state_dict().items()}
    eval_loss = trainer.evaluate(dataset(8, seed=2))["eval_loss"] if evaluate else None
    return record.steps, weights, eval_loss


@contextlib.contextmanager
def world_of_one():
    """A one-rank process group and a fresh accelerate state in this process, both undone after."""
    from accelerate.state import AcceleratorState
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        if owned:
            dist.destroy_process_group()


@functools.cache
def oracle() -> tuple[list, dict[str, torch.Tensor], float]:
    """The plain Trainer, one process, the whole batch (2 ranks x MICRO) per step."""
    with world_of_one(), tempfile.TemporaryDirectory() as out:
        return train(transformers.Trainer, out, per_device=2 * MICRO, evaluate=True)


def rank_runs(rank: int, world: int, out: str) -> dict:
    """Every world-2 run, in one spawn: first a Trainer that accelerate sees as one process (no launcher's
    environment yet), then each stage, then a resume from the stage-3 run's checkpoint."""
    from accelerate.state import AcceleratorState
    unseen = [None] * world
    dist.all_gather_object(unseen, _trainer_without_launcher(rank, world))
    AcceleratorState._reset_state(True)  # it saw one process: the runs below build their own (distributed) state
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")  # accelerate reads these
    from zerodp.integrations.hf import ZeroTrainer
    results = {"unseen": unseen}
    for name, config in RUNS.items():
        steps, weights, _ = train(ZeroTrainer, f"{out}/{name}", MICRO, save=name == "stage3", zero_config=config)
        results[name] = (steps, weights)
    checkpoint = f"{out}/stage3/checkpoint-{SAVE_AT}"
    results["files"] = sorted(os.listdir(checkpoint))
    steps, weights, _ = train(ZeroTrainer, f"{out}/resumed", MICRO, resume=checkpoint, zero_config=RUNS["stage3"])
    results["resumed"] = (steps, weights)
    return results


@functools.cache
def world2() -> dict:
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)  # the ranks must build their own (distributed) accelerate state
    # Forked ranks inherit this process's transformers import (~6 s of CPU each when spawned).
    fork = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as out:
        return run_ranks(rank_runs, 2, out, timeout_s=120, start_method="fork" if fork else "spawn")[0]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_steps_close(got: list, want: list, tol: float) -> None:
    assert [s[0] for s in got] == [s[0] for s in want]
    for (step, loss, norm, lr), (_, loss0, norm0, lr0) in zip(got, want):
        assert abs(loss - loss0) <= tol, f"step {step}: loss {loss} vs plain Trainer {loss0}"
        assert abs(norm - norm0) <= tol * max(1.0, norm0), f"step {step}: grad_norm {norm} vs {norm0}"
        assert lr == pytest.approx(lr0, rel=1e-12), f"step {step}: learning_rate {lr} vs {lr0}"


def test_zero_trainer_world1_stage3_offload_matches_plain_trainer():
    from zerodp.integrations.hf import ZeroTrainer
    want_steps, want_weights, want_eval = oracle()
    with world_of_one(), tempfile.TemporaryDirectory() as out:
        steps, weights, eval_loss = train(ZeroTrainer, out, per_device=2 * MICRO, evaluate=True,
                                          zero_config=STAGE3_OFFLOAD)
    assert len(steps) == STEPS
    assert_steps_close(steps, want_steps, 1e-6)
    assert max_diff(weights, want_weights) <= 1e-6
    assert abs(eval_loss - want_eval) <= 1e-6  # trainer.evaluate() after training runs through the engine


def test_zero_trainer_with_transformers_adafactor_matches_plain_trainer():
    """optim="adafactor": transformers' Adafactor keeps row and column statistics per matrix, so zerodp steps
    it on whole parameters (on flat shards it would run another algorithm, 5e-2 off after 4 steps)."""
    from zerodp.integrations.hf import ZeroTrainer
    with world_of_one(), tempfile.TemporaryDirectory() as out:
        want_steps, want_weights, _ = train(transformers.Trainer, out, per_device=2 * MICRO, optim="adafactor")
    with world_of_one(), tempfile.TemporaryDirectory() as out:
        steps, weights, _ = train(ZeroTrainer, out, per_device=2 * MICRO, optim="adafactor",
                                  zero_config={"zero_optimization": {"stage": 2}})
    assert_steps_close(steps, want_steps, 1e-6)
    assert max_diff(weights, want_weights) <= 1e-6


@pytest.mark.parametrize("run", list(RUNS))
def test_zero_trainer_world2_matches_plain_trainer_on_the_whole_batch(run):
    want_steps, want_weights, _ = oracle()
    steps, weights = world2()[run]
    # The data-parallel rounding floor: the gradient is summed in another order (per rank, then across
    # ranks). Measured after 4 steps: the plain Trainer on 2 ranks (DDP) is off its own 1-process run by
    # 4.8e-7 in the step-4 loss (1 ulp of 4.1) and 1.9e-8 in the weights; ZeroTrainer by 4.8e-7 and 6e-8.
    assert_steps_close(steps, want_steps, 1e-6)
    assert max_diff(weights, want_weights) <= 1e-6


def test_zero_trainer_resumes_from_its_checkpoint_to_the_same_losses():
    runs = world2()
    # The Trainer's own files (HF model folder, trainer state, RNG) and zerodp's sharded checkpoint.
    assert {"model.safetensors", "config.json", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth",
            "latest", f"global_step{SAVE_AT}"} <= set(runs["files"])
    uninterrupted, weights = runs["stage3"]
    resumed, resumed_weights = runs["resumed"]
    assert [s[0] for s in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed == uninterrupted[SAVE_AT:]
    assert max_diff(resumed_weights, weights) == 0.0


def test_zero_trainer_reads_weights_from_a_folder_into_a_model_built_from_its_config(tmp_path):
    from zerodp.integrations.hf import ZeroTrainer
    want_steps, want_weights, _ = oracle()
    tiny_llama().save_pretrained(tmp_path / "llama")
    torch.manual_seed(5)  # other values than the folder's: they must all be replaced
    blank = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "llama"))
    with world_of_one(), tempfile.TemporaryDirectory() as out:
        steps, weights, _ = train(ZeroTrainer, out, per_device=2 * MICRO, model=blank, weights=tmp_path / "llama",
                                  zero_config=RUNS["stage3"])
    assert_steps_close(steps, want_steps, 1e-6)
    assert max_diff(weights, want_weights) <= 1e-6


def test_auto_values_come_from_the_training_arguments():
    from zerodp.integrations.hf import fill_from_training_args
    args = transformers.TrainingArguments(output_dir="unused", per_device_train_batch_size=3,
                                          gradient_accumulation_steps=2, learning_rate=3e-4, weight_decay=0.1,
                                          max_grad_norm=0.7, warmup_steps=5, use_cpu=True, report_to=[])
    config = {"train_batch_size": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto",
                                                                "total_num_steps": "auto"}}}
    filled = fill_from_training_args(config, args, world_size=4, max_steps=100, model=tiny_llama())
    assert filled["train_batch_size"] == 3 * 2 * 4
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (3, 2)
    assert filled["gradient_clipping"] == 0.7
    assert (filled["fp16"], filled["bf16"]) == ({"enabled": False}, {"enabled": False})
    assert filled["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 5,
                                             "total_num_steps": 100}
    assert filled["zero_optimization"]["reduce_bucket_size"] == 16 * 16  # hidden_size squared, as HF does
    assert config["train_batch_size"] == "auto"  # the caller's dict is left alone


def test_values_that_contradict_the_training_arguments_are_refused_all_at_once():
    from zerodp.integrations.hf import fill_from_training_args
    args = transformers.TrainingArguments(output_dir="unused", per_device_train_batch_size=3, learning_rate=3e-4,
                                          use_cpu=True, report_to=[])
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match=r"(?s)'train_micro_batch_size_per_gpu' = 4 but TrainingArguments "
                                          r"per_device_train_batch_size = 3.*'optimizer.params.lr' = 0.001"):
        fill_from_training_args(config, args, world_size=1, max_steps=10)


def test_a_short_last_accumulation_window_is_refused_before_training():
    from zerodp.integrations.hf import ZeroTrainer
    with world_of_one(), tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=4,
                                              gradient_accumulation_steps=2, num_train_epochs=1, use_cpu=True,
                                              report_to=[], disable_tqdm=True)
        trainer = ZeroTrainer(model=tiny_llama(), args=args, train_dataset=dataset(20))  # 5 batches an epoch
        with pytest.raises(ValueError, match="an epoch has 5 batches per rank, not a multiple of "
                                             "gradient_accumulation_steps 2"):
            trainer.train()
        assert trainer.engine is None


def test_training_arguments_that_would_bypass_the_engine_are_refused():
    from zerodp.integrations.hf import ZeroTrainer
    with world_of_one(), tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, auto_find_batch_size=True, use_cpu=True, report_to=[])
        with pytest.raises(ValueError, match="TrainingArguments.auto_find_batch_size is not supported by "
                                             "ZeroTrainer: the engine is built once per run"):
            ZeroTrainer(model=tiny_llama(), args=args, train_dataset=dataset())

@pytest.mark.parametrize("zero_config", [None, {"zero_optimization": {"stage": 2}}], ids=["none", "stage2"])
def test_zero_trainer_says_which_stage_runs_and_warns_when_none_was_chosen(zero_config):
    from zerodp.integrations.hf import ZeroTrainer
    with world_of_one(), tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1,
                                              use_cpu=True, report_to=[], disable_tqdm=True, save_strategy="no")
        trainer = ZeroTrainer(model=tiny_llama(), args=args, train_dataset=dataset(8), zero_config=zero_config)
        with logs.captured("transformers.trainer") as lines:
            trainer.train()
    ours = [(level, m) for level, m in lines if "ZeRO stage" in m]
    assert len(ours) == 1, lines
    level, line = ours[0]
    if zero_config is None:
        assert level == "WARNING" and "no ZeRO stage" in line and "zerodp: ZeRO stage 0 (nothing sharded: plain " \
            "data parallelism, 1 rank(s)); offload: none; dtype fp32" in line
    else:
        assert level == "INFO" and line.startswith("zerodp: ZeRO stage 2 (optimizer state and gradients sharded "
                                                   "over 1 of 1 ranks); offload: none; dtype fp32")


def _trainer_without_launcher(rank: int, world: int) -> tuple[str, str]:
    """Two gloo ranks that accelerate does not know of (no torchrun environment): it sees one process."""
    from zerodp.integrations.hf import ZeroTrainer
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1,
                                              use_cpu=True, report_to=[], disable_tqdm=True)
        trainer = ZeroTrainer(model=tiny_llama(), args=args, train_dataset=dataset(8))
        try:
            trainer.train()
        except Exception as e:  # noqa: BLE001 - which error comes first is the point
            return type(e).__name__, str(e)
    return "trained", ""


def test_a_world_the_trainer_does_not_see_is_named_before_the_batch_arithmetic():
    for kind, message in world2()["unseen"]:  # both ranks', run first in world2's launch
        assert kind == "ValueError" and "process group has 2 ranks but the Trainer (accelerate) sees 1" in message


HF_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "hf_run_clm.py")
PORT_LINE = "from zerodp.integrations.hf import ZeroTrainer as Trainer"


def test_hf_example_script_with_one_import_line_added_trains_with_zero_trainer_from_zerodp_config(
        hf_folders, tmp_path, monkeypatch):
    """run_clm.py's way: `--deepspeed ds_config.json` becomes ZERODP_CONFIG=ds_config.json, `--use_cpu` on a CPU."""
    import importlib.util
    import json

    with open(HF_SCRIPT, encoding="utf-8") as f:
        source = f.read()
    anchor = "    default_data_collator,\n)\n"
    ported = tmp_path / "run_clm.py"
    ported.write_text(source.replace(anchor, anchor + PORT_LINE + "\n", 1))
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}))
    monkeypatch.setenv("ZERODP_CONFIG", str(config))
    spec = importlib.util.spec_from_file_location("run_clm", ported)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "out"
    with world_of_one():
        trainer = script.main(["--model_name_or_path", str(hf_folders["gpt2"]), "--output_dir", str(out),
                               "--max_steps", "2", "--per_device_train_batch_size", "2", "--use_cpu",
                               "--report_to", "none", "--save_steps", "2", "--logging_steps", "1",
                               "--disable_tqdm", "true"])
    assert type(trainer).__name__ == "ZeroTrainer" and inside(trainer.engine).spec.stage == 2
    assert trainer.engine.global_steps == 2 and inside(trainer.engine).spec.device.type == "cpu"
    assert (out / "checkpoint-2" / "latest").read_text() == "global_step2"
    assert (out / "model.safetensors").exists()


def test_quick_start_of_the_docs_runs_on_a_cpu_as_written(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "HF_TRAINER.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) == 2  # the quick start, then TRL's (tests/test_trl.py runs that one)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    with world_of_one():
        exec(compile(blocks[0], "docs/HF_TRAINER.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert inside(trainer.engine).spec.stage == 3 and trainer.engine.global_steps == 4
    assert (tmp_path / "out" / "checkpoint-2" / "latest").read_text() == "global_step2"
