"""`zerodp estimate` for any model: a Hugging Face config, a module:factory, a family to --fit, host rows
for offload, tables of 100 columns (the formulas against the engine: test_memory.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from in_process import children_here

from zerodp.plan import estimate

from zerodp.plan import formulas
from zerodp.plan.tables import params_text, size
from zerodp.plan.models import PlanModel, PlanModelError

LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 176,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "tie_word_embeddings": False}
FACTORY = '''
import torch
def make():
    return torch.nn.Sequential(torch.nn.Linear(100, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
'''


def _rows(out: str, table: int = 0) -> list[list[str]]:
    """The numbered rows of the table-th table (0: memory, 1: set-up)."""
    part = out.split("Set-up peak per rank")[table]
    return [line.split() for line in part.splitlines() if line.split()[:1] and line.split()[0].isdigit()]


def test_a_hugging_face_config_is_counted_as_from_config_builds_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    model = PlanModel.parse(str(tmp_path))  # the folder; its config.json names the same model
    assert PlanModel.parse(str(tmp_path / "config.json")).fields == model.fields
    reference = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    assert model.num_params() == sum(p.numel() for p in reference.parameters())
    assert model.shape().n_layer == 3 and model.shape().n_embd == 64
    wider = model.scaled(2.0)  # heads keep their size, GQA its group, the MLP its ratio
    assert (wider.fields["hidden_size"], wider.fields["num_hidden_layers"]) == (128, 6)
    assert (wider.fields["num_attention_heads"], wider.fields["num_key_value_heads"]) == (8, 4)
    assert wider.fields["intermediate_size"] == 352


def test_a_factory_module_is_counted_and_refused_by_fit(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodels.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    model = PlanModel.parse("mymodels:make")
    psi = 100 * 300 + 300 + 300 * 10 + 10
    assert model.num_params() == psi
    assert PlanModel.parse(str(tmp_path / "mymodels.py") + ":make").num_params() == psi
    with children_here():  # the set-up's child in this process (in_process.py); as a subprocess: the next test
        estimate.main(["--model", "mymodels:make", "--world", "8", "--stage", "2", "3"])
    out = capsys.readouterr().out
    assert size(formulas.formula(psi, 8, 2)) in out and "no inputs: not measured" in out
    with pytest.raises(SystemExit):
        estimate.main(["--model", "mymodels:make", "--fit", "1GiB"])
    assert "factory's shape is unknown" in capsys.readouterr().err
    with pytest.raises(PlanModelError, match="has no function 'nope'"):
        PlanModel.parse("mymodels:nope").num_params()


def test_a_model_on_meta_that_nothing_initialises_gets_the_formula_for_its_set_up(tmp_path, capsys):
    (tmp_path / "bare.py").write_text(
        "import torch\nclass Bare(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.ones(300, 300))\ndef make():\n    return Bare()\n")
    # The command as a user runs it, its fake-tensor measuring child a subprocess (plan/peak.py's __main__):
    # the one test that keeps it (the others run the child's function here, in_process.py).
    estimate.main(["--model", str(tmp_path / "bare.py") + ":make", "--world", "8", "--stage", "3"])
    row = _rows(capsys.readouterr().out, 1)[0]
    assert row[4] == "(formula)" and row[7] == "(fake)", row  # meta: no reset_parameters; whole: measured


def test_a_hugging_face_model_on_meta_is_initialised_by_its_own_init_weights_in_the_set_up(tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))  # RMSNorm and rotary tables: no reset_parameters
    with children_here():  # no second import of transformers in a child (in_process.py)
        estimate.main(["--model", str(tmp_path), "--world", "8", "--stage", "3", "--seq", "32"])
    row = _rows(capsys.readouterr().out, 1)[0]
    assert row[4] == "(fake)" and row[7] == "(fake)", row


def test_offload_adds_host_rows_and_the_buckets_count_in_the_total(capsys):
    estimate.main(["--model", "125M", "--world", "8", "--stage", "2", "3", "--offload-optimizer", "--measure", "none"])
    out = capsys.readouterr().out
    psi = PlanModel.parse("125M").num_params()
    rows = {r[2]: r for r in _rows(out)}  # by stage
    for stage in (2, 3):
        split = formulas.placed(psi, 8, stage, offload_optimizer=True, pin_memory=True)  # pinned, as on a GPU
        buckets = formulas.bucket_estimate(psi, 8, stage, largest_module=PlanModel.parse("125M").largest_module())
        line = " ".join(rows[str(stage)])
        assert size(split["device"]) in line and size(split["host"]) in line and size(buckets) in line
        assert size(split["device"] + buckets) in line  # the total
    assert max(len(line) for line in out.splitlines()) <= 100


def test_fit_scales_the_given_config_and_answers_the_largest_that_fits(tmp_path, capsys):
    from zerodp.plan.tables import _need, family, largest_fitting, params_text
    cfg = tmp_path / "wide.json"
    cfg.write_text(json.dumps({"size": "125M", "n_embd": 1024, "n_head": 16, "vocab_size": 32000}))
    estimate.main(["--fit", "40GiB", "--model", str(cfg), "--world", "64", "--stage", "2"])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    args = estimate.build_parser().parse_args(["--fit", "40GiB"])
    args.seq = 1024
    members = family(PlanModel.parse(str(cfg)))
    psi, best = largest_fitting(args, members, 64, 2)
    assert params_text(psi) in _rows(out)[0][3]
    assert _need(args, best, psi, 64, 2, 1) <= args.fit
    bigger, next_one = members[[p for p, _ in members].index(psi) + 1]
    assert _need(args, next_one, bigger, 64, 2, 1) > args.fit  # the next size of the family does not fit
    assert next_one.fields["n_embd"] % 16 == 0 and best.fields["n_layer"] > 12  # scaled, heads of 64


def test_bucket_default_is_the_engines():
    from zerodp.config import REDUCE_BUCKET_SIZE, ZeroConfig
    assert estimate.DEFAULT_BUCKET == REDUCE_BUCKET_SIZE == ZeroConfig.model_fields["reduce_bucket_size"].default


def test_setup_table_gives_both_paths_beside_the_step_peak(capsys):
    from zerodp.plan import setup
    estimate.main(["--model", "350M", "--world", "8", "--stage", "2", "3", "--measure", "none"])
    out = capsys.readouterr().out
    model = PlanModel.parse("350M")
    psi = model.num_params()
    steps = {r[2]: " ".join(r[r.index("≈") + 1:r.index("≈") + 3]) for r in _rows(out)}  # "≈ 2.8 GiB act ..."
    rows = _rows(out, 1)
    assert [r[1] for r in rows] == ["2", "3"]
    for row in rows:
        stage = int(row[1])
        bucket = setup.largest_bucket(model, psi, stage, 50_000_000)
        meta, whole = (size(setup.formula(p, psi, 8, stage, "bf16", bucket)) for p in setup.PATHS)
        assert " ".join(row[2:5]) == f"{meta} (formula)" and " ".join(row[5:8]) == f"{whole} (formula)"
        assert " ".join(row[8:10]) == steps[str(stage)]
        assert row[12] == "(step)"  # the meta set-up is below the step's peak
    assert max(len(line) for line in out.splitlines()) <= 100


def test_setup_of_both_paths_is_measured_on_fake_tensors_as_the_formula_says():
    from rich.console import Console

    from zerodp.plan import setup
    # small, not tiny: tiny's blocks are under stage3_param_persistence_threshold, so they stay gathered
    # on every rank, which the formula (for models worth sharding) leaves out.
    model = PlanModel.parse("small")
    psi = model.num_params()
    args = estimate.build_parser().parse_args(["--model", "small", "--dtype", "fp32"])
    args.seq = 64
    with children_here():
        got = setup.measure(args, model, [(4, 2), (4, 3)], Console(quiet=True))
    with torch.device("meta"):  # the initialisers' CPU stand-ins, one module at a time: host memory on a GPU
        stand_in = 4 * max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.build()[0].modules())
    for stage in (2, 3):
        bucket = setup.largest_bucket(model, psi, stage, 50_000_000)
        want = setup.formula("whole", psi, 4, stage, "fp32", bucket)
        assert 0.95 * want < got[("whole", 4, stage)] <= 1.01 * want  # the formula is the engine's set-up loop
        meta = got[("meta", 4, stage)]
        assert psi < meta <= setup.formula("meta", psi, 4, stage, "fp32", bucket) + stand_in < got[("whole", 4, stage)]


def test_meta_setup_on_fake_tensors_counts_what_the_same_run_on_real_tensors_holds():
    """The measurement's two work-arounds (swap_tensors on fake tensors, meta tensors left out) and the
    engine's views taken while a stage-3 buffer is whole: the fake run counts what the real one holds."""
    from zerodp.plan.peak import measure_peaks

    model = PlanModel.parse("small")
    base = {"source": dataclasses.asdict(model), "micro_batch": 1, "seq": 64, "dtype": "bf16", "mode": "setup",
            "checkpointing": False, "reduce_bucket_size": 500_000, "setup": "meta", "world": 4}
    # Stage 3 only: its meta set-up goes through both work-arounds and takes views of a whole buffer; stage
    # 2's (a flat working buffer allocated at once, the masters' shard) has nothing more for fake tensors to
    # miscount, and test_setup_of_both_paths holds its fake count to the formula.
    with children_here():
        runs = measure_peaks([{**base, "stage": 3, "fake": f} for f in (True, False)])
    for fake, real in zip(runs[::2], runs[1::2]):
        assert abs(fake["peak"] - real["peak"]) < 64 * 1024, (fake["spec"]["stage"], fake["peak"], real["peak"])
        # (the real run also holds rank 0's CPU random state, 5 KB, which the fake run keeps real)
        assert abs(sum(fake["after_step"].values()) - sum(real["after_step"].values())) < 64 * 1024


def test_fit_needs_the_larger_of_the_step_and_the_setup():
    from zerodp.plan import setup
    from zerodp.plan.tables import _formula, _need
    model = PlanModel.parse("125M")
    psi = model.num_params()
    for path in setup.PATHS:
        args = estimate.build_parser().parse_args(["--fit", "80GiB", "--setup", path, "--dtype", "bf16"])
        args.seq = 128
        f = _formula(args, psi, 64, 3)
        step = f["device"] + f["buckets"] + formulas.activation_estimate(model.shape(), 1, 128, "bf16", False)
        first = setup.formula(path, psi, 64, 3, "bf16", setup.largest_bucket(model, psi, 3, args.reduce_bucket_size))
        assert _need(args, model, psi, 64, 3, 1) == max(step, first)
    assert setup.formula("whole", psi, 64, 3, "bf16", 0) > step > setup.formula("meta", psi, 64, 3, "bf16", 0)


def test_optimizer_shares_of_whole_parameters_beside_one_nth(capsys):
    """--optimizer muon: Muon's hidden matrices are owned whole (each rank's share is whole matrices), AdamW's
    rest in flat shards; the table gives 1/N, the largest rank and its excess, as the engine lays them out."""
    from zerodp.config.optimizer import muon_params
    from zerodp.plan.optimizer_shares import shares
    with torch.device("meta"):
        model, _ = PlanModel.parse("small").build()
    hidden, rest = (sum(p.numel() for p in ps) for ps in muon_params(model))
    for world in (8, 64):
        muon = shares(model, "muon", world, 2_000_000)
        # bf16: a 4-byte master for every element, Muon's momentum (4) or AdamW's two moments (8)
        assert sum(muon["per_rank"]) == 8 * hidden + 12 * rest
        adamw = shares(model, "adamw", world, 2_000_000)
        assert max(adamw["per_rank"]) - min(adamw["per_rank"]) <= 12 * 64 * world * 4  # flat: 1/N, up to padding
        assert adamw["padding_bytes"] < muon["padding_bytes"]
    for world, excess in ((4, 0.01), (8, 0.35)):  # 24 matrices of 0.07-0.26M: whole ones dealt to 4 and 8 ranks
        per_rank = shares(model, "muon", world, 2_000_000)["per_rank"]
        assert max(per_rank) <= (1 + excess) * sum(per_rank) / world
    estimate.main(["--model", "small", "--world", "8", "--stage", "2", "--measure", "none", "--optimizer", "muon"])
    out = capsys.readouterr().out
    assert "Optimizer state per rank, muon (whole parameters)" in out and "excess over 1/N" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_a_fine_tune_plans_the_frozen_base_whole_below_stage_3_and_one_nth_at_stage_3(capsys):
    """--lora 4 on the tiny GPT: r x (in + out) per Linear but the head; --trainable-fraction: F x Ψ. The
    frozen base's working copy alone per rank, whole at stage 2, 1/N at stage 3 (host with --offload-param)."""
    model = PlanModel.parse("tiny")
    with torch.device("meta"):
        gpt, _ = model.build()
    lora = sum(4 * (m.in_features + m.out_features) for m in gpt.modules()
               if isinstance(m, torch.nn.Linear) and m.out_features != model.fields["vocab_size"])
    psi = model.num_params()
    estimate.main(["--model", "tiny", "--world", "4", "--stage", "2", "3", "--lora", "4", "--measure", "none"])
    printed = capsys.readouterr().out
    assert printed.lstrip().startswith("Fine-tune of") and "Ψ =" not in printed  # no full-training table
    rows = [line.split() for line in printed.splitlines() if line.split()[:2] in (["4", "2"], ["4", "3"])]
    frozen = 2 * (psi - lora)
    assert rows[0][2:4] == size(frozen).split() and rows[1][2:4] == size(round(frozen / 4)).split()
    assert rows[1][4:6] == size(formulas.formula(lora, 4, 3)).split()
    # the device holds the activations too: by default micro-batch 1 x the tiny GPT's whole context
    seq = model.shape().block_size
    act = formulas.activation_estimate(model.shape(), 1, seq, "bf16")
    assert f"micro-batch 1 x {seq} tokens" in " ".join(printed.split()) and rows[1][6:8] == size(act).split()
    assert rows[1][8:10] == size(round(frozen / 4) + formulas.formula(lora, 4, 3) + act).split()
    assert formulas.finetune(psi, lora, 4, 3, offload_param=True)["host"] == round(frozen / 4) + round(2 * lora / 4)
    estimate.main(["--model", "tiny", "--world", "4", "--stage", "3", "--trainable-fraction", "0.5",
                   "--measure", "none"])
    assert f"({params_text(round(psi / 2))} of {params_text(psi)}, 50.00%)" in " ".join(capsys.readouterr().out.split())


def test_a_fine_tunes_activations_follow_micro_batch_and_seq_and_fit_is_refused_with_it(capsys):
    model = PlanModel.parse("tiny")
    estimate.main(["--model", "tiny", "--world", "4", "--stage", "3", "--lora", "4", "--micro-batch", "3",
                   "--seq", "100", "--measure", "none"])
    printed = capsys.readouterr().out
    row = next(line.split() for line in printed.splitlines() if line.split()[:2] == ["4", "3"])
    assert "micro-batch 3 x 100 tokens" in " ".join(printed.split())
    assert row[6:8] == size(formulas.activation_estimate(model.shape(), 3, 100, "bf16")).split()
    with pytest.raises(SystemExit):
        estimate.main(["--model", "tiny", "--lora", "4", "--fit", "80GiB"])
    assert "--fit plans full training" in capsys.readouterr().err
