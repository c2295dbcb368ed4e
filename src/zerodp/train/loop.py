"""The main job: train a GPT (or a Hugging Face model) with ZeRO, from one command.

    zerodp train [--config FILE] [--model small] [--steps N] [--stage 2] ...

Read top to bottom: options, launch, model and optimizer, data, the training loop, metrics and the
report. Under torchrun (RANK/WORLD_SIZE set) it runs as one rank of the job. With no launcher it
starts --nproc ranks itself through torchrun's own launcher API (a standalone rendezvous on
localhost), so a newcomer types one command and sees ZeRO-2 train on 2 CPU ranks.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from zerodp.config import ConfigError, load_config
from zerodp.memory import activation_estimate

from .data import Batches, load_corpus, val_batches
from .model import GPT, SIZES, GPTConfig, gpt_config

# ---- options ------------------------------------------------------------------------------------
# Built-in defaults, the lowest layer: --ds-config, then --config, then flags override them.
# On CPU the default run (small model, 2 ranks, 8 x 256 tokens each) takes a few minutes.
DEFAULTS: dict[str, Any] = dict(
    model="small", data=None, steps=100, micro_batch=8, grad_accum=1, block_size=None,
    lr=1e-3, min_lr=1e-4, warmup=20, weight_decay=0.1, clip=1.0, stage=2, dtype=None,
    eval_every=20, eval_batches=4, save_every=50, out=None, resume=False, seed=1337,
    nproc=None, ds_config=None, crash_after=None,
)
DTYPES = ("fp32", "bf16", "fp16")  # the working precision; fp32 master weights in every case
HF_MODELS = ("hf-gpt2", "hf-llama")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zerodp train", description="Train a GPT with ZeRO data parallelism. With no launcher "
        "it starts --nproc ranks itself (2 gloo ranks on CPU, one per GPU on CUDA).")
    # Every default is None so that a flag given on the command line can be told from one not given.
    p.add_argument("--config", help="JSON file with any of the keys below (underscores), "
                   "e.g. {\"steps\": 500, \"micro_batch\": 16}; flags override it")
    p.add_argument("--model", help=f"a GPT size ({', '.join(SIZES)}; default small) or a Hugging "
                   f"Face model built with random weights: {', '.join(HF_MODELS)}, optionally "
                   "with a GPT size for its shape, e.g. hf-llama:tiny")
    p.add_argument("--data", help="a text file, a directory of text files or a nanoGPT .bin token "
                   "file (default: the Python standard library's source, as bytes)")
    p.add_argument("--steps", type=int, help="optimizer steps (default 100)")
    p.add_argument("--micro-batch", type=int, help="sequences per rank per micro-step (default 8)")
    p.add_argument("--grad-accum", type=int, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--block-size", type=int, help="sequence length (default: the model's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    p.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine (default 1e-4)")
    p.add_argument("--warmup", type=int, help="linear warmup steps (default 20)")
    p.add_argument("--weight-decay", type=float, help="AdamW decay of 2-D weights (default 0.1)")
    p.add_argument("--clip", type=float, help="gradient norm clipping, 0 = off (default 1.0)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2], help="ZeRO stage (default 2)")
    p.add_argument("--dtype", choices=list(DTYPES), help="working precision (default bf16 on "
                   "CUDA, fp32 on CPU)")
    p.add_argument("--eval-every", type=int, help="validation every K steps (default 20)")
    p.add_argument("--eval-batches", type=int, help="validation batches per evaluation (default 4)")
    p.add_argument("--save-every", type=int, help="checkpoint every K steps, 0 = only at the end "
                   "(default 50)")
    p.add_argument("--out", help="output directory (default runs/<model>-zero<stage>)")
    p.add_argument("--resume", action="store_true", default=None,
                   help="continue from OUT/checkpoints' latest checkpoint if there is one")
    p.add_argument("--seed", type=int, help="seed of the weights and of the data order (default 1337)")
    p.add_argument("--nproc", type=int, help="ranks to start when not under torchrun (default: "
                   "2 on CPU, the GPU count on CUDA); 1 runs in this process")
    p.add_argument("--ds-config", help="a DeepSpeed-style JSON config; its batch, precision, "
                   "clipping and zero settings fill the options not given here")
    # For the crash test: SIGKILL every rank right after step K (and its checkpoint, if any).
    p.add_argument("--crash-after", type=int, help=argparse.SUPPRESS)
    return p


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over the --config file over the --ds-config file over DEFAULTS."""
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    from_file = _read_options_file(args.config) if args.config else {}
    cuda = torch.cuda.is_available()
    nproc = given.get("nproc", from_file.get("nproc")) or (torch.cuda.device_count() if cuda else 2)
    world = int(os.environ.get("WORLD_SIZE", nproc))  # torchrun's world when under torchrun
    ds = _from_ds_config(given.get("ds_config", from_file.get("ds_config")), world)
    opts = {**DEFAULTS, **ds, **from_file, **given, "nproc": nproc}
    if opts["dtype"] is None:
        opts["dtype"] = "bf16" if cuda else "fp32"
    if opts["out"] is None:
        opts["out"] = os.path.join("runs", f"{opts['model'].replace(':', '-')}-zero{opts['stage']}")
    _check(opts)
    return argparse.Namespace(**opts)


def _read_options_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise SystemExit(f"zerodp train: cannot read --config file {path!r}: {e.strerror}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"zerodp train: --config file {path!r} is not valid JSON: line {e.lineno}: {e.msg}")
    if not isinstance(raw, dict):
        raise SystemExit(f"zerodp train: --config file {path!r} must hold a JSON object")
    opts = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in DEFAULTS or name == "crash_after":
            close = difflib.get_close_matches(name, DEFAULTS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(DEFAULTS)}"
            raise SystemExit(f"zerodp train: unknown key {key!r} in --config file {path!r}; {hint}")
        opts[name] = value
    return opts


def _from_ds_config(path: str | None, world: int) -> dict[str, Any]:
    """The job's options that a DeepSpeed-style config settles (validated by zerodp's loader)."""
    if path is None:
        return {}
    try:
        cfg = load_config(path)
        batch = cfg.batch(world) if cfg.train_batch_size or cfg.train_micro_batch_size_per_gpu else None
    except ConfigError as e:
        raise SystemExit(f"zerodp train: --ds-config {path!r}: {e}")
    opts: dict[str, Any] = {"stage": cfg.zero_optimization.stage, "clip": cfg.gradient_clipping}
    if batch is not None:
        opts["micro_batch"], opts["grad_accum"] = batch.micro_batch_size, batch.gradient_accumulation_steps
    if cfg.fp16.enabled or cfg.bf16.enabled:
        opts["dtype"] = "fp16" if cfg.fp16.enabled else "bf16"
    if cfg.optimizer is not None:
        for key in ("lr", "weight_decay"):
            if key in cfg.optimizer.params:
                opts[key] = cfg.optimizer.params[key]
    return opts


def _check(o: dict[str, Any]) -> None:
    """Bad options fail here, before any rank starts, with the flag that is wrong."""
    size = o["model"].split(":", 1)[1] if ":" in o["model"] else o["model"]
    family = o["model"].split(":", 1)[0]
    if size not in SIZES or (":" in o["model"] and family not in HF_MODELS):
        raise SystemExit(f"zerodp train: --model {o['model']!r}: expected one of "
                         f"{', '.join(list(SIZES) + list(HF_MODELS))} (HF models may add ':SIZE')")
    for key in ("steps", "micro_batch", "grad_accum", "eval_every", "eval_batches", "nproc"):
        if not isinstance(o[key], int) or o[key] < 1:
            raise SystemExit(f"zerodp train: --{key.replace('_', '-')} {o[key]!r}: expected a "
                             "positive integer")
    if o["data"] is not None and not os.path.exists(o["data"]):
        raise SystemExit(f"zerodp train: --data {o['data']!r} does not exist")
    if o["dtype"] not in DTYPES:
        raise SystemExit(f"zerodp train: --dtype {o['dtype']!r}: expected one of {', '.join(DTYPES)}")
    if o["warmup"] >= o["steps"]:
        o["warmup"] = max(0, o["steps"] // 10)  # a short run still gets a cosine to decay over


# ---- launch -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this is one rank
        run_rank(opts)
    elif opts.nproc == 1:
        run_rank(opts)
    else:
        launch(opts)


def launch(opts: argparse.Namespace) -> None:
    """Start opts.nproc ranks on this machine, as `torchrun --standalone --nproc-per-node N` does."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=opts.nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.5)
    # A failing rank prints its own traceback; the launcher's copy of it would only repeat it.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, _launched_rank)(opts)
    except ChildFailedError as e:
        # The failing rank already printed its traceback; say which one failed, briefly.
        first = e.get_first_failure()[1]
        raise SystemExit(f"zerodp train: rank {first.local_rank} failed (exit code {first.exitcode})")


def _launched_rank(opts: argparse.Namespace) -> None:
    """A rank that this job started: its error is printed once, plainly, then the rank exits."""
    try:
        run_rank(opts)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: the other ranks may be waiting in a collective


def run_rank(opts: argparse.Namespace) -> None:
    """One rank of the job: threads, process group, then train."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available():  # ranks sharing a CPU must not oversubscribe its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    zerodp.init_distributed()
    try:
        train(opts)
    finally:
        dist.destroy_process_group()


# ---- model and optimizer ------------------------------------------------------------------------
class HFCausalLM(nn.Module):
    """(x, y) -> loss for a Hugging Face causal LM, which it holds unchanged as `.model`.

    Hugging Face shifts the labels itself, so it is given the inputs as labels: y is x shifted.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, labels=x).loss


def build_model(name: str, vocab_size: int, block_size: int | None) -> tuple[nn.Module, GPTConfig]:
    """The model to train and its shape: a GPT size, or an HF model of that size's shape."""
    family, _, size = name.partition(":")
    overrides = {"block_size": block_size} if block_size else {}
    if family not in HF_MODELS:
        shape = gpt_config(name, vocab_size=vocab_size, **overrides)
        return GPT(shape), shape
    shape = gpt_config(size or "small", vocab_size=vocab_size, **overrides)
    import transformers  # only for the HF options: importing it is slow

    if family == "hf-gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=shape.block_size,
                                      n_embd=shape.n_embd, n_layer=shape.n_layer, n_head=shape.n_head,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=shape.n_embd,
                                       intermediate_size=4 * shape.n_embd,
                                       num_hidden_layers=shape.n_layer,
                                       num_attention_heads=shape.n_head,
                                       num_key_value_heads=shape.n_head,
                                       max_position_embeddings=shape.block_size,
                                       tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    return HFCausalLM(model), shape


def build_optimizer(model: nn.Module, opts: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices and embeddings (2-D) only, not on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opts.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95))


def warmup_cosine(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """lr multiplier at optimizer step t: linear warmup, then cosine down to min_ratio at `total`.

    A plain function, not an object: LambdaLR then keeps nothing of it in its state dict, so a run
    resumed with a larger --steps follows the new, longer cosine rather than the saved one.
    """
    def multiplier(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        progress = min(1.0, (t - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return multiplier


def ds_config(opts: argparse.Namespace) -> dict[str, Any]:
    """The zerodp config: the --ds-config file's sections, with the job's settled options on top."""
    base = {}
    if opts.ds_config:
        with open(opts.ds_config, encoding="utf-8") as f:
            base = json.load(f)
    # The job builds its own AdamW and schedule; batch sizes are the job's options.
    for key in ("optimizer", "scheduler", "train_batch_size"):
        base.pop(key, None)
    zero = {**base.get("zero_optimization", {}), "stage": opts.stage}
    return {**base, "train_micro_batch_size_per_gpu": opts.micro_batch,
            "gradient_accumulation_steps": opts.grad_accum, "gradient_clipping": opts.clip,
            "bf16": {**base.get("bf16", {}), "enabled": opts.dtype == "bf16"},
            "fp16": {**base.get("fp16", {}), "enabled": opts.dtype == "fp16"},
            "zero_optimization": zero}


# ---- data ---------------------------------------------------------------------------------------
class StepBatches:
    """This rank's micro-batches of each optimizer step.

    The global batch of step k is world x accumulation x micro windows drawn from (seed, k); each
    (micro-step, rank) pair takes its own rows, as if it were one rank of a world of
    world x accumulation. The data of step k therefore depends only on the seed, k and the global
    batch size: a run resumed on another world size continues with the same data.
    """

    def __init__(self, tokens, block_size: int, micro: int, accum: int, rank: int, world: int, seed: int):
        self.slots = [Batches(tokens, block_size, micro, j * world + rank, world * accum, seed)
                      for j in range(accum)]
        self.step = 0

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = [b.batch(self.step) for b in self.slots]
        self.step += 1
        return batches

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.slots[0].seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        for b in self.slots:
            b.load_state_dict(state)


# ---- training -----------------------------------------------------------------------------------
def train(opts: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(opts.out)
    ckpt_dir = out / "checkpoints"
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

    corpus = load_corpus(opts.data)
    torch.manual_seed(opts.seed)  # the same initial weights on every rank (the engine broadcasts them)
    model, shape = build_model(opts.model, corpus.vocab_size, opts.block_size)
    block = shape.block_size
    if device is not None:
        model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    schedule = warmup_cosine(opts.warmup, opts.steps, opts.min_lr / opts.lr)
    engine = zerodp.initialize(model, build_optimizer(model, opts), ds_config(opts),
                               lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    data = StepBatches(corpus.train, block, opts.micro_batch, opts.grad_accum, rank, world, opts.seed)
    val = val_batches(corpus.val, block, opts.micro_batch, opts.eval_batches, rank, world)

    resumed = opts.resume and (ckpt_dir / "latest").exists()
    if resumed:
        client = engine.load_checkpoint(str(ckpt_dir))
        data.load_state_dict(client["data"])
    log = Metrics(out / "metrics.jsonl", rank, keep_until=engine.global_steps if resumed else 0)
    if rank == 0:
        where = f"resumed at step {engine.global_steps}" if resumed else "from scratch"
        if not resumed and (ckpt_dir / "latest").exists():
            where += f" (its checkpoints in {ckpt_dir} will be replaced; --resume continues them)"
        print(f"zerodp train: {opts.model} ({n_params / 1e6:.2f}M parameters), ZeRO stage "
              f"{opts.stage}, {world} rank(s), {opts.dtype}, global batch "
              f"{world * opts.grad_accum * opts.micro_batch} x {block} tokens, {opts.steps} steps "
              f"{where}\n  data: {corpus.source}\n  out: {out}", flush=True)

    def evaluate() -> float:
        loss = validation_loss(engine, val, device)
        log.write(kind="eval", step=engine.global_steps, val_loss=loss)
        return loss

    val_loss = evaluate() if engine.global_steps == 0 else math.nan
    memory = gather_memory(engine, shape, opts)
    log.write(kind="memory", step=engine.global_steps, ranks=memory)
    tokens_per_step = world * opts.grad_accum * opts.micro_batch * block
    bar = progress_bar(rank, engine.global_steps, opts.steps)
    while engine.global_steps < opts.steps:
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for x, y in data.next_step():
            if device is not None:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        dist.all_reduce(loss_sum)  # the mean over the global batch, for the log
        loss = loss_sum.item() / (world * opts.grad_accum)
        step, dt = engine.global_steps, time.perf_counter() - t0
        log.write(kind="train", step=step, loss=loss, lr=engine.get_lr()[0], tokens_per_s=tokens_per_step / dt,
                  grad_norm=engine.grad_norm, loss_scale=engine.loss_scale)
        if step % opts.eval_every == 0 or step == opts.steps:
            val_loss = evaluate()
            memory = gather_memory(engine, shape, opts)
            log.write(kind="memory", step=step, ranks=memory)
        if (opts.save_every and step % opts.save_every == 0) or step == opts.steps:
            engine.save_checkpoint(str(ckpt_dir), client_state={"data": data.state_dict(), "options": vars(opts)})
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(refresh=False, s=f"loss {loss:.3f} val {val_loss:.3f} {tokens_per_step / dt:,.0f} tok/s "
                                f"lr {engine.get_lr()[0]:.2e} scale {engine.loss_scale:g} "
                                f"mem/rank {_memory_text(memory)}")
        if opts.crash_after is not None and step == opts.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)
    if bar is not None:
        bar.close()
    if math.isnan(val_loss):  # resumed from the last step's checkpoint: nothing was left to train
        val_loss = evaluate()

    final = engine.full_state_dict()  # collective: every rank takes part, rank 0 writes
    if rank == 0:
        torch.save(final, out / "final.pt")
        report = make_report(out)
        print(f"zerodp train: final validation loss {val_loss:.4f} after {engine.global_steps} steps\n"
              f"  metrics {out / 'metrics.jsonl'}\n  report {report}\n  checkpoints {ckpt_dir}\n"
              f"  weights {out / 'final.pt'}", flush=True)


@torch.no_grad()
def validation_loss(engine, val: list[tuple[torch.Tensor, torch.Tensor]], device) -> float:
    """Mean loss over the fixed validation batches of every rank."""
    engine.eval()
    total = torch.zeros((), device=device)
    for x, y in val:
        if device is not None:
            x, y = x.to(device), y.to(device)
        total += engine(x, y).float()
    engine.train()
    dist.all_reduce(total)
    return total.item() / (len(val) * dist.get_world_size())


# Sums of other categories in engine.memory_report(): left out of the stacked bars.
_AGGREGATES = ("model_states", "host_model_states", "device_model_states")


def gather_memory(engine, shape: GPTConfig, opts: argparse.Namespace) -> list[dict[str, int]]:
    """Every rank's memory by disjoint category, in bytes, activations included."""
    report = engine.memory_report()
    parts = {k: int(v) for k, v in report.items()
             if k not in _AGGREGATES and not k.startswith("cuda_") and v}
    if "cuda_peak_allocated" in report:  # measured: the peak beyond what the engine holds
        parts["activations_and_temporaries"] = max(0, report["cuda_peak_allocated"] - sum(parts.values()))
    else:  # no allocator statistics on the CPU: the formula of zerodp.memory
        parts["activations_estimate"] = activation_estimate(shape, opts.micro_batch, shape.block_size,
                                                            opts.dtype)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, parts)
    return gathered


def _memory_text(memory: list[dict[str, int]]) -> str:
    """Each rank's total, e.g. '61/61 MiB'."""
    return "/".join(f"{sum(r.values()) / 2**20:.0f}" for r in memory) + " MiB"


def progress_bar(rank: int, start: int, total: int):
    if rank != 0:
        return None
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                mininterval=0.5 if tty else 15.0)


# ---- metrics and the report ---------------------------------------------------------------------
class Metrics:
    """JSON lines in OUT/metrics.jsonl, written by rank 0. A resumed run first drops the lines
    after its checkpoint's step, which the run that crashed had logged but not kept."""

    def __init__(self, path: Path, rank: int, keep_until: int):
        self.path, self.rank = path, rank
        if rank != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [line for line in _read_lines(path) if line["step"] <= keep_until] if keep_until else []
        path.write_text("".join(json.dumps(line) + "\n" for line in kept))

    def write(self, **record: Any) -> None:
        if self.rank == 0:
            record["time"] = time.time()
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_report(out: Path) -> Path:
    """OUT/report.png: the loss curves and each rank's memory by category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = _read_lines(out / "metrics.jsonl")
    train = [r for r in lines if r["kind"] == "train"]
    val = [r for r in lines if r["kind"] == "eval"]
    memory = [r for r in lines if r["kind"] == "memory"]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.8))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="cross-entropy loss", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if memory:
        ranks = memory[-1]["ranks"]
        categories = list(dict.fromkeys(k for r in ranks for k in r))
        bottom = [0.0] * len(ranks)
        for cat in categories:
            mib = [r.get(cat, 0) / 2**20 for r in ranks]
            ax_mem.bar(range(len(ranks)), mib, bottom=bottom, label=cat)
            bottom = [b + m for b, m in zip(bottom, mib)]
        ax_mem.set_xticks(range(len(ranks)), [f"rank {i}" for i in range(len(ranks))])
        ax_mem.set(ylabel="MiB", title=f"memory per rank (step {memory[-1]['step']})")
        ax_mem.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax_mem.text(0.5, 0.5, "no memory report", ha="center", va="center")
        ax_mem.set_axis_off()
    fig.tight_layout()
    path = out / "report.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
