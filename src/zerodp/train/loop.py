"""The main job: train a GPT (or a Hugging Face model) with ZeRO, from one command.

    zerodp train [--config FILE] [--model small] [--steps N] [--stage 2] ...

Read top to bottom: launch, the data of each step, the training loop. Under torchrun (RANK/WORLD_SIZE
set) it runs as one rank of the job. With no launcher it starts --nproc ranks itself through
torchrun's own launcher API (a standalone rendezvous on localhost), so a newcomer types one command
and sees ZeRO-2 train on 2 CPU ranks. The options are options.py, the model and optimizer build.py,
the metrics, progress bar and report.png report.py.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
import traceback
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

import zerodp

from .build import build_model, build_optimizer, warmup_cosine
from .data import Batches, load_corpus, val_batches
from .options import ds_config, parse_options
from .report import Metrics, gather_memory, make_report, memory_text, progress_bar


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
        # Every rank done before any closes its gloo connections: a peer whose background threads
        # still use them can otherwise abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


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
    elif opts.resume_from:  # another run's checkpoint (zerodp's or DeepSpeed's): its data order if it has one
        client, resumed = engine.load_checkpoint(opts.resume_from), True
        data.load_state_dict(client.get("data") or {"step": engine.global_steps, "seed": opts.seed})
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
                                f"mem/rank {memory_text(memory)}")
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
