"""The size of the gradient buckets at stages 0-2 (layout.bucket_numel): reduce_bucket_size as configured, and
left at its default on gloo a fraction of the model, so that reductions overlap backward bucket by bucket."""

from __future__ import annotations

import torch
from torch import nn

import zerodp
from zerodp.config import load_config
from zerodp.config.zero_optimization import ZeroConfig
from zerodp.engine.engine import inside
from zerodp.engine.layout.layout import MIN_OVERLAP_BUCKET, OVERLAP_BUCKETS, bucket_numel

DEFAULT = ZeroConfig().reduce_bucket_size


def _zero(**keys) -> ZeroConfig:
    return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, **keys}}).zero_optimization


def test_left_at_its_default_on_gloo_a_bucket_holds_an_eighth_of_the_model():
    assert bucket_numel(_zero(), "gloo", 80_000_000) == 80_000_000 // OVERLAP_BUCKETS
    assert bucket_numel(_zero(), "gloo", 1000) == MIN_OVERLAP_BUCKET  # a small model: gloo's cost per call
    assert bucket_numel(_zero(), "gloo", 100 * DEFAULT) == DEFAULT   # never more than the default


def test_a_configured_size_and_other_backends_keep_reduce_bucket_size():
    assert bucket_numel(_zero(reduce_bucket_size=DEFAULT), "gloo", 80_000_000) == DEFAULT  # set, even to the default
    assert bucket_numel(_zero(reduce_bucket_size=1000), "gloo", 80_000_000) == 1000
    assert bucket_numel(_zero(), "nccl", 80_000_000) == DEFAULT


def _layout(zero: dict):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])  # 1,052,672 elements
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters()),
                               {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, **zero}})
    assert inside(engine).comm.backend == "gloo"
    return inside(engine).layout


def test_an_engine_on_gloo_lays_out_several_buckets_by_default_and_one_when_told():
    several = _layout({})
    assert several.bucket_numel == MIN_OVERLAP_BUCKET
    assert len(several.buckets) == 6 and all(b.numel <= MIN_OVERLAP_BUCKET for b in several.buckets)  # 3 layers each
    assert len(_layout({"reduce_bucket_size": DEFAULT}).buckets) == 1
