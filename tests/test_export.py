"""Export without gathering: the engine's weights leave bucket by bucket and are written tensor by
tensor, giving the files the whole-model path gave (final.pt and save_16bit_model as torch.save writes
the gathered state dict, `zerodp consolidate` as save_file / torch.save of the consolidated dict, HF
folders as save_pretrained), with the writer's extra memory one bucket, not the model.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from spawn import run_ranks
from torch import nn

import zerodp
from zerodp.checkpoint import write_consolidated
from zerodp.checkpoint.export_engine import save_final, save_weights


class Tied(nn.Module):
    """An embedding tied to the output head, a frozen layer and a buffer: every kind of entry."""

    def __init__(self, vocab: int = 40, width: int = 24):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.mid(self.emb(x)))) * self.scale
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())


def trained(rank: int, stage: int, steps: int = 2):
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 512,
                                    "stage3_param_persistence_threshold": 0}}
    engine = zerodp.initialize(model=Tied(), config=config)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        engine.backward(engine(torch.randint(0, 40, (2, 6), generator=gen)))
        engine.step()
    return engine


def export_ranks(rank: int, world: int, stage: int, out: str) -> dict | None:
    engine = trained(rank, stage)
    full = engine.full_state_dict()
    save_final(engine, Path(out), None)
    save_weights(engine, Path(out) / "bf16.pt", torch.bfloat16, {"mid.weight", "emb.weight"})
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    return full if rank == 0 else None


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 3), (4, 2)])
def test_streamed_final_pt_is_the_gathered_state_dict(world, stage, tmp_path):
    full = run_ranks(export_ranks, world, stage, str(tmp_path))[0]
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert list(final) == list(full)
    assert all(torch.equal(final[k], full[k]) and final[k].dtype == full[k].dtype for k in full)
    assert final["head.weight"].data_ptr() == final["emb.weight"].data_ptr()  # the tie, as torch.save keeps it
    with zipfile.ZipFile(tmp_path / "final.pt") as z:
        assert z.testzip() is None  # every record's CRC-32 is its data's
    half = torch.load(tmp_path / "bf16.pt", weights_only=True)
    assert list(half) == ["emb.weight", "mid.weight"]
    assert all(torch.equal(half[k], full[k].bfloat16()) for k in half)

    # zerodp consolidate: the files today's whole-dict writers gave (save_file / torch.save).
    write_consolidated(str(tmp_path / "ckpt"), str(tmp_path / "c.safetensors"))
    ties = {"head.weight": "emb.weight"}
    save_file({k: (v.clone() if k in ties else v).contiguous() for k, v in full.items()}, tmp_path / "ref.safetensors",
              metadata={"format": "pt", "zerodp_tied": json.dumps(ties)})
    assert _header(tmp_path / "c.safetensors") == _header(tmp_path / "ref.safetensors")  # __metadata__'s order is
    assert _data(tmp_path / "c.safetensors") == _data(tmp_path / "ref.safetensors")      # a hash map's in save_file
    write_consolidated(str(tmp_path / "ckpt"), str(tmp_path / "c.pt"))
    again = torch.load(tmp_path / "c.pt", weights_only=True)
    assert list(again) == list(full) and all(torch.equal(again[k], full[k]) for k in full)
    assert again["head.weight"].data_ptr() == again["emb.weight"].data_ptr()


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])


def _data(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[8 + struct.unpack("<Q", raw[:8])[0]:]


def test_hf_folder_is_written_in_save_pretrained_shards_and_loads_to_the_same_logits(hf_folders, tmp_path):
    from transformers import AutoModelForCausalLM

    from zerodp.models import hf_folder

    source = AutoModelForCausalLM.from_pretrained(hf_folders["llama"])
    model = type(source)(source.config)  # tensors of its own (from_pretrained's may share one storage)
    model.load_state_dict(source.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    wrapped = {f"model.{k}": v for k, v in model.state_dict().items()}  # zerodp's HFCausalLM's names
    hf_folder.write_folder(tmp_path / "ours", wrapped, hf_folder.description(model, None), max_shard_size=40_000)
    model.save_pretrained(tmp_path / "hf", max_shard_size=40_000)
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) > 3
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == names
    for name in names:  # the same bytes: shards, index, config
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    ids = torch.arange(40).remainder(300).view(2, 20)
    assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_hf_folder_names_a_missing_or_mis_shaped_tensor_before_writing(hf_folders, tmp_path):
    from zerodp.models import hf_folder
    from zerodp.models.build import build_model

    model, _ = build_model(str(hf_folders["llama"]), 300, None)
    state, description = model.state_dict(), hf_folder.description(model.model, None)
    with pytest.raises(ValueError, match=r"miss 1 tensor\(s\).*model.norm.weight"):
        hf_folder.write_folder(tmp_path / "a", {k: v for k, v in state.items() if k != "model.model.norm.weight"},
                               description)
    state["model.model.norm.weight"] = torch.ones(31)
    with pytest.raises(ValueError, match=r"'model.norm.weight' is \(31,\), the model's is \(32,\)"):
        hf_folder.write_folder(tmp_path / "b", state, description)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


class Wide(nn.Module):
    """32 MiB of fp32 weights in 8 parameters: whole-model and one-bucket peaks differ clearly."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024, bias=False) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _peak_rss_during(fn) -> int:
    """Peak resident bytes above the current ones while fn runs (Linux: VmHWM reset by clear_refs).

    Only an upper bound: under memory pressure the kernel may drop this process's file-backed pages
    (torch's libraries) while fn runs, which lowers the reading (CI once read 24 of 32 MiB held)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _peak_tensor_bytes_during(fn) -> int:
    """Peak bytes of tensor storage created while fn runs, from the profiler's allocation timeline:
    exact and independent of the kernel's paging, but blind to memory that is not a tensor's."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        fn()
    live = peak = 0
    for _, action, _, size in p._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def export_peaks(rank: int, world: int, out: str) -> dict[str, int]:
    """Extra peak bytes of the streamed export and of gathering then torch.save, one rank: as tensor
    storage (exact) and as resident memory (an upper bound that also sees what is not a tensor)."""
    # Every allocation above 64 KiB is its own mapping, returned on free: resident bytes then follow
    # the live tensors (glibc would otherwise keep freed buckets and reuse them unseen).
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 0, "reduce_bucket_size": 1 << 20}}  # 4 MiB buckets
    engine = zerodp.initialize(model=Wide(), config=config)
    stream = lambda: save_final(engine, Path(out), None)
    gather = lambda: torch.save(engine.full_state_dict(), Path(out) / "old.pt")
    saved = lambda: save_weights(engine, Path(out) / "saved.pt")  # save_16bit_model's path (save_weights' filter)
    return {"streamed_rss": _peak_rss_during(stream), "streamed": _peak_tensor_bytes_during(stream),
            "saved": _peak_tensor_bytes_during(saved), "gathered": _peak_tensor_bytes_during(gather)}


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's clear_refs")
def test_export_holds_one_bucket_where_gathering_held_the_whole_model(tmp_path):
    peaks = run_ranks(export_peaks, 1, str(tmp_path))[0]
    model_bytes, bucket_bytes = 8 * 1024 * 1024 * 4, 1 << 22
    assert peaks["gathered"] >= model_bytes  # what the test tells apart: the whole model held once more
    for kind in ("streamed", "streamed_rss", "saved"):
        assert peaks[kind] < 2 * bucket_bytes, f"{kind}: export held {peaks[kind] / 2**20:.1f} MiB more (bucket: 4 MiB)"
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    old = torch.load(tmp_path / "old.pt", weights_only=True)
    assert all(torch.equal(final[k], old[k]) for k in old)


def test_zero_trainer_saves_a_folder_that_loads_to_the_engines_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_hf_trainer import dataset, tiny_llama, world_of_one

    from zerodp.integrations.hf import ZeroTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
                                          disable_tqdm=True, log_level="error")
    with world_of_one():
        trainer = ZeroTrainer(model=tiny_llama(), args=args, train_dataset=dataset(),
                              zero_config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
        trainer.train()
        (tmp_path / "saved").mkdir()
        stale = tmp_path / "saved" / "model-00001-of-00002.safetensors"  # a previous, sharded save's
        stale.write_bytes(b"stale")
        trainer.save_model(str(tmp_path / "saved"))
        full = trainer.engine.full_state_dict()
    assert not stale.exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert {"config.json", "model.safetensors", "training_args.bin"} <= {p.name for p in (tmp_path / "saved").iterdir()}
    reference = tiny_llama()
    reference.load_state_dict(full)
    ids = torch.arange(16).view(2, 8)
    assert torch.equal(loaded.eval()(ids).logits, reference.eval()(ids).logits)
