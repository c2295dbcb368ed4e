"""A model built on the meta device: zerodp.initialize materialises only what each rank keeps, one bucket
at a time, from its modules' initialisers (bit for bit the values of a whole build with the same seed)
or from any ParameterSource, and then trains exactly as the same model built whole (the oracle)."""

from __future__ import annotations

import oracle
import pytest
import torch
from spawn import run_ranks
from torch import nn

import zerodp
from zerodp.config import load_config
from zerodp.distributed.comm import Comm
from zerodp.engine.engine import wrap
from zerodp.models.gpt import GPT, gpt_config

META = dict(dtype="fp32", offload=False, seed=0, meta=True)
ORACLE_JOBS = {2: [("plain", s) for s in range(4)] + [("frozen", 3), ("param_groups", 2)],
               1: [("plain", 3)], 4: [("plain", 2), ("plain", 3)]}
BIT_CASES = {2: [(2, "fp32"), (3, "fp32"), (3, "bf16")], 1: [(3, "fp32")], 4: [(3, "fp32")]}


def _config(stage: int, dtype: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 20_000}}  # several buckets per group
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _gpt_and_norm() -> nn.Module:
    """The tiny GPT (its tied head included) beside a BatchNorm, whose statistics are buffers."""
    return nn.ModuleDict({"gpt": GPT(gpt_config("tiny")), "norm": nn.BatchNorm1d(8)})


def _built_on_meta(rank: int, world: int, stage: int, dtype: str) -> dict:
    """Every rank seeds its own random state: rank 0's must be the one drawn from, everywhere."""
    torch.manual_seed(rank)
    with torch.device("meta"):
        model = _gpt_and_norm()
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), _config(stage, dtype))
    with engine.gathered_parameters():
        values = {n: t.detach().clone() for n, t in model.state_dict().items()}
    masters = engine.full_state_dict()
    return {"values": values, "masters": masters, "rng": torch.get_rng_state(),
            "tied": model["gpt"].lm_head.weight is model["gpt"].wte.weight}


class _Recording:
    """A ParameterSource over tensors in memory that records every range it is asked for."""

    def __init__(self, values: dict[str, torch.Tensor]):
        self.values, self.asked = values, []

    def check(self, shapes: dict[str, torch.Size]) -> None:
        wrong = [n for n, s in shapes.items() if n not in self.values or self.values[n].shape != s]
        if wrong:
            raise ValueError(f"the source has no tensor of the model's shape for {wrong}")

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        self.asked.append((name, start, stop))
        return self.values[name].reshape(-1)[start:stop]


def _from_source(rank: int, world: int, stage: int, drop: str | None = None) -> dict:
    torch.manual_seed(7)
    values = {n: p.detach().clone() for n, p in GPT(gpt_config("tiny")).named_parameters()}
    if drop is not None and rank == 1:
        del values[drop]
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    source = _Recording(values)
    try:
        engine = wrap(model, torch.optim.AdamW(model.parameters()), load_config(_config(stage)), Comm(None),
                      source=source)
    except ValueError as e:
        return {"error": str(e)}
    with engine.gathered_parameters():
        same = all(torch.equal(p, values[n]) for n, p in model.named_parameters())
    return {"asked": sum(stop - start for _, start, stop in source.asked), "same": same,
            "total": sum(v.numel() for v in values.values())}


def _everything(rank: int, world: int) -> dict:
    """One set of ranks per world size runs every check (spawning costs seconds)."""
    out = {"oracle": oracle.run_all(rank, world, [(n, s, *META.values()) for n, s in ORACLE_JOBS[world]]),
           "bits": {case: _built_on_meta(rank, world, *case) for case in BIT_CASES[world]}}
    if world == 2:
        out["source"] = {stage: _from_source(rank, world, stage) for stage in (2, 3)}
        out["missing"] = _from_source(rank, world, 3, drop="blocks.1.mlp.c_fc.weight")
    return out


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"world={w}")
def ranks(request):
    return request.param, run_ranks(_everything, request.param, timeout_s=60)


def _whole(dtype: str) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(0)
    model = _gpt_and_norm()
    rng = torch.get_rng_state()
    cast = torch.bfloat16 if dtype == "bf16" else torch.float32
    return {n: t.to(cast) if t.is_floating_point() else t for n, t in model.state_dict().items()}, rng


def test_meta_build_is_initialised_bit_for_bit_as_the_whole_build_on_every_rank(ranks):
    world, results = ranks
    for (stage, dtype) in BIT_CASES[world]:
        whole, rng = _whole(dtype)
        fp32, _ = _whole("fp32")
        for r, res in enumerate(results):
            got = res["bits"][(stage, dtype)]
            assert got["tied"]
            for n, t in whole.items():
                assert torch.equal(got["values"][n], t), f"rank {r} stage {stage} {dtype}: {n}"
            for n, t in got["masters"].items():  # the fp32 masters hold the fp32 initial values
                assert torch.equal(t, fp32[n].float()), f"rank {r} stage {stage} {dtype} master: {n}"
            # The random state is left where the whole build leaves it (rank 0's, drawn everywhere).
            assert torch.equal(got["rng"], rng)


def test_meta_build_trains_as_single_process(ranks):
    world, results = ranks
    for name, stage in ORACLE_JOBS[world]:
        ref = oracle.train_reference(name, world)
        for res in results:
            ours = res["oracle"][(name, stage, *META.values())]
            for k in ref["state"]:
                where = f"{name} stage {stage} {k}"
                torch.testing.assert_close(ours["state"][k], ref["state"][k], rtol=1e-6, atol=1e-6,
                                           msg=lambda m, where=where: f"{where}: {m}")
            torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ref["norms"]), rtol=1e-6, atol=1e-6)


def test_stage3_asks_a_source_for_its_shards_only_and_stage2_for_the_working_copy(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("checked at world 2")
    for stage in (2, 3):
        for res in results:
            assert res["source"][stage]["same"]
    total = results[0]["source"][3]["total"]
    assert results[0]["source"][2]["asked"] == results[1]["source"][2]["asked"] == total
    # Each element of the model is read by exactly one rank at stage 3.
    assert results[0]["source"][3]["asked"] + results[1]["source"][3]["asked"] == total
    assert 0 < results[0]["source"][3]["asked"] < total


def test_a_source_missing_a_tensor_on_one_rank_is_an_error_on_every_rank(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("checked at world 2")
    assert "blocks.1.mlp.c_fc.weight" in results[1]["missing"]["error"]
    assert "failed on rank 1" in results[0]["missing"]["error"]
    assert "blocks.1.mlp.c_fc.weight" in results[0]["missing"]["error"]


def test_set_up_is_one_package_that_names_every_weight_file_reader_and_writer():
    """engine/setup/ holds set-up in reading order, and its docstring is the one place that finds every
    file that reads or writes weight files: each file and name it lists exists. The documented
    `zerodp.engine.setup.source.ParameterSource` (initialize's weights=) is the package's protocol."""
    import importlib
    import re

    import zerodp.engine.setup as setup
    from zerodp.engine.setup.source import ParameterSource

    assert "zerodp.engine.setup.source.ParameterSource" in zerodp.initialize.__doc__
    assert ParameterSource.__module__ == "zerodp.engine.setup.source"
    for module in ("source", "initialisers", "fill"):
        assert f"{module}.py" in setup.__doc__
        importlib.import_module(f"zerodp.engine.setup.{module}")
    fill = importlib.import_module("zerodp.engine.setup.fill")
    for step in ("filling_for", "move_to", "start", "fill"):
        assert callable(getattr(fill, step)) and setup.__doc__.count(f"`{step}`") == 1
    listed: dict[str, list[str]] = {}  # file -> the names listed with it
    path = None
    for line in setup.__doc__.split("Everything that reads or writes weight files")[1].splitlines():
        found = re.search(r"(zerodp/\S+)\.py", line)
        if found:
            path, line = found.group(1), line[found.end():]
        if path is not None:
            listed.setdefault(path, []).extend(re.findall(r"`(\w+)`", line))
    assert set(listed) == {"zerodp/checkpoint/weights", "zerodp/models/hf_folder",
                           "zerodp/engine/sharding/weights", "zerodp/models/weight_files"}
    for path, names in listed.items():
        module = importlib.import_module(path.replace("/", "."))
        assert names and all(hasattr(module, n) for n in names), (path, names)
