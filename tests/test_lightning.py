"""zerodp under Lightning: `ZeroStrategy` in `lightning.Trainer` and `ZeroFabricStrategy` in `lightning.Fabric`.

Oracles: the same LightningModule (built in configure_model, so on meta under ZeroStrategy; AdamW + a per-step
lr schedule from configure_optimizers; accumulate_grad_batches=2; gradient_clip_val) ends at stages 1-3 with the
weights Lightning's own DDPStrategy ends with, same loop and data; bf16-mixed within bf16 noise of DDP's; a
ModelCheckpoint save at 2 ranks resumed with fit(ckpt_path=...) at 1 rank ends at the uninterrupted weights;
Fabric's loop (setup, backward, clip_gradients, no_backward_sync accumulation, save/load) equals plain torch on one
process with the whole batch. All 2-rank runs share one fork of two gloo ranks, the 1-rank ones (the resume, a
validate on its own, docs/LIGHTNING.md's quick start) another; the processes are made outside Lightning, as
torchrun would, so Lightning launches none."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # Lightning's loops collect often (conftest.py)

from spawn import run_ranks  # noqa: E402
from zerodp.engine.engine import inside  # noqa: E402

N, DIM, BATCH, ACC, STEPS, CLIP = 32, 8, 4, 2, 4, 0.5


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    return x, x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)


def loader(batch: int = BATCH):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=batch)


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = net()
            self.built_on = next(self.net.parameters()).device.type  # "meta" under ZeroStrategy

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y.float()), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x).float(), y.float()), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).float()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer(strategy, devices: int = 2, precision: str = "32-true", steps: int = STEPS, **kwargs):
    # Lightning's default ModelCheckpoint would write into the working directory: only where a test asks.
    callbacks = kwargs.get("callbacks", [])
    kwargs.setdefault("enable_checkpointing", any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks))
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_steps=steps,
                     accumulate_grad_batches=ACC, gradient_clip_val=CLIP, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def weights(t, module: nn.Module) -> dict[str, torch.Tensor]:
    engine = getattr(t.strategy, "engine", None)
    state = engine.full_state_dict() if engine is not None else module.state_dict()
    return {k: v.detach().float().clone() for k, v in state.items()}


def fit(strategy, precision: str = "32-true", **kwargs) -> tuple[dict, dict]:
    L.seed_everything(0, verbose=False)
    model = Regression()
    t = trainer(strategy, precision=precision, **kwargs)
    t.fit(model, loader(), loader())
    metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    metrics["built_on"] = model.built_on
    engine = getattr(t.strategy, "engine", None)
    metrics["stage"] = inside(engine).spec.stage if engine is not None else None  # None: no zerodp engine
    return weights(t, model), metrics, t, model


def set_env(rank: int, world: int) -> None:
    import logging
    logging.getLogger("lightning").setLevel(logging.WARNING)  # its per-fit banners
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", OMP_NUM_THREADS="1")


class StateDictSeen(L.pytorch.callbacks.Callback):
    """What a callback's on_save_checkpoint finds in checkpoint["state_dict"] at the last save."""

    def __init__(self):
        self.seen: dict[str, torch.Tensor] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.seen = {k: v.detach().float().clone() for k, v in checkpoint["state_dict"].items()}


def trainer_runs(rank: int, world: int, out: str) -> dict:
    from zerodp.integrations.lightning import ZeroStrategy

    set_env(rank, world)
    results = {"ddp": fit("ddp")[:2]}
    # Stage 1 by its registered name; stage 2 also saves through ModelCheckpoint and trainer.save_checkpoint.
    results["zero1"] = fit("zerodp_stage_1")[:2]
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{out}/ckpt", every_n_train_steps=2, save_top_k=-1)
    seen = StateDictSeen()
    w, metrics, t, _ = fit(ZeroStrategy({"zero_optimization": {"stage": 2}}), callbacks=[checkpoints, seen])
    results["zero2"] = (w, metrics)
    t.save_checkpoint(f"{out}/final.ckpt")
    results["final_files"] = sorted(os.listdir(f"{out}/final.ckpt"))
    results["zero2_seen"] = seen.seen
    seen = StateDictSeen()
    w, metrics, t, model = fit(ZeroStrategy({"zero_optimization": {"stage": 3}}), callbacks=[seen])
    results["zero3"] = (w, metrics)
    t.save_checkpoint(f"{out}/final3.ckpt")  # every rank, as Lightning's saves run: stage 3's state dict gathers
    results["zero3_seen"] = seen.seen
    # After fit, through the engine (stage 3 gathers per unit).
    results["validate"] = t.validate(model, loader(), verbose=False)[0]["val_loss"]
    results["test"] = t.test(model, loader(), verbose=False)[0]["test_loss"]
    results["predict"] = torch.cat(t.predict(model, loader()))
    results["ddp_bf16"] = fit("ddp", precision="bf16-mixed")[0]
    results["zero_bf16"] = fit(ZeroStrategy({"zero_optimization": {"stage": 2}}), precision="bf16-mixed")[0]
    results["fabric"] = fabric_runs(rank, world, out)
    return results


def resume_run(rank: int, world: int, ckpt: str) -> dict:
    from zerodp.integrations.lightning import ZeroStrategy

    set_env(rank, world)
    L.seed_everything(0, verbose=False)
    model = Regression()
    t = trainer(ZeroStrategy({"zero_optimization": {"stage": 2}}), devices=1)
    t.fit(model, loader(2 * BATCH), ckpt_path=ckpt)  # one rank: each micro-batch holds both ranks' rows
    resumed = weights(t, model)
    # validate on its own (no fit): configure_model builds whole on the device, as under DDP
    fresh = trainer(ZeroStrategy({"zero_optimization": {"stage": 3}}), devices=1)
    alone = fresh.validate(Regression(), loader(), verbose=False)[0]["val_loss"]
    return {"resumed": resumed, "validate_alone": alone, "docs": _docs_quick_start()}


@functools.cache
def trainer_results() -> tuple[dict, dict, list[str]]:
    with tempfile.TemporaryDirectory() as out:
        results = run_ranks(trainer_runs, 2, out, timeout_s=120)[0]
        saved = sorted(os.listdir(f"{out}/ckpt"))
        one_rank = run_ranks(resume_run, 1, f"{out}/ckpt/{saved[0]}", timeout_s=120)[0]
        from zerodp.checkpoint.export import consolidate  # what `zerodp consolidate DIR OUT` writes
        results["consolidated"] = {k: v.float() for k, v in consolidate(f"{out}/final.ckpt")[0].items()}
    return results, one_rank, saved


def initial() -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    return {f"net.{k}": v for k, v in net().state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_strategy_ends_with_the_weights_of_lightnings_ddp(stage):
    results, _, _ = trainer_results()
    diff = max_diff(results[f"zero{stage}"][0], results["ddp"][0])
    print(f"stage {stage}: max weight difference to DDPStrategy {diff:.2e}")
    assert diff < 2e-5
    assert max_diff(results["ddp"][0], initial()) > 1e-2  # it trained
    ddp_metrics, metrics = results["ddp"][1], results[f"zero{stage}"][1]
    assert ddp_metrics["built_on"] == "cpu" and metrics["built_on"] == "meta"
    assert ddp_metrics["stage"] is None and metrics["stage"] == stage
    assert metrics["train_loss"] == pytest.approx(ddp_metrics["train_loss"], abs=2e-5)
    assert metrics["val_loss"] == pytest.approx(ddp_metrics["val_loss"], abs=2e-5)


def test_validate_test_predict_after_fit_run_through_the_engine():
    results, _, _ = trainer_results()
    assert results["validate"] == pytest.approx(results["zero3"][1]["val_loss"], abs=1e-6)
    assert results["test"] == pytest.approx(results["validate"], abs=1e-6)
    assert results["predict"].shape == (N // 2, 1)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_callbacks_on_save_checkpoint_sees_the_whole_weights(stage):
    """checkpoint["state_dict"] holds the module's weights as under DDP (stage 3: gathered on every rank),
    keyed as the LightningModule's own state_dict, though the files hold zerodp's shards."""
    results, _, _ = trainer_results()
    seen = results[f"zero{stage}_seen"]
    assert seen.keys() == initial().keys()
    assert max_diff(seen, results[f"zero{stage}"][0]) == 0.0  # the trained weights, not the initial ones
    assert max_diff(seen, initial()) > 1e-2


def test_bf16_mixed_is_zerodp_bf16_within_bf16_noise_of_ddp():
    results, _, _ = trainer_results()
    diff = max_diff(results["zero_bf16"], results["ddp_bf16"])
    moved = max_diff(results["ddp_bf16"], results["ddp"][0])
    print(f"bf16: max weight difference to DDP bf16-mixed {diff:.2e} (DDP bf16 vs fp32 {moved:.2e})")
    assert diff < 5e-3


def test_model_checkpoint_at_2_ranks_resumes_at_1_rank_to_the_uninterrupted_weights():
    results, resumed, saved = trainer_results()
    assert saved == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    assert "lightning_state.pt" in results["final_files"] and "latest" in results["final_files"]
    assert max_diff(results["consolidated"], results["zero2"][0]) == 0  # trainer.save_checkpoint, exported whole
    diff = max_diff(resumed["resumed"], results["zero2"][0])
    print(f"resumed at 1 rank: max weight difference to uninterrupted {diff:.2e}")
    assert diff < 2e-5


# ---- Fabric ---------------------------------------------------------------------------------------------
FABRIC_STEPS, SAVE_AT = 4, 2


def fabric_loop(fabric, model, optimizer, rank: int, world: int, steps: range, save: str | None = None) -> None:
    """The loop of Fabric's docs: ACC micro-batches a step, the first ACC-1 under no_backward_sync, the loss
    divided by ACC, clip_gradients, step, zero_grad; each rank takes its rows of the global micro-batch."""
    x, y = data()
    for step in steps:
        for micro in range(ACC):
            start = ((step * ACC + micro) * world * BATCH) % N + rank * BATCH
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            with fabric.no_backward_sync(model, enabled=micro < ACC - 1):
                fabric.backward(nn.functional.mse_loss(model(xb), yb) / ACC)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        if save is not None and step + 1 == SAVE_AT:
            fabric.save(save, {"model": model, "optimizer": optimizer, "step": step + 1})


def plain_torch() -> dict[str, torch.Tensor]:
    """One process, the whole global micro-batch (both ranks' rows), the same loop in plain torch."""
    torch.manual_seed(0)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    x, y = data()
    for step in range(FABRIC_STEPS):
        for micro in range(ACC):
            start = ((step * ACC + micro) * 2 * BATCH) % N
            (nn.functional.mse_loss(model(x[start:start + 2 * BATCH]), y[start:start + 2 * BATCH]) / ACC).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fabric_run(rank: int, world: int, stage: int, together: bool, save: str | None = None,
               load: str | None = None) -> dict[str, torch.Tensor]:
    from zerodp.integrations.lightning import ZeroFabricStrategy

    config = {"zero_optimization": {"stage": stage}, "gradient_clipping": CLIP}
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ZeroFabricStrategy(config))
    fabric.launch()  # the processes exist (made outside Lightning, as torchrun does): it only sets up
    torch.manual_seed(0)
    model = net()
    if together:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    first = 0
    if load is not None:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(load, state)
        first = state["step"]
    fabric_loop(fabric, model, optimizer, rank, world, range(first, FABRIC_STEPS), save)
    return {k: v.float() for k, v in fabric.strategy.engine.full_state_dict().items()}


def fabric_runs(rank: int, world: int, out: str) -> dict:
    return {"stage2": fabric_run(rank, world, 2, True, save=f"{out}/fabric.ckpt"),
            "stage1_separate": fabric_run(rank, world, 1, False),
            "stage3_resumed": fabric_run(rank, world, 3, True, load=f"{out}/fabric.ckpt")}


@pytest.mark.parametrize("run", ["stage2", "stage1_separate", "stage3_resumed"])
def test_fabric_loop_with_zero_fabric_strategy_equals_plain_torch(run):
    diff = max_diff(trainer_results()[0]["fabric"][run], plain_torch())
    print(f"fabric {run}: max weight difference to plain torch {diff:.2e}")
    assert diff < 2e-5


@pytest.mark.parametrize("setting, words", [
    ({"precision": "bf16-true"}, "precision='bf16-true' has no exact zerodp equivalent"),
    ({"precision": "64-true"}, "precision='64-true' has no exact zerodp equivalent"),
    ({"gradient_clip_algorithm": "value"}, "gradient_clip_algorithm='value' is not supported by ZeroStrategy"),
    ({"accumulate_grad_batches": 3}, "gradient_accumulation_steps=2 but accumulate_grad_batches says 3"),
])
def test_what_zero_strategy_cannot_run_exactly_is_refused_by_name(setting, words):
    from zerodp.integrations.lightning import ZeroStrategy

    strategy = ZeroStrategy({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2})
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": CLIP, **setting}
    t = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, **kwargs)
    with pytest.raises(Exception, match=words.replace("(", r"\(").replace(")", r"\)")):
        strategy._config_for(t)


def test_config_precision_section_must_agree_with_lightnings_precision():
    from zerodp.integrations.lightning import ZeroStrategy

    # (On a CPU Lightning itself turns "16-mixed" into "bf16-mixed", with a warning.)
    strategy = ZeroStrategy({"fp16": {"enabled": True}})
    t = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", logger=False)
    with pytest.raises(Exception, match="enables fp16 but Lightning's precision is 'bf16-mixed'"):
        strategy._config_for(t)


def _docs_quick_start() -> dict:
    """docs/LIGHTNING.md's python block as written, in a fresh folder (run in the 1-rank launch)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "LIGHTNING.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) == 1
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as out:
        os.chdir(out)
        try:
            namespace = {"__name__": "__main__"}
            exec(compile(blocks[0], "docs/LIGHTNING.md", "exec"), namespace)
            return {"trainer_steps": namespace["trainer"].global_step,
                    "fabric_steps": namespace["fabric"].strategy.engine.global_steps,
                    "files": sorted(os.listdir(os.path.join(out, "out")))}
        finally:
            os.chdir(here)


def test_validate_on_its_own_runs_the_module_whole():
    _, one_rank, _ = trainer_results()
    assert 0 < one_rank["validate_alone"] < float("inf")


def test_quick_start_of_the_docs_runs_on_a_cpu_as_written():
    _, one_rank, _ = trainer_results()
    result = one_rank["docs"]
    assert result["trainer_steps"] == 4 and result["fabric_steps"] == 4
    assert "fabric.ckpt" in result["files"]
