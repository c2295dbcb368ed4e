"""Specification of the fp16 dynamic loss scale: DeepSpeed's rule, key by key; and of the bf16 masters and
optimizer states (their exactness, their rounding, their bytes per parameter).

The scale sequences below are what DeepSpeed's own DynamicLossScaler (deepspeed.runtime.fp16.loss_scaler,
DeepSpeed 0.19.8) gives for the same overflow pattern and settings, one update_scale(overflow) per step
(init_scale = 2 ** initial_scale_power, delayed_shift = hysteresis, scale_window = loss_scale_window).
"""

import pytest
import torch

from zerodp.config import load_config
from zerodp.engine.stepping.low_precision import first_remainder, join_master, split_master, stochastic_round
from zerodp.engine.stepping.precision import LossScaler
from zerodp.plan import formulas

PATTERN = [1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0]  # 1: the step overflowed


@pytest.mark.parametrize("fp16, deepspeed_scales", [
    ({"initial_scale_power": 4, "loss_scale_window": 3, "min_loss_scale": 2, "hysteresis": 2},
     [16, 16, 8, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2]),
    ({"initial_scale_power": 5, "loss_scale_window": 2, "min_loss_scale": 1, "hysteresis": 3,
      "consecutive_hysteresis": True},
     [32, 32, 32, 32, 32, 32, 64, 64, 64, 32, 32, 32, 64, 64, 128, 128, 128, 128, 128, 64, 32, 16, 16, 16]),
])
def test_dynamic_loss_scale_follows_deepspeeds_scaler(fp16, deepspeed_scales):
    scaler = LossScaler.from_config(load_config({"fp16": {"enabled": True, **fp16}}))
    seen = []
    for overflow in PATTERN:
        scaler.update(bool(overflow))
        seen.append(scaler.scale)
    assert seen == deepspeed_scales



# ---- bf16 masters and optimizer states (engine/stepping/low_precision.py) ------------------------------
def _awkward_fp32(n: int = 100_000) -> torch.Tensor:
    """fp32 values over many binades, both signs, zeros, subnormals, and exact bf16 ties."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    ties = (torch.randn(64, generator=g).to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)
    return torch.cat([x, ties, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0e38, -3.0e38])])


def test_a_bf16_master_and_its_remainder_are_the_fp32_master_bit_for_bit():
    x = _awkward_fp32()
    working, remainder = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int16)
    split_master(x, working, remainder)
    back = torch.empty_like(x)
    join_master(working, remainder, back)
    assert torch.equal(back.view(torch.int32), x.view(torch.int32))
    # the working value is x rounded to bf16: within half a bf16 ulp (the plain cast's, but for ties)
    nearest = x.to(torch.bfloat16)
    assert (working != nearest).sum() <= 64
    assert ((working.float() - x).abs() <= (nearest.float() - x).abs() + (x.abs() * 2 ** -9)).all()
    # set-up's working shards are rounded to nearest even already: their remainders, exact but at ties
    first = first_remainder(x, nearest)
    join_master(nearest, first, back)
    assert (back != x).sum() <= 64 and ((back - x).abs() <= x.abs() * 2 ** -23).all()


def test_bf16_adam_states_rounded_stochastically_keep_moving_where_rounding_to_nearest_stalls():
    """Adam's v with beta2 = 0.999 moves by 1e-3 of itself a step, under half a bf16 ulp (2^-9): rounded to
    nearest it stops; stochastically rounded it follows the fp32 EMA (unbiased)."""
    beta2, steps, g2 = 0.999, 3000, torch.ones(4096)
    exact, nearest, stochastic = torch.zeros(4096), torch.zeros(4096, dtype=torch.bfloat16), torch.zeros(4096)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        exact = beta2 * exact + (1 - beta2) * g2
        nearest = (beta2 * nearest.float() + (1 - beta2) * g2).to(torch.bfloat16)
        stochastic = stochastic_round(beta2 * stochastic + (1 - beta2) * g2, gen).float()
    target = 1 - beta2 ** steps  # 0.950
    assert exact.mean() == pytest.approx(target, rel=1e-4)
    assert nearest.float().max() < 0.6 * target  # stalled
    assert stochastic.mean() == pytest.approx(target, rel=5e-3)


def test_estimate_counts_the_bytes_per_parameter_of_each_optimizer_precision():
    assert [formulas.optimizer_bytes("adam", "bf16", m, s) for m, s in
            [(False, False), (False, True), (True, False), (True, True)]] == [12, 8, 10, 6]
    psi = 10 ** 9
    assert formulas.formula(psi, 1, 0) == 16 * psi
    assert formulas.formula(psi, 1, 0, bf16_master=True, bf16_states=True) == 10 * psi
    assert formulas.formula(psi, 8, 1, bf16_master=True, bf16_states=True) == 4 * psi + 6 * psi // 8
    with pytest.raises(ValueError, match="need dtype bf16"):
        formulas.formula(psi, 8, 1, "fp32", bf16_states=True)


def test_bf16_masters_and_states_survive_a_checkpoint(tmp_path):
    """World of one, in-process: saved, loaded into a fresh engine, trained on; the compensated masters come back
    bit for bit (they are saved as their fp32 values), the states come back and are bf16 again after a step."""
    import zerodp
    from zerodp.engine.engine import inside
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        return zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)

    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    first = engine()
    for _ in range(2):
        first.backward(first(x).square().mean())
        first.step()
    saved = [m.clone() for m in inside(first).training.master_shards()]
    first.save_checkpoint(str(tmp_path), "t")
    second = engine()
    second.load_checkpoint(str(tmp_path), "t")
    loaded = inside(second).training.master_shards()
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(saved, loaded))
    second.backward(second(x).square().mean())
    second.step()
    states = [v for s in second.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and all(v.dtype == torch.bfloat16 for v in states)
    report = second.memory_report()
    assert report["fp32_master"] == 0 and report["master_remainders"] > 0


@pytest.mark.parametrize("config, says", [
    ({"bf16": {"bf16_optimizer_states": True}}, "set with bf16.enabled false"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "with zero_optimization.offload_optimizer"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16 masters would lose fp32's range"),
])
def test_low_precision_optimizer_keys_refused_where_they_cannot_hold(config, says):
    from zerodp.config import ConfigError
    with pytest.raises((ConfigError, ValueError), match=says):
        load_config(config)
