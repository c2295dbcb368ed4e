"""The training loop of `zerodp train`: one rank's process group, data, steps, checkpoints.

    zerodp train [--config FILE] [--model small] [--steps N] [--stage 2] ...

Read top to bottom: the rank (run_rank), the stop signal, the data of each step, the training loop.
launch.py starts the ranks (or runs this one under torchrun); the options are options.py, which
checkpoint a resume continues resume.py, the model and optimizer build.py, the metrics, progress bar
and report.png report.py.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zerodp
from zerodp.checkpoint.export_engine import save_final
from zerodp.checkpoint.files import set_engine_run
from zerodp.distributed.device import accelerator_type, can_pin, current
from zerodp.engine.engine import Engine, inside
from zerodp.models.build import build_model, hf_description, weights_of
from zerodp.models.gpt import GPTConfig, parallelize
from zerodp.train.build import build_corpus
from zerodp.train.data import Batches, val_batches
from zerodp.train.ds_sections import optimizer_and_schedule
from zerodp.train.options import EXIT_NON_FINITE, command_line, ds_config
from zerodp.train.signals import training_began
from zerodp.train.report import (
    Metrics,
    bar_text,
    gather_memory,
    make_report,
    progress_bar,
)


def run_rank(opts: argparse.Namespace) -> int:
    """One rank of the job: threads, process group, then train. Returns the exit code: 0, or
    128 + the signal number when a SIGTERM/SIGINT stopped it."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if accelerator_type() is None:  # ranks sharing a CPU must not oversubscribe its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    zerodp.init_distributed(timeout_s=opts.timeout)
    try:
        code = train(opts)
        # Every rank done before any closes its gloo connections: a peer whose background threads
        # still use them can otherwise abort ("terminate called without an active exception").
        dist.barrier()
    except zerodp.NonFiniteError as e:  # raised on every rank at the same step: no traceback
        if dist.get_rank() == 0:
            print(f"zerodp train: stopped: {e}", file=sys.stderr, flush=True)
        dist.barrier()
        raise SystemExit(EXIT_NON_FINITE) from None
    finally:
        dist.destroy_process_group()
    return code


class StopSignal:
    """SIGTERM/SIGINT (a preemption, Ctrl-C) only set a flag here; the step's loss all_reduce carries
    it to every rank (a signal may reach some ranks only), which then checkpoint and stop together."""

    def __init__(self):
        self.signum = 0
        training_began(self._install)

    def _install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.signum = self.signum or signum

    def flags(self) -> list[float]:
        """[got SIGTERM, got SIGINT] for this rank, summed over ranks by the step's all_reduce."""
        return [float(self.signum == signal.SIGTERM), float(self.signum == signal.SIGINT)]


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
@dataclass
class Job:
    """One rank's job, built once by set_up: the engine, its data, where it writes, what it reports."""
    opts: argparse.Namespace
    engine: Engine
    data: StepBatches
    val: list[tuple[torch.Tensor, torch.Tensor]]
    log: Metrics
    shape: GPTConfig
    hf: dict | None  # kept in every checkpoint: `zerodp consolidate --hf` needs it
    device: torch.device | None
    rank: int
    world: int  # every rank of the job
    dp: int  # its data-parallel ranks (world / --tp): each sees its own rows of the batch

    @property
    def out(self) -> Path:
        return Path(self.opts.out)

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.opts.grad_accum * self.opts.micro_batch * self.shape.block_size


def train(opts: argparse.Namespace) -> int:
    """Train to opts.steps; returns 0, or 128 + the signal number when SIGTERM/SIGINT stopped it."""
    job = set_up(opts)
    engine = job.engine
    val_loss = evaluate(job) if engine.global_steps == 0 else math.nan
    memory = log_memory(job)
    bar = progress_bar(job.rank, engine.global_steps, opts.steps)
    stop = StopSignal()
    while engine.global_steps < opts.steps:
        loss, stopping, dt = train_step(job, stop)
        step = engine.global_steps
        job.log.write(kind="train", step=step, loss=loss, lr=engine.get_lr()[0],
                      tokens_per_s=job.tokens_per_step / dt, grad_norm=engine.grad_norm,
                      loss_scale=engine.loss_scale)
        if (opts.eval_every and step % opts.eval_every == 0) or step == opts.steps:
            crash_point(opts, step, job.rank, "eval")
            val_loss = evaluate(job)
            memory = log_memory(job)
        if ((opts.save_every and step % opts.save_every == 0) or step == opts.steps
                or (stopping and opts.save_on_signal)):
            crash_point(opts, step, job.rank, "save")
            save(job)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(refresh=False, s=bar_text(loss, job.log.last_val_loss, job.tokens_per_step / dt,
                                                          engine.get_lr()[0], engine.loss_scale, memory))
        if stopping:
            return stopped(job, bar, stopping)
        crash_point(opts, step, job.rank, "step")
    if bar is not None:
        bar.close()
    if math.isnan(val_loss):  # resumed from the last step's checkpoint: nothing was left to train
        val_loss = evaluate(job)
    finish(job, val_loss)
    return 0


def set_up(opts: argparse.Namespace) -> Job:
    """The corpus, the model on this rank's device, the engine, the data order; a resume restores them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = current()
    # A fresh run's name, rank 0's (under torchrun each rank named it: choose_resume ran on each).
    named = [opts.run]
    dist.broadcast_object_list(named, src=0)
    opts.run = named[0]
    corpus = build_corpus(opts.model, opts.data)  # the folder's tokenizer for an HF model folder
    torch.manual_seed(opts.seed)  # the same initial weights on every rank (the engine broadcasts them)
    model, shape = build_model(opts.model, corpus.vocab_size, opts.block_size)
    if device is not None and not any(p.is_meta for p in model.parameters()):
        model.to(device)  # a model built on meta holds nothing to move: initialize fills it on the device
    n_params = sum(p.numel() for p in model.parameters())
    mesh = tensor_parallel(model, opts.tp, opts.sequence_parallel)
    # The data is split over the data-parallel ranks only: a dp rank's tp ranks read the same rows.
    dp_rank, dp = (mesh.get_local_rank("dp"), mesh.size(0)) if mesh is not None else (rank, world)
    hf = hf_description(model, opts.model)
    optimizer, lr_scheduler, recipe = optimizer_and_schedule(model, opts)
    engine = zerodp.initialize(model, optimizer, ds_config(opts), lr_scheduler=lr_scheduler,
                               weights=weights_of(opts.model), device_mesh=mesh)
    data = StepBatches(corpus.train, shape.block_size, opts.micro_batch, opts.grad_accum, dp_rank, dp, opts.seed)
    val = val_batches(corpus.val, shape.block_size, opts.micro_batch, opts.eval_batches, dp_rank, dp)

    # main's choose_resume: latest, the newest intact one, TAG, or --resume-from's directory (a zerodp or
    # DeepSpeed checkpoint; one this job did not write has no data order: go on from its step).
    resumed = opts.resume_path is not None
    if resumed:
        client = engine.load_checkpoint(opts.resume_path)
        data.load_state_dict(client.get("data") or {"step": engine.global_steps, "seed": opts.seed})
    set_engine_run(engine, opts.run)  # the checkpoint's run, or this fresh one's: what its checkpoints name
    log = Metrics(Path(opts.out) / "metrics.jsonl", rank, keep_until=engine.global_steps if resumed else 0)
    if resumed:  # report.png marks where the run picked up
        log.write(kind="resume", step=engine.global_steps)
    log.write(kind="run", step=engine.global_steps, id=opts.run, model=opts.model, stage=opts.stage,
              dtype=opts.dtype, ranks=world, tp=opts.tp)  # report.png's title; the run's name (folder.py)
    job = Job(opts, engine, data, val, log, shape, hf, device, rank, world, dp)
    if rank == 0:
        announce(job, n_params, recipe, corpus.source, resumed)
    return job


def tensor_parallel(model: torch.nn.Module, tp: int, sequence_parallel: bool = False) -> DeviceMesh | None:
    """With --tp N > 1: the (dp, tp) mesh of every rank, tp ranks adjacent (within a node, as Megatron places
    them), and the GPT split over its "tp" dimension (with --sequence-parallel, its norms on sequence slices);
    None without tensor parallelism."""
    if tp == 1:
        return None
    world = dist.get_world_size()
    mesh = init_device_mesh(accelerator_type() or "cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"], sequence_parallel)
    return mesh


def announce(job: Job, n_params: int, recipe: str, source: str, resumed: bool) -> None:
    """Rank 0's first lines: the model, the run, the recipe, the data and where it all goes."""
    opts, engine = job.opts, job.engine
    where = f"resumed at step {engine.global_steps}" if resumed else "from scratch"
    ranks = f"{job.world} rank(s)" + (f" ({job.dp} data-parallel x {opts.tp} tensor-parallel)" if opts.tp > 1 else "")
    print(f"zerodp train: {opts.model} ({n_params / 1e6:.2f}M parameters), ZeRO stage "
          f"{opts.stage}, {ranks}, {opts.dtype}, global batch "
          f"{job.dp * opts.grad_accum * opts.micro_batch} x {job.shape.block_size} tokens, {opts.steps} steps "
          f"{where}\n  {recipe}\n  data: {source}\n  out: {job.out} (run {opts.run})", flush=True)


def train_step(job: Job, stop: StopSignal) -> tuple[float, int, float]:
    """One optimizer step; returns the mean loss over the global batch, the signal every rank stops on
    (0: none) and the seconds it took."""
    engine, device = job.engine, job.device
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    for x, y in job.data.next_step():
        if device is not None:
            x, y = to_device(x, device), to_device(y, device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().float()
    # One all_reduce over every rank: the mean loss over the global batch (for the log; a dp rank's tp
    # ranks hold the same loss, so the world's mean is the dp ranks') and how many ranks got SIGTERM /
    # SIGINT, so that every rank stops after the same step.
    sums = torch.cat([loss_sum.reshape(1), to_device(torch.tensor(stop.flags()), device)])
    with inside(engine).comm.names_peer_failure(f"of the step's loss at step {engine.global_steps}", "all_reduce"):
        dist.all_reduce(sums)
    # The loop's one read of the step (the log line and the stop signal need it on the host).
    loss_sum, sigterm, sigint = sums.tolist()
    stopping = signal.SIGINT if sigint > 0 else signal.SIGTERM if sigterm > 0 else 0
    return loss_sum / (job.world * job.opts.grad_accum), stopping, time.perf_counter() - t0


def to_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """Host data to the device without blocking: a copy from pageable memory waits for the stream
    (whatever non_blocking says), one from pinned memory does not."""
    if device is None or device.type == "cpu":
        return t
    return (t.pin_memory() if can_pin() else t).to(device, non_blocking=True)


def evaluate(job: Job) -> float:
    if not job.opts.eval_every:  # --eval-every 0: no validation at all
        return math.nan
    loss = validation_loss(job.engine, job.val, job.device)
    job.log.write(kind="eval", step=job.engine.global_steps, val_loss=loss)
    return loss


def log_memory(job: Job) -> list:
    """Every rank's memory figures, written to the metrics (collective); returns them for the bar."""
    memory = gather_memory(job.engine, job.shape, job.opts)
    job.log.write(kind="memory", step=job.engine.global_steps, ranks=memory)
    return memory


def save(job: Job) -> None:
    job.engine.save_checkpoint(str(job.ckpt_dir),
                               client_state={"data": job.data.state_dict(), "options": vars(job.opts), "hf": job.hf},
                               keep_last=job.opts.keep_last)


def stopped(job: Job, bar, stopping: int) -> int:
    """Every rank got the same signal after the same step: say so (rank 0) and return 128 + its number."""
    if bar is not None:
        bar.close()
    if job.rank == 0:
        step = job.engine.global_steps
        saved = (f"checkpoint {job.ckpt_dir / f'global_step{step}'} written" if job.opts.save_on_signal
                 else "no checkpoint written (--no-save-on-signal)")
        print(f"zerodp train: stopped by {signal.Signals(stopping).name} after step {step}; {saved}; "
              f"resume with: {command_line(job.opts, job.opts.steps)}", flush=True)
    return 128 + stopping


def finish(job: Job, val_loss: float) -> None:
    """The final weights (collective: every rank sends one bucket at a time, rank 0 writes each tensor
    as it arrives), report.png, and the HF folder for an HF model."""
    notes = save_final(job.engine, job.out, job.hf)
    if job.rank != 0:
        return
    out = job.out
    report = make_report(out)
    written = f"  weights {out / 'final.pt'}"
    if job.hf is not None:  # an HF model: also as a folder that AutoModelForCausalLM.from_pretrained loads
        for note in notes:
            print(f"zerodp train: {note}", file=sys.stderr, flush=True)
        written += f"\n  HF folder {out / 'hf'}"
    ending = f"final validation loss {val_loss:.4f}" if job.opts.eval_every else "no validation (--eval-every 0)"
    print(f"zerodp train: {ending} after {job.engine.global_steps} steps\n"
          f"  metrics {out / 'metrics.jsonl'}\n  report {report}\n  checkpoints {job.ckpt_dir}\n"
          f"{written}", flush=True)


def crash_point(opts: argparse.Namespace, step: int, rank: int, where: str) -> None:
    """The fault tests' --crash-after / --crash-rank / --crash-signal / --crash-where: a signal to this
    rank's own process at the point named."""
    if opts.crash_after == step and opts.crash_rank in (None, rank) and opts.crash_where == where:
        os.kill(os.getpid(), getattr(signal, opts.crash_signal))


@torch.no_grad()
def validation_loss(engine, val: list[tuple[torch.Tensor, torch.Tensor]], device) -> float:
    """Mean loss over the fixed validation batches of every rank."""
    engine.eval()
    total = torch.zeros((), device=device)
    for x, y in val:
        x, y = to_device(x, device), to_device(y, device)
        total += engine(x, y).float()
    engine.train()
    with inside(engine).comm.names_peer_failure(f"of the validation loss at step {engine.global_steps}", "all_reduce"):
        dist.all_reduce(total)
    return total.item() / (len(val) * dist.get_world_size())
