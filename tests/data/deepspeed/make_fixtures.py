"""Write the DeepSpeed checkpoints that tests/test_deepspeed_checkpoint.py resumes in zerodp.

Made once, with DeepSpeed 0.19.8 (built from its sdist with DS_BUILD_OPS=0, as benchmarks/gpu/wheels.sh
does) and torch 2.13.0+cpu, on 2 gloo ranks on the CPU (DS_ACCELERATOR=cpu), in a virtual environment
that is not the one the tests run in (the tests must pass without DeepSpeed):

    python -m venv --system-site-packages /work/dsenv
    /work/dsenv/bin/pip install hjson ninja py-cpuinfo psutil einops msgpack wheel
    DS_BUILD_OPS=0 /work/dsenv/bin/pip install --no-deps --no-build-isolation deepspeed-0.19.8.tar.gz
    DS_ACCELERATOR=cpu /work/dsenv/bin/python tests/data/deepspeed/make_fixtures.py [NAME ...]

With names, only those fixtures are (re)written and their entries in fixtures.json replaced; the others'
files and entries stay as they are.

For each fixture (ZeRO stage 1, 2, 3 in fp32; stages 2 and 3 in bf16; stage 1 in bf16 with fp32 gradient
accumulation, DeepSpeed's BF16_Optimizer; stages 2 and 3 of the Toy with tied and frozen parameters, in
fp32): the oracle's Toy MLP (seed 0), torch's AdamW in two param groups (oracle.two_groups: weight decay
on matrices only), DeepSpeed's WarmupLR and gradient clipping 1.0, micro-batch 3 per rank, no
accumulation. DeepSpeed trains SAVE_AT steps on the fixed global batches
below and saves `{name}/` (its default tag, global_step3). Then a fresh DeepSpeed engine, built from
other initial weights, loads that checkpoint and trains CONTINUE more steps on the next batches: its
losses (the mean over both ranks, i.e. over the global batch) are what zerodp must reproduce, recorded
with the versions and the config in fixtures.json, with what DeepSpeed held right after loading (sums
and sums of squares of every parameter's fp32 master, exp_avg and exp_avg_sq; its step counter and lr
scheduler state).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/, for the oracle's model

import oracle  # noqa: E402

WORLD, MICRO, SAVE_AT, CONTINUE = 2, 3, 3, 3
GLOBAL = WORLD * MICRO
# name: (ZeRO stage, precision, Toy options). The tied/frozen ones: a matrix used twice in one forward, one
# shared by two modules (DeepSpeed's shared_params) and a frozen inp.weight (stage 3 cuts it per rank).
TIED_FROZEN = {"tied": True, "frozen": True}
FIXTURES = {"stage1_fp32": (1, "fp32", {}), "stage2_fp32": (2, "fp32", {}), "stage3_fp32": (3, "fp32", {}),
            "stage2_bf16": (2, "bf16", {}), "stage3_bf16": (3, "bf16", {}),
            "stage2_fp32_tied_frozen": (2, "fp32", TIED_FROZEN), "stage3_fp32_tied_frozen": (3, "fp32", TIED_FROZEN),
            # bf16 with fp32 gradient accumulation in stage 1 is DeepSpeed's BF16_Optimizer: other files
            "stage1_bf16_fp32_accum": (1, "bf16-fp32-accum", {})}
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                                            "warmup_num_steps": 5, "warmup_type": "linear"}}


def batches(steps: int = SAVE_AT + CONTINUE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed global batches (GLOBAL samples each), step by step; rank r takes rows [r*MICRO, (r+1)*MICRO)."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL, oracle.D_IN, generator=g), 5 * torch.randn(GLOBAL, oracle.D_OUT, generator=g))
            for _ in range(steps)]


def model(seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    return oracle.Toy(**kw)


def ds_config(stage: int, dtype: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 1 << 30, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage}, "scheduler": SCHEDULER}
    if dtype.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if dtype == "bf16-fp32-accum":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _train(engine, rank: int, steps: range) -> list[float]:
    """Global-batch mean loss of each step (both ranks' micro-batch means averaged)."""
    out, data = [], batches()
    for step in steps:
        x, y = data[step]
        sl = slice(rank * MICRO, (rank + 1) * MICRO)
        dtype = next(engine.module.parameters()).dtype
        loss = engine(x[sl].to(dtype), y[sl].to(dtype))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        out.append(mean.item() / WORLD)
    return out


def _loaded_state(engine) -> dict:
    """What DeepSpeed itself holds right after load_checkpoint, through its own full-tensor accessors:
    [sum, sum of squares] (float64) of each parameter's fp32 master, exp_avg and exp_avg_sq."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # stages 1-2 link the optimizer state to the parameters at the first step
        link()
    out = {}
    for name, p in engine.module.named_parameters():  # tied ones once, under their first name
        if not p.requires_grad:
            continue
        ts = {"master": safe_get_full_fp32_param(p), "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
              "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
        out[name] = {k: [t.double().sum().item(), t.double().square().sum().item()] for k, t in ts.items()}
    return out


def _rank(rank: int, store_path: str, out_dir: str, names: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    import deepspeed
    record = {}
    for name in names:
        stage, dtype, kw = FIXTURES[name]
        m = model(0, **kw)
        engine, _, _, _ = deepspeed.initialize(model=m, optimizer=oracle.two_groups(m), config=ds_config(stage, dtype))
        before = _train(engine, rank, range(SAVE_AT))
        save_dir = os.path.join(out_dir, name)  # one save_dir per fixture, DeepSpeed's default tag
        engine.save_checkpoint(save_dir, client_state={"fixture": name})
        m = model(1, **kw)  # other initial weights: everything must come from the checkpoint
        engine, _, _, _ = deepspeed.initialize(model=m, optimizer=oracle.two_groups(m), config=ds_config(stage, dtype))
        engine.load_checkpoint(save_dir)
        lrs = [g["lr"] for g in engine.optimizer.param_groups]
        loaded = _loaded_state(engine)
        after = _train(engine, rank, range(SAVE_AT, SAVE_AT + CONTINUE))
        record[name] = {"stage": stage, "dtype": dtype, "model": kw, "config": ds_config(stage, dtype),
                        "losses_before_save": before, "losses_after_resume": after,
                        "lr_at_resume": lrs, "global_steps": engine.global_steps - CONTINUE,
                        "lr_scheduler": engine.lr_scheduler.state_dict(), "loaded": loaded}
    if rank == 0:
        with open(os.path.join(out_dir, "record.json"), "w") as f:
            json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    import deepspeed
    names = argv or list(FIXTURES)
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        sys.exit(f"unknown fixture(s) {unknown}; known: {list(FIXTURES)}")
    path = os.path.join(HERE, "fixtures.json")
    meta = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "world_size": WORLD,
            "micro_batch": MICRO, "save_at": SAVE_AT, "continue": CONTINUE,
            "model": "tests/oracle.py Toy() seed 0, optimizer oracle.two_groups (torch AdamW)"}
    kept = {}
    if argv:  # some fixtures only: the others must have been made by the same versions and settings
        with open(path) as f:
            old = json.load(f)
        kept = old.pop("fixtures")
        if old != meta:
            sys.exit(f"fixtures.json was made with {old}, not {meta}: regenerate them all, not some")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), out, names), nprocs=WORLD, join=True)
        with open(os.path.join(out, "record.json")) as f:
            record = json.load(f)
        for name in names:
            dest = os.path.join(HERE, name)
            shutil.rmtree(dest, ignore_errors=True)
            # The save_dir as DeepSpeed wrote it, less its copies of zero_to_fp32.py / zero_to_torch.py.
            shutil.copytree(os.path.join(out, name), dest, ignore=shutil.ignore_patterns("zero_to_*.py"))
    if argv:  # only these fixtures: keep the others' entries (and their order) as they are
        record = {**kept, **record}
    meta["fixtures"] = record
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
