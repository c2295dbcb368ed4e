"""Activation checkpointing: same training as without it, offloaded inputs, the contiguous buffer."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch

import zerodp
from spawn import run_ranks
from zerodp.activations import Checkpointer, attached, checkpoint, checkpoint_blocks
from zerodp.models.gpt import GPT, Block, gpt_config

MICRO, SEQ, STEPS = 2, 32, 3
STAGES = [0, 2]  # checkpointing only changes backward: the stages that reduce differently suffice
MODES = {
    "plain": {},
    "cpu": {"cpu_checkpointing": True},
    "contiguous": {"contiguous_memory_optimization": True, "number_checkpoints": 2},
    "cpu+contiguous": {"cpu_checkpointing": True, "contiguous_memory_optimization": True,
                       "number_checkpoints": 2},
}


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny"))


def tokens(world: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (world * MICRO, SEQ + 1), generator=g)


def _train(rank: int, world: int, mode: str | None, stage: int) -> dict:
    model = tiny_gpt()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage},
              "activation_checkpointing": MODES.get(mode, {})}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    if mode is not None:
        checkpoint_blocks(engine.module, (Block,), engine.config.activation_checkpointing)
    losses = []
    for step in range(STEPS):
        batch = tokens(world, step)[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": engine.full_state_dict(), "report": engine.memory_report()}


def _runs(rank: int, world: int) -> dict:
    return {(mode, stage): _train(rank, world, mode, stage)
            for stage in STAGES for mode in (None, "plain", "cpu+contiguous")}


@functools.cache
def engine_runs(world: int) -> dict:
    return run_ranks(_runs, world)[0]


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world={w}")
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage={s}")
@pytest.mark.parametrize("mode", ["plain", "cpu+contiguous"])
def test_checkpointed_training_matches_plain_training_fp32(mode, stage, world):
    runs = engine_runs(world)
    ours, ref = runs[(mode, stage)], runs[(None, stage)]
    assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-6)
    assert ours["state"].keys() == ref["state"].keys()
    for k in ref["state"]:
        torch.testing.assert_close(ours["state"][k], ref["state"][k], rtol=1e-6, atol=1e-6)
    # the engine's memory report sees the checkpointed inputs: one (MICRO, SEQ, 64) fp32 input per block
    key = "checkpointed_activations_host" if "cpu" in mode else "checkpointed_activations_device"
    assert ours["report"][key] >= 2 * MICRO * SEQ * 64 * 4
    assert not any(k.startswith("checkpointed") for k in ref["report"])


def _grads(model: GPT, batch: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(batch[:, :-1], batch[:, 1:]).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["cpu", "contiguous", "cpu+contiguous"])
def test_offloaded_and_contiguous_checkpoints_give_identical_gradients(mode):
    model, batch = tiny_gpt(), tokens(2, 0)
    ckpt = checkpoint_blocks(model, Block)
    expected = _grads(model, batch)
    ckpt.remove()
    ckpt = checkpoint_blocks(model, Block, MODES[mode])
    for _ in range(2):  # the second step reuses the buffers of the first
        got = _grads(model, batch)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    ckpt.remove()


def test_cpu_checkpointing_releases_the_device_copy():
    w = torch.randn(16, 16, requires_grad=True)

    def fn(x):
        return torch.tanh(x @ w) * x

    for offload, kept_alive in ((False, True), (True, False)):
        ckpt = Checkpointer(cpu_checkpointing=offload)
        x = torch.randn(8, 16, requires_grad=True) * 2  # a non-leaf, like a block's input
        out = ckpt(fn, x)
        ref = weakref.ref(x)
        del x
        assert (ref() is not None) == kept_alive
        assert ckpt.live_bytes == 8 * 16 * 4  # exactly the one input is held, on the host if offloaded
        out.sum().backward()
        assert ckpt.live_bytes == 0  # released after backward


def test_contiguous_buffer_holds_every_checkpoint_without_allocating():
    model, batch = tiny_gpt(), tokens(2, 0)
    ckpt = checkpoint_blocks(model, Block, MODES["contiguous"])
    kept = []
    pack = ckpt._pack
    ckpt._pack = lambda x: kept.append(pack(x)) or kept[-1]
    buffers = []
    for _ in range(2):
        loss = model(batch[:, :-1], batch[:, 1:])
        storage = ckpt.buffer.untyped_storage()
        assert len(kept) == model.config.n_layer
        assert all(k.tensor.untyped_storage().data_ptr() == storage.data_ptr() for k in kept)
        assert sorted(k.slot for k in kept) == list(range(model.config.n_layer))
        # each kept input links to the block's before it: the order backward prefetches them in
        assert kept[1].prev() is kept[0]
        buffers.append(storage.data_ptr())
        kept.clear()
        loss.backward()
    assert buffers[0] == buffers[1]  # sized on first use, then reused
    assert ckpt.bytes()["checkpointed_activations_device"] == ckpt.buffer.numel()
    ckpt.remove()


def test_too_few_contiguous_slots_is_a_clear_error():
    model, batch = tiny_gpt(), tokens(1, 0)
    checkpoint_blocks(model, Block, {"contiguous_memory_optimization": True, "number_checkpoints": 1})
    with pytest.raises(RuntimeError, match="number_checkpoints=1"):
        model(batch[:, :-1], batch[:, 1:])


def test_checkpoint_blocks_is_reversible():
    model, batch = tiny_gpt(), tokens(1, 0)
    special = model.blocks[1]
    own = special.forward  # an instance-level forward set by someone else must survive
    special.forward = own
    before = model(batch[:, :-1]).detach()
    ckpt = checkpoint_blocks(model, Block, MODES["cpu"])
    assert attached(model) is ckpt
    assert all(b.forward.__wrapped__ is not None for b in model.blocks)
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_blocks(model, Block)
    ckpt.remove()
    assert "forward" not in model.blocks[0].__dict__
    assert special.__dict__["forward"] is own
    assert attached(model) is None
    assert torch.equal(model(batch[:, :-1]).detach(), before)


def test_checkpoint_blocks_needs_a_matching_block():
    with pytest.raises(ValueError, match="no submodule of type Linear"):
        checkpoint_blocks(torch.nn.Sequential(torch.nn.ReLU()), torch.nn.Linear)


def test_checkpoint_function_matches_direct_call():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    checkpoint(lambda t: torch.sin(t @ w), x).sum().backward()
    g = w.grad.clone()
    w.grad = None
    torch.sin(x @ w).sum().backward()
    assert torch.equal(g, w.grad)


def test_partition_activations_is_refused_with_a_reason():
    with pytest.raises(zerodp.ConfigError, match="model-parallel"):
        zerodp.load_config({"train_micro_batch_size_per_gpu": 1,
                            "activation_checkpointing": {"partition_activations": True}})
