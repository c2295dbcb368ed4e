"""TRL's own scripts (trl/scripts/sft.py, dpo.py, grpo.py) with the zerodp class swapped in by one import line train
on 2 ranks x 2 as plain TRL does on one process x 4: SFT and DPO at ZeRO-2 and ZeRO-3 (DPO with --sync_ref_model;
--use_peft and --precompute_ref_log_probs at ZeRO-3), GRPO at ZeRO-2 and ZeRO-3 (generation on the gathered policy;
against TRL's own 2-rank DDP run, see DDP_ORACLE). A tiny Llama folder
(tests/hf_tiny.py), local datasets made here, fp32, 3 steps. The plain runs are in this process (world 1); every
world-2 run shares one fork of two gloo ranks."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # ~20 gc.collect() a rank (conftest.py)

from adam_rounding import AdamSlack, assert_close_after_adam  # noqa: E402
from spawn import run_ranks  # noqa: E402
from test_hf_trainer import world_of_one  # noqa: E402
from zerodp.engine.engine import inside

MICRO, STEPS = 2, 3
Z2 = {"zero_optimization": {"stage": 2}}
Z3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
SWAP = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer"}
# name: (script, extra arguments); each runs plain on one process and with zerodp at the stages listed.
CASES = {
    "sft": ("sft", [], (Z2, Z3)),
    "dpo_sync": ("dpo", ["--sync_ref_model", "true", "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "0.5"],
                 (Z2, Z3)),
    # --use_peft and --precompute_ref_log_probs at ZeRO-3 only: what they change (an adapter trained, the
    # reference's log-probs computed before training) runs above the engine, alike at any stage, and DPO at
    # ZeRO-2 is dpo_sync's; ZeRO-3 is the stage where the reference model is itself sharded.
    "dpo_peft": ("dpo", ["--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8",
                         "--lora_target_modules", "q_proj", "v_proj"], (Z3,)),
    "dpo_precompute": ("dpo", ["--precompute_ref_log_probs", "true"], (Z3,)),
    "grpo": ("grpo", ["--reward_funcs", "test_trl.vowel_reward", "--num_generations", "4",
                      "--max_completion_length", "6", "--beta", "0.1"], (Z2, Z3)),
}

# GRPO samples its completions on each rank from that rank's random stream, so one process cannot draw the same
# ones: its oracle is TRL's own run on the same 2 ranks (DDP), generating from the same seeds.
DDP_ORACLE = {"grpo"}


def vowel_reward(completions: list[str], **kwargs) -> list[float]:
    """GRPO's reward for plain-text completions: the share of vowels (differs between sampled completions)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def ported_script(script: str, where: Path):
    """trl/scripts/<script>.py as installed, with its trainer imported from zerodp.integrations.trl instead."""
    import trl.scripts

    source = (Path(trl.scripts.__file__).parent / f"{script}.py").read_text()
    name = SWAP[script]
    line = f"    from trl import {name},"
    assert line in source, f"trl/scripts/{script}.py no longer imports {name} as expected"
    end = source.index("\n", source.index(line)) + 1  # after TRL's import, which would rebind the name
    ported = source[:end] + f"    from zerodp.integrations.trl import Zero{name} as {name}\n" + source[end:]
    path = where / f"{script}_zero_{os.getpid()}.py"  # one per rank: the other may be writing its own
    path.write_text(ported)
    spec = importlib.util.spec_from_file_location(f"{script}_zero", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_script(script: str):
    return importlib.import_module(f"trl.scripts.{script}")


def datasets(root: Path) -> dict[str, Path]:
    """Local dataset folders (a train.jsonl each): text for SFT, preference pairs for DPO, prompts for GRPO."""
    words = "the quick brown fox jumps over a lazy dog and then it runs away".split()
    g = torch.Generator().manual_seed(0)

    def text(n: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    rows = {"sft": [{"text": text(12)} for _ in range(16)],
            "dpo": [{"prompt": text(4), "chosen": text(5), "rejected": text(3)} for _ in range(16)],
            "grpo": [{"prompt": text(4)} for _ in range(16)]}
    folders = {}
    for name, data in rows.items():
        folders[name] = root / name
        folders[name].mkdir(parents=True, exist_ok=True)
        (folders[name] / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    return folders


def run(module, script: str, model: Path, data: Path, out: Path, per_device: int, extra: list[str]) -> None:
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
            "--max_steps", str(STEPS), "--per_device_train_batch_size", str(per_device), "--learning_rate", "1e-2",
            "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--use_cpu", "true",
            "--bf16", "false", "--gradient_checkpointing", "false", "--disable_tqdm", "true", "--seed", "0",
            "--max_grad_norm", "0.5", *extra]
    if script != "grpo":
        argv += ["--max_length", "32"]
    # The scripts end with trainer.end(), which destroys the process group: the launch runs several scripts.
    end, transformers.Trainer.end = transformers.Trainer.end, lambda self: None
    try:
        parser = module.make_parser()
        module.main(*parser.parse_args_and_config(args=argv, fail_with_unknown_args=True))
    finally:
        transformers.Trainer.end = end


@contextlib.contextmanager
def adam_slack(into: dict):
    """The Trainer's AdamW, as it steps: into["slack"] is how far each weight may move apart in another
    summation order (tests/adam_rounding.py; DPO's gradients are differences of two sums, near zero by cancelling)."""
    create = transformers.Trainer.create_optimizer

    def creating(self):
        optimizer = create(self)
        slack = AdamSlack(self.model, optimizer)
        optimizer.register_step_pre_hook(lambda *_: slack.record())
        into["slack"] = slack.slack
        return optimizer
    transformers.Trainer.create_optimizer = creating
    try:
        yield
    finally:
        transformers.Trainer.create_optimizer = create


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    name = "adapter_model.safetensors" if (out / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(out / name)


def rank_runs(rank: int, world: int, model: str, data: dict, out: str) -> dict:
    """Every world-2 run, in one fork; rank 0 reads what each wrote (the files are whole)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    import logging

    from zerodp.integrations.trl import ZeroTRLMixin

    built: list[tuple[str, int]] = []  # (class, stage) of every engine a trainer built: the swap took
    ref_bytes: list[tuple[int, int]] = []  # (whole, held by this rank) for each reference model
    prepare = ZeroTRLMixin._prepare_for_training

    def recording(self, *args):
        ref = getattr(self, "ref_model", None)
        whole = sum(p.numel() * p.element_size() for p in ref.parameters()) if ref is not None else 0
        prepared = prepare(self, *args)
        built.append((type(self).__name__, inside(self.engine).spec.stage))
        if ref is not None:  # the reference's bytes: whole, and what this rank holds of it after set-up
            held = self.ref_model.memory_report() if hasattr(self.ref_model, "memory_report") else None
            ref_bytes.append((whole, held["frozen_params"] + held["frozen_params_and_buffers"] if held else whole))
        return prepared

    ZeroTRLMixin._prepare_for_training = recording
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers.trainer").addHandler(handler)
    results = {}
    for name, (script, extra, _) in CASES.items():
        if name in DDP_ORACLE:  # TRL's own multi-process run (DDP), the same ranks and seeds
            os.environ.pop("ZERODP_CONFIG", None)
            run(plain_script(script), script, Path(model), data[script], Path(out) / f"ddp_{name}", MICRO, extra)
            torch.distributed.barrier()
            results[(name, "ddp")] = weights(Path(out) / f"ddp_{name}") if rank == 0 else None
    for name, (script, extra, configs) in CASES.items():
        module = ported_script(script, Path(out))
        for config in configs:
            stage = config["zero_optimization"]["stage"]
            path = Path(out) / f"{name}_z{stage}"
            config_file = Path(out) / f"ds_{stage}.json"
            config_file.write_text(json.dumps(config))
            os.environ["ZERODP_CONFIG"] = str(config_file)
            run(module, script, Path(model), data[script], path, MICRO, extra)
            torch.distributed.barrier()
            results[(name, stage)] = weights(path) if rank == 0 else None
            results[(name, stage, "said")] = [m for m in said if "reference model" in m]
            results[(name, stage, "built")] = list(built)
            results[(name, stage, "ref_bytes")] = _on_every_rank(ref_bytes)
            said.clear()
            built.clear()
            ref_bytes.clear()
    return results


@functools.cache
def all_runs() -> tuple[dict, dict]:
    """The plain runs in this process (world 1), then every zerodp run (and GRPO's DDP oracle) in one fork."""
    with tempfile.TemporaryDirectory() as tmp:
        return _all_runs(Path(tmp))


def _all_runs(root: Path) -> tuple[dict, dict]:
    from accelerate.state import AcceleratorState

    from hf_tiny import make_folders

    model = make_folders(root / "models")["llama"]
    data = datasets(root / "data")
    plain = {}
    for name, (script, extra, _) in CASES.items():
        if name in DDP_ORACLE:
            continue
        recorded: dict = {}
        with world_of_one(), adam_slack(recorded):
            run(plain_script(script), script, model, data[script], root / f"plain_{name}", 2 * MICRO, extra)
        plain[name] = weights(root / f"plain_{name}")
        plain[(name, "slack")] = recorded["slack"]
    plain["initial"] = weights(model)
    AcceleratorState._reset_state(True)
    zero = run_ranks(rank_runs, 2, str(model), data, str(root), timeout_s=180)[0]
    return plain, zero


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("case", [(n, c["zero_optimization"]["stage"]) for n, (_, _, cs) in CASES.items() for c in cs],
                         ids=lambda c: f"{c[0]}_z{c[1]}")
def test_trl_script_with_zerodp_class_on_2_ranks_equals_plain_trl_on_one_process(case):
    plain, zero = all_runs()
    want = zero[(case[0], "ddp")] if case[0] in DDP_ORACLE else plain[case[0]]
    assert zero[(*case, "built")] == [(f"Zero{SWAP[CASES[case[0]][0]]}", case[1])]
    diff = max_diff(zero[case], want)
    print(f"{case}: max weight difference {diff:.2e}")
    # 2e-5, and where the one-process AdamW met a gradient near zero, what rounding can move it there
    # (tests/adam_rounding.py): DPO's weights moved 1.4e-5 apart so, 4.8e-7 elsewhere (this Xeon)
    assert_close_after_adam(zero[case], want, plain.get((case[0], "slack"), {}), tol=2e-5, rtol=0)
    if want.keys() == plain["initial"].keys():  # the run trained (not a LoRA adapter's file)
        assert max_diff(want, plain["initial"]) > 1e-3


def test_trl_section_of_the_docs_runs_on_a_cpu_as_written(tmp_path, monkeypatch):
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "HF_TRAINER.md").read_text()
    section = text[text.index("## TRL"):]
    assert "    from zerodp.integrations.trl import ZeroSFTTrainer as SFTTrainer\n" in section  # what the scripts get
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    with world_of_one():
        exec(compile(blocks[0], "docs/HF_TRAINER.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert type(trainer).__name__ == "ZeroSFTTrainer" and inside(trainer.engine).spec.stage == 3
    assert trainer.engine.global_steps == 2


def test_zero_config_is_taken_with_trls_class_first_in_the_bases(tmp_path):
    """`class T(SFTTrainer, ZeroTrainer)` handed zero_config= to SFTTrainer.__init__ (TypeError) before."""
    from trl import SFTConfig, SFTTrainer

    from hf_tiny import make_folders
    from zerodp.integrations.hf import ZeroTrainer

    class TRLFirst(SFTTrainer, ZeroTrainer):
        pass

    folder = make_folders(tmp_path)["llama"]
    data = datasets(tmp_path / "data")["sft"]
    args = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, max_length=16,
                     use_cpu=True, bf16=False, report_to="none", save_strategy="no")
    from datasets import load_dataset
    with world_of_one():
        trainer = TRLFirst(model=str(folder), args=args, train_dataset=load_dataset(str(data))["train"],
                           zero_config={"zero_optimization": {"stage": 2}})
        trainer.train()
    assert inside(trainer.engine).spec.stage == 2 and trainer.engine.global_steps == 1


def test_trl_arguments_that_read_the_policy_around_the_engine_are_refused_by_name(tmp_path):
    from trl import SFTConfig

    from hf_tiny import make_folders
    from zerodp.integrations.trl import ZeroSFTTrainer

    folder = make_folders(tmp_path)["llama"]
    data = datasets(tmp_path / "data")["sft"]
    args = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none")
    args.use_vllm = True  # what GRPOConfig(use_vllm=True) sets; SFTConfig has no such field
    from datasets import load_dataset
    with world_of_one(), pytest.raises(ValueError, match="use_vllm is not supported by ZeroSFTTrainer"):
        ZeroSFTTrainer(model=str(folder), args=args, train_dataset=load_dataset(str(data))["train"])


def _on_every_rank(value: list) -> list:
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, list(value))
    return gathered


@pytest.mark.parametrize("case", [("dpo_sync", 3), ("grpo", 3), ("dpo_sync", 2)], ids=lambda c: f"{c[0]}_z{c[1]}")
def test_the_reference_model_is_sharded_at_stage_3_and_whole_below(case):
    _, zero = all_runs()
    per_rank = zero[(*case, "ref_bytes")]
    assert len(per_rank) == 2 and all(len(r) == 1 for r in per_rank)  # one reference model, seen on both ranks
    for [(whole, held)] in per_rank:
        print(f"{case}: reference model {whole} bytes whole, {held} on this rank")
        if case[1] == 3:  # half of it on each of 2 ranks, plus the buckets' padding and the rotary buffers
            assert whole / 2 <= held < whole / 2 * 1.05
        else:
            assert held == whole
    assert zero[("sft", 3, "said")] == []  # nothing about a reference model where there is none


def _script_with(script: str, lines: str, after: str, where: Path):
    """trl/scripts/<script>.py as installed, with `lines` inserted after the line `after`."""
    import trl.scripts

    source = (Path(trl.scripts.__file__).parent / f"{script}.py").read_text()
    assert after in source, f"trl/scripts/{script}.py changed: no line {after!r}"
    end = source.index("\n", source.index(after)) + 1
    path = where / f"{script}_placed.py"
    path.write_text(source[:end] + lines + source[end:])
    spec = importlib.util.spec_from_file_location(f"{script}_placed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config_env(tmp_path: Path, monkeypatch, stage: int) -> None:
    config = tmp_path / "zerodp.json"
    config.write_text(json.dumps(Z3 if stage == 3 else Z2))
    monkeypatch.setenv("ZERODP_CONFIG", str(config))


def test_the_zerodp_import_placed_before_trls_own_is_refused_by_name(tmp_path, monkeypatch):
    """At the top of sft.py, the swap is undone by TRL's `from trl import SFTTrainer` inside main()."""
    from hf_tiny import make_folders

    module = _script_with("sft", "from zerodp.integrations.trl import ZeroSFTTrainer as SFTTrainer  # noqa\n",
                          "import argparse", tmp_path)
    _config_env(tmp_path, monkeypatch, 2)
    model = make_folders(tmp_path / "models")["llama"]
    with world_of_one(), pytest.raises(RuntimeError, match="ZERODP_CONFIG is set .* this Trainer is not zerodp's"):
        run(module, "sft", model, datasets(tmp_path / "data")["sft"], tmp_path / "out", MICRO, [])


def test_a_trl_trainer_mixed_with_zerotrainer_by_hand_refuses_sync_ref_model_at_stage_3(tmp_path, monkeypatch):
    """TRL's own SyncRefModelCallback would copy stage 3's empty param.data (a shape error in TRL's callback)."""
    from hf_tiny import make_folders

    hand_mixed = ("    from zerodp.integrations.hf import ZeroTrainer\n"
                  "    DPOTrainer = type(\"DPOTrainer\", (ZeroTrainer, DPOTrainer), {})\n")
    module = _script_with("dpo", hand_mixed, "    from trl import DPOTrainer,", tmp_path)
    _config_env(tmp_path, monkeypatch, 3)
    model = make_folders(tmp_path / "models")["llama"]
    with world_of_one(), pytest.raises(ValueError, match="by hand .* use zerodp.integrations.trl's ZeroDPOTrainer"):
        run(module, "dpo", model, datasets(tmp_path / "data")["dpo"], tmp_path / "out", MICRO, CASES["dpo_sync"][1])
