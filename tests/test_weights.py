"""Weights from files (zerodp.checkpoint.weights): every reader hands back exactly the elements asked for,
`zerodp.initialize(..., weights=PATH)` trains like the same model loaded the usual way, and weights that
do not fit the model are an error naming what is wrong, on every rank, before any collective.

Readers are checked in this process against the whole tensors (torch.equal on every range); the engine
runs share one spawn of two gloo ranks (and one in-process world of one).
"""

from __future__ import annotations

import functools
import os
import tempfile

import oracle
import pytest
import torch
from safetensors.torch import save_file
from spawn import run_ranks
from test_checkpoint import world_of_one
from torch import nn

import zerodp
from zerodp import checkpoint as ck
from zerodp.checkpoint.weights import open_weights

DS = os.path.join(os.path.dirname(__file__), "data", "deepspeed")


class Shapes(nn.Module):
    """Parameters of 1, 2 and 3 dimensions, and one scalar."""

    def __init__(self):
        super().__init__()
        self.cube = nn.Parameter(torch.randn(7, 5, 3))
        self.vec = nn.Parameter(torch.randn(13))
        self.mat = nn.Parameter(torch.randn(4, 6))
        self.one = nn.Parameter(torch.randn(()))


def ranges(n: int) -> list[tuple[int, int]]:
    """Whole, empty-edged, one element, across row boundaries, and some at random."""
    g = torch.Generator().manual_seed(n)
    out = [(0, n), (0, 1), (n - 1, n), (max(0, n // 2 - 4), min(n, n // 2 + 5))]
    for _ in range(6):
        a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
        out.append((a, max(b, a + 1) if a < n else n))
    return [(a, b) for a, b in out if a < b]


def assert_reads_equal(source, whole: dict[str, torch.Tensor]) -> None:
    source.check({n: t.shape for n, t in whole.items()})
    for name, t in whole.items():
        flat = t.reshape(-1)
        for a, b in ranges(flat.numel()):
            got = source.read(name, a, b)
            assert got.dtype == t.dtype and torch.equal(got, flat[a:b]), (name, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_file_range_reads_equal_the_whole_tensors_slices(tmp_path, dtype):
    torch.manual_seed(0)
    model = Shapes()
    whole = {n: p.detach().to(dtype) for n, p in model.named_parameters()}
    save_file(whole, tmp_path / "w.safetensors")
    assert_reads_equal(open_weights(tmp_path / "w.safetensors", model), whole)


def hf_reference(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def wrapped_from_config(folder) -> nn.Module:
    """What `zerodp train --model FOLDER` trains: the folder's architecture inside HFCausalLM (`model.`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerodp.models.build import HFCausalLM
    return HFCausalLM(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)))


@pytest.mark.parametrize("name,dtype,sharded", [("gpt2", torch.float32, False), ("gpt2", torch.bfloat16, True),
                                                ("llama", torch.float32, True), ("llama", torch.bfloat16, False)])
def test_hf_folder_reads_equal_from_pretrained_through_the_wrapper_names_and_ties(hf_folders, tmp_path, name,
                                                                                   dtype, sharded):
    folder = hf_folders[name]
    ref = hf_reference(folder, dtype)
    if sharded or dtype != torch.float32:
        folder = tmp_path / "saved"
        ref.save_pretrained(folder, max_shard_size="20KB" if sharded else "5GB")
        assert os.path.isfile(folder / "model.safetensors.index.json") == sharded
        assert len(list(folder.glob("*.safetensors"))) > (3 if sharded else 0)
    model = wrapped_from_config(folder)
    source = open_weights(folder, model)
    whole = {f"model.{n}": p.detach() for n, p in ref.named_parameters()}
    assert list(whole) == [n for n, _ in model.named_parameters()]
    assert_reads_equal(source, whole)
    if name == "gpt2":  # lm_head is tied to the embedding and not stored: read through its other name
        assert source.names["model.transformer.wte.weight"] == "transformer.wte.weight"


def test_files_of_another_model_are_errors_naming_the_tensors(hf_folders, tmp_path):
    torch.manual_seed(0)
    model = Shapes()
    whole = {n: p.detach() for n, p in model.named_parameters()}
    save_file({k: v for k, v in whole.items() if k != "vec"} | {"mat": torch.zeros(6, 4), "extra": torch.zeros(2)},
              tmp_path / "bad.safetensors")
    with pytest.raises(ValueError) as e:
        open_weights(tmp_path / "bad.safetensors", model).check({n: t.shape for n, t in whole.items()})
    assert "vec" in str(e.value) and "'mat' has shape (6, 4), parameter 'mat' of the model has (4, 6)" in str(e.value)
    assert "extra" in str(e.value)
    llama = wrapped_from_config(hf_folders["llama"])
    with pytest.raises(ValueError, match="model type 'gpt2' and the model is a 'llama'"):
        open_weights(hf_folders["gpt2"], llama).check({n: p.shape for n, p in llama.named_parameters()})
    with pytest.raises(ValueError, match="none of what zerodp reads"):
        open_weights(tmp_path, model)


@pytest.mark.parametrize("fixture", ["stage2_fp32_tied_frozen", "stage3_fp32_tied_frozen", "stage2_bf16"])
def test_deepspeed_checkpoint_reads_equal_its_consolidation(fixture):
    state, _ = ck.consolidate(os.path.join(DS, fixture))
    model = oracle.Toy(tied="tied" in fixture, frozen="frozen" in fixture)
    source = open_weights(os.path.join(DS, fixture), model)
    assert_reads_equal(source, {n: state[n] for n, _ in model.named_parameters()})


# ---- the engine, from weights ---------------------------------------------------------------------------
CASE = oracle.CASES["tied"]
TIED_FROZEN = {"tied": True, "frozen": True}


def toy(seed: int) -> oracle.Toy:
    torch.manual_seed(seed)
    return oracle.Toy(**TIED_FROZEN)


def train(rank: int, world: int, stage: int, weights=None, state=None) -> dict:
    """A Toy whose values come from `weights` (or `state`, loaded the usual way), trained 5 steps."""
    model = toy(100 + rank)  # a different start on every rank: the values must come from the files
    if state is not None:
        model.load_state_dict(state)
    engine = zerodp.initialize(model, CASE.optimizer(model), oracle.config_for(CASE, stage, world),
                               weights=weights)
    losses = []
    for micro in oracle.batches(world, CASE.gas):
        for x, y in micro:
            sl = slice(rank * oracle.MICRO, (rank + 1) * oracle.MICRO)
            loss = engine(x[sl], y[sl])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return {"losses": losses, "state": engine.full_state_dict(), "engine": engine}


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the message every rank got
        return f"{type(e).__name__}: {e}"
    return None


def engine_runs(rank: int, world: int, root: str) -> dict:
    file = os.path.join(root, "toy.safetensors")
    state = toy(7).state_dict()
    out = {}
    for stage in range(4):
        got, ref = train(rank, world, stage, weights=file), train(rank, world, stage, state=state)
        out[stage] = (got["losses"], ref["losses"], all(torch.equal(got["state"][k], ref["state"][k])
                                                        for k in ref["state"]))
    # A zerodp checkpoint saved at stage 3 (pieces cut inside parameters), read at stage 1.
    run = train(rank, world, 3, weights=file)
    run["engine"].save_checkpoint(os.path.join(root, "ckpt"))
    got, ref = train(rank, world, 1, weights=os.path.join(root, "ckpt")), train(rank, world, 1, state=run["state"])
    out["zerodp"] = got["losses"] == ref["losses"] and all(torch.equal(got["state"][k], v)
                                                           for k, v in ref["state"].items())
    ds = os.path.join(DS, "stage3_fp32_tied_frozen")
    ds_state, _ = ck.consolidate(ds)
    model = toy(rank)
    engine = zerodp.initialize(model, CASE.optimizer(model), oracle.config_for(CASE, 2, world), weights=ds)
    out["deepspeed"] = all(torch.equal(engine.full_state_dict()[k], v) for k, v in ds_state.items())
    # Bad weights on one rank only: every rank raises, none waits for the others.
    bad = os.path.join(root, "bad.safetensors") if rank == world - 1 else file
    out["missing"] = error_of(lambda: train(rank, world, 2, weights=bad))
    other = os.path.join(root, "other.safetensors") if rank == 0 else file
    out["shape"] = error_of(lambda: train(rank, world, 3, weights=other))
    return out


@functools.cache
def spawned(world: int) -> list[dict]:
    root = tempfile.mkdtemp(prefix="zerodp-weights-")
    state = {n: p.detach() for n, p in toy(7).named_parameters()}
    save_file(state, os.path.join(root, "toy.safetensors"))
    save_file({k: v for k, v in state.items() if k != "mid.bias"}, os.path.join(root, "bad.safetensors"))
    save_file({**state, "out.weight": torch.zeros(3, 3)}, os.path.join(root, "other.safetensors"))
    if world == 1:
        with world_of_one():
            return [engine_runs(0, 1, root)]
    return run_ranks(engine_runs, world, root, timeout_s=60)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initialize_with_weights_trains_like_the_state_dict_loaded_the_usual_way(world, stage):
    for r in spawned(world):
        losses, reference, same_state = r[stage]
        assert losses == reference and same_state


@pytest.mark.parametrize("world", [1, 2])
def test_weights_from_zerodp_and_deepspeed_checkpoints(world):
    for r in spawned(world):
        assert r["zerodp"]
        assert r["deepspeed"]


@pytest.mark.parametrize("world", [1, 2])
def test_weights_that_do_not_fit_are_an_error_on_every_rank_naming_the_tensor(world):
    for r in spawned(world):
        assert "no tensor for 1 parameter(s) of the model: mid.bias" in r["missing"]
        assert "'out.weight' has shape (3, 3), parameter 'out.weight' of the model has (5, 37)" in r["shape"]


def test_deepspeed_initialize_passes_weights_through(tmp_path):
    import zerodp.deepspeed as deepspeed
    state = {n: p.detach() for n, p in toy(7).named_parameters()}
    save_file(state, tmp_path / "toy.safetensors")
    model = toy(1)
    with world_of_one():
        engine, *_ = deepspeed.initialize(model=model, optimizer=CASE.optimizer(model),
                                          config=oracle.config_for(CASE, 2, 1), weights=tmp_path / "toy.safetensors")
        got = engine.module.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())
