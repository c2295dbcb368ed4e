"""Rank-side checks of the tensor-parallel export (issue 26), run inside test_tensor_parallel.py's one
4-rank launch (its `_ranks` calls these); tests/test_tp_export.py reads what they return.

`exported(engine)`: what every exporter of a (dp, tp) engine gives (the streamed shapes,
engine.full_state_dict() on every rank, save_weights' file, written by the world's rank 0 only).
`deepspeed_16bit(mesh)`: zerodp.deepspeed's stage-3 saving paths on a Megatron-style model (mpu).
`uneven(mesh)`: shards of unequal sizes (5 rows over 2 tp ranks) join too.
`llama(mesh, stage)`: a tiny Hugging Face Llama split by transformers' own tp plan (docs/CONFIG.md's route:
its vocabulary-parallel embedding, attention and MLP projections and head) trains at (dp 2, tp 2); its
save_hf folder is loaded with from_pretrained in this one process.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

import zerodp
import zerodp.deepspeed as zds
from zerodp.checkpoint.export_engine import save_hf, save_weights
from zerodp.engine.engine import inside
from zerodp.models.hf_folder import description

def checks(mesh: DeviceMesh) -> dict:
    """What test_tp_export.py reads beside each oracle run's `exported`, on the (dp 2, tp 2) mesh."""
    return {"llama": {stage: llama(mesh, stage) for stage in (1, 2, 3)}, "16bit": deepspeed_16bit(mesh),
            "uneven": uneven(mesh)}


def apply_hf_tp_plan(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """docs/CONFIG.md's apply_hf_tp_plan, run as written: transformers' own plan of the model on tp_mesh."""
    blocks = re.findall(r"^```python\n(.*?)^```", (DOCS / "CONFIG.md").read_text(), flags=re.S | re.M)
    scope: dict = {}
    exec(compile(next(b for b in blocks if "def apply_hf_tp_plan" in b), "docs/CONFIG.md", "exec"), scope)
    return scope["apply_hf_tp_plan"](model, tp_mesh)


DOCS = Path(__file__).resolve().parents[1] / "docs"
LLAMA_STEPS, LLAMA_BATCH, LLAMA_SEQ, VOCAB, LLAMA_CLIP = 3, 4, 8, 64, 1.0


def exported(engine) -> dict:
    """The engine's export: global shapes (before any value), full_state_dict and the saved file (on the
    world's rank 0; None elsewhere, where no file may appear), or the error every rank raised."""
    with tempfile.TemporaryDirectory(prefix="tp_export.") as folder:
        path = os.path.join(folder, "weights.pt")
        engine = getattr(engine, "engine", engine)  # zerodp.deepspeed's engine: the zerodp engine it wraps
        try:
            # Its stream is left unstarted: none of its collectives begun, none left waiting.
            shapes = {n: (tuple(s), d) for n, (s, d) in inside(engine).weights().shapes.items()}
            full = engine.full_state_dict()
            save_weights(engine, path)
        except ValueError as e:
            return {"error": str(e)}
        written = os.path.exists(path)
        return {"shapes": shapes, "full": full, "wrote": written,
                "file": torch.load(path, weights_only=True) if written else None}


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    # 4 heads and 2 key/value heads: each of 2 tp ranks computes 2 heads from its 1 key/value head.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LLAMA_SEQ,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference_llama() -> dict:
    """The oracle: one process trains the whole Llama on the whole batch (plain AdamW, clip_grad_norm_);
    its losses and the probe batch's logits after training."""
    model = _tiny_llama()
    opt = _adamw(model)
    losses = []
    for step in range(LLAMA_STEPS):
        ids = _tokens(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), LLAMA_CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        return {"losses": losses, "trained": model(input_ids=_tokens(-1)).logits}


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (LLAMA_BATCH, LLAMA_SEQ), generator=torch.Generator().manual_seed(200 + step))


def llama(mesh: DeviceMesh, stage: int) -> dict:
    """Train the tp Llama LLAMA_STEPS steps, export it with save_hf; the world's rank 0 loads the folder
    with from_pretrained. Logits of one probe batch: the untrained model's, the tp engine's after
    training, the loaded folder's."""
    model = _tiny_llama()
    probe = _tokens(-1)
    with torch.no_grad():
        before = model(probe).logits
    apply_hf_tp_plan(model, mesh["tp"])  # transformers' own plan (vocabulary-parallel embedding included)
    config = {"train_micro_batch_size_per_gpu": LLAMA_BATCH // 2, "gradient_clipping": LLAMA_CLIP,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000}}
    engine = zerodp.initialize(model, _adamw(model), config, device_mesh=mesh)
    lo = mesh.get_local_rank("dp") * (LLAMA_BATCH // 2)
    losses = []
    for step in range(LLAMA_STEPS):
        ids = _tokens(step)[lo:lo + LLAMA_BATCH // 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # tp ranks of one dp rank hold the same loss: the world mean is the dp mean
        losses.append(float(mean) / dist.get_world_size())
    engine.eval()
    with torch.no_grad():
        trained = engine(input_ids=probe).logits
    with tempfile.TemporaryDirectory(prefix="tp_export_hf.") as folder:
        out = os.path.join(folder, "hf")
        save_hf(engine, out, description(model, None))
        result = {"before": before, "trained": trained, "losses": losses, "wrote": os.path.exists(out)}
        if dist.get_rank() == 0:
            loaded = LlamaForCausalLM.from_pretrained(out)
            with torch.no_grad():
                result["loaded"] = loaded(probe).logits
    return result


def deepspeed_16bit(mesh: DeviceMesh) -> dict:
    """A Megatron-style (dp 2, tp 2) model at stage 3 through zerodp.deepspeed, untrained: what
    save_16bit_model writes (the world's rank 0), and the parameters' shapes inside GatheredParameters and
    in model.state_dict()."""
    from test_tensor_parallel import ParallelState, build, config, optimizer, split_by_hand  # the oracle's model

    model = split_by_hand(build(), mesh.get_group("tp"), "tensor_model_parallel")
    cfg = config(3, 2, stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=0)
    engine, *_ = zds.initialize(model=model, optimizer=optimizer(model), config=cfg,
                                mpu=ParallelState(mesh.get_group("dp"), mesh.get_group("tp")))
    with zds.zero.GatheredParameters(list(model.parameters())):
        gathered = {n: tuple(p.shape) for n, p in model.named_parameters()}
    state = {n: tuple(t.shape) for n, t in model.state_dict().items()}  # stage 3: gathered over dp (every rank)
    with tempfile.TemporaryDirectory(prefix="tp_export_16bit.") as folder:
        engine.save_16bit_model(folder)
        path = os.path.join(folder, "pytorch_model.bin")
        written = os.path.exists(path)
        return {"gathered": gathered, "state_dict": state, "wrote": written,
                "file": torch.load(path, weights_only=True) if written else None}


class _Odd(torch.nn.Module):
    """5 hidden units over 2 tp ranks: shards of 3 and 2 rows (columns of the row-parallel weight)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)


def uneven(mesh: DeviceMesh) -> dict:
    """engine.full_state_dict() of an untrained model with uneven tp shards, at stages 2 and 3 (torch's
    own sharding propagation refuses this model's forward, so it only exports), and its whole values."""
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = _Odd()
        out["whole"] = {n: t.clone() for n, t in model.state_dict().items()}
        parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
        engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}},
                                   device_mesh=mesh)
        out[stage] = engine.full_state_dict()
    return out

