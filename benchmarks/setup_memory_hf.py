"""Per-rank peak host memory (RSS) of setting up `zerodp train --model FOLDER` (build + load weights +
zerodp.initialize) from a Hugging Face folder, three ways, measured in the same run, each configuration
in fresh processes, one at a time:

  today   from_pretrained reads the whole model in fp32 on every rank (what hf_folder.load_model did), then
          the zerodp of --main-src (one without `weights`) initializes it, broadcasting rank 0's values
  config  this tree: the model built whole from config.json, initialize(weights=FOLDER) reads the buckets
  meta    the model built under torch.device("meta"), initialize(weights=FOLDER, param_init_fn=HF's
          _init_weights for the buffers): each rank reads only what its stage keeps (needs the meta set-up
          of zerodp.engine.setup)

    python benchmarks/setup_memory_hf.py make --root /tmp/hf350      # GPT-2 medium shape, fp32 + bf16, sharded
    python benchmarks/setup_memory_hf.py run --root /tmp/hf350 --worlds 2 4 --stages 2 3 --folders fp32 bf16 \\
        --modes today config meta --out benchmarks/results/setup_memory_hf.json

Peak = VmHWM - VmRSS once torch, transformers, zerodp and the process group are up (the high-water mark is
reset there through /proc/self/clear_refs). The bound beside it is benchmarks/setup_memory.py's: the
steady state of the model states (docs/DESIGN.md's table) plus one fp32 bucket.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# The same measurement as the meta-build table's (this folder is on sys.path when run as a script).
from setup_memory import GB, bound, measure, run

SHAPE = dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, vocab_size=50257)  # GPT-2 medium


def make(root: str) -> None:
    """Two save_pretrained folders of one random GPT-2 medium: fp32 and bf16, in shards of 200 MB."""
    import transformers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE))
    model.save_pretrained(os.path.join(root, "fp32"), max_shard_size="200MB")
    model.to(torch.bfloat16).save_pretrained(os.path.join(root, "bf16"), max_shard_size="200MB")


def _set_up(mode: str, folder: str, stage: int, dtype: str) -> None:
    import transformers

    import zerodp
    from zerodp.models import hf_folder
    from zerodp.models.build import HFCausalLM
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if mode == "today":
        model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
        zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg)
        return
    if mode == "config":  # built whole from config.json, then the folder's values read in
        config = transformers.AutoConfig.from_pretrained(folder)
        model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg, weights=folder)
        return
    model = HFCausalLM(hf_folder.model_from_config(folder))  # on meta, as `zerodp train --model FOLDER`
    zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg, weights=folder,
                      param_init_fn=hf_folder.init_fn(model))


def _rank(rank: int, world: int, store_path: str, out_dir: str, job: dict) -> None:
    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)  # hf_folder.quiet_other_ranks
    if job["mode"] == "today":
        sys.path.insert(0, job["main_src"])
    import transformers  # noqa: F401 - imported before the baseline

    import zerodp.engine.engine
    import zerodp.models.build  # noqa: F401
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=1200))
    measure(lambda: _set_up(job["mode"], job["folder"], job["stage"], job["dtype"]), out_dir, rank)
    dist.barrier()
    dist.destroy_process_group()
    assert (job["mode"] == "today") == zerodp.engine.engine.__file__.startswith(job["main_src"])


def table(rows: list[dict], psi: int, largest: int) -> str:
    out = [f"GPT-2 medium shape from an HF folder (Ψ = {psi / 1e6:.1f}M, sharded safetensors); per-rank peak "
           "RSS above the baseline, GiB (B/param); bound = steady-state model states + one fp32 bucket", "",
           "| world | stage | engine dtype | folder | meta + weights | whole from config + weights | today "
           "(from_pretrained) | bound | meta / bound |", "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted({(r["world"], r["stage"], r["dtype"], r["folder_dtype"]) for r in rows}):
        cell = {r["mode"]: r["peak"] for r in rows if (r["world"], r["stage"], r["dtype"], r["folder_dtype"]) == key}
        text = {m: f"{v / GB:.2f} ({v / psi:.1f})" for m, v in cell.items()}
        b = bound(psi, largest, key[1], key[2], key[0])
        ratio = f"{cell['meta'] / b:.2f}" if "meta" in cell else "-"
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {text.get('meta', '-')} | "
                   f"{text.get('config', '-')} | {text.get('today', '-')} | {b / GB:.2f} ({b / psi:.1f}) | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["make", "run"])
    p.add_argument("--root", required=True, help="where the fp32/ and bf16/ folders are (made by `make`)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--dtypes", nargs="+", default=["bf16"], help="the engine's working precision")
    p.add_argument("--folders", nargs="+", default=["fp32", "bf16"], help="the folders' dtypes")
    p.add_argument("--modes", nargs="+", default=["meta", "config", "today"])
    p.add_argument("--main-src", default="/work/main/src", help="the zerodp source of the 'today' mode")
    p.add_argument("--out", default=None, help="JSON file the rows are added to (kept across runs)")
    args = p.parse_args(argv)
    if args.command == "make":
        return make(args.root)
    import transformers
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE))
    psi = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    rows = json.load(open(args.out)) if args.out and os.path.exists(args.out) else []
    for world in args.worlds:
        for folder in args.folders:
            for dtype in args.dtypes:
                for stage in args.stages:
                    for mode in args.modes:
                        job = dict(world=world, stage=stage, dtype=dtype, folder_dtype=folder, mode=mode)
                        row = run({**job, "folder": os.path.join(args.root, folder), "main_src": args.main_src},
                                  _rank)
                        print(json.dumps(row), flush=True)
                        rows = [r for r in rows if {k: r[k] for k in job} != job] + [row]
                        if args.out:
                            json.dump(rows, open(args.out, "w"), indent=1)
    print(table(rows, psi, largest))


if __name__ == "__main__":
    sys.exit(main())
