"""`zerodp estimate`: per-rank memory of any model for any world size, before you rent the GPUs.

--model is a GPT size, a JSON file of GPTConfig fields, a Hugging Face folder or config.json, or
`module:factory` (models.py). For each world size N and stage the table gives, per rank:
  model states  the ZeRO formula (formulas.formula / formulas.placed): what the device holds
  buckets       stage 2-3's reduce-buffer pool (formulas.bucket_estimate), counted in the total
  host          with --offload-optimizer / --offload-param: what host memory holds
  peak          measured (--measure fake, the default: a training step as rank 0 of N on fake tensors,
                which allocate nothing, so a 13B model runs on a laptop in seconds; peak.py), or
                measured on real tensors of this machine (--measure real; measure.py), or estimated
                from the formula, the buckets and an activation estimate (--measure none)
A second table gives the set-up peak (build, load, zerodp.initialize) of the meta and the whole-model
paths beside the step's peak (setup.py).
--fit BUDGET answers from estimates (the larger of the step and the --setup path's set-up): the largest
micro-batch for the model, and the largest model of its family (width and depth scaled together,
PlanModel.scaled) at --micro-batch.

Nothing heavy is imported before the arguments parse (`--help` answers at once). Other reports add
their sections after the memory table through SECTION_MODULES (see there).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from zerodp.models.sizes import SIZES  # torch-free
from zerodp.plan.units import parse_bytes
from zerodp.sizes import REDUCE_BUCKET_SIZE

DEFAULT_BUCKET = REDUCE_BUCKET_SIZE  # config's default, from the torch-free zerodp.sizes for --help
WIDTH = 100  # columns of every table (a terminal, a README)
DTYPES = ("bf16", "fp16", "fp32")

# Extra sections of the report, printed after the memory table: each names a torch-free module
# with `add_arguments(parser)` (its own flags) and `render(args, model, console)` (model: a
# models.PlanModel, console: a rich Console of WIDTH columns); it imports what it needs in render.
SECTION_MODULES: tuple[str, ...] = ("zerodp.plan.communication", "zerodp.plan.tensor_parallel",
                                    "zerodp.plan.optimizer_shares", "zerodp.plan.finetune", "zerodp.plan.disk")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="zerodp estimate", description=(
        "Per-rank memory of a model at any world size: the ZeRO formula (device and host), reduce "
        "buckets, and a training step's peak measured as rank 0 of N on fake tensors (any size, in "
        "seconds). --fit: the largest micro-batch and the largest model of the family within a budget."))
    ap.add_argument("--model", help=f"a GPT size ({', '.join(SIZES)}; default 125M), a JSON file of "
                    "GPTConfig fields, a Hugging Face folder or config.json, or module:factory (a function "
                    "returning an nn.Module, or (module, inputs) with module(*inputs) the loss)")
    ap.add_argument("--world", type=int, nargs="+", default=[1, 8, 64], help="ranks N (default 1 8 64)")
    ap.add_argument("--stage", type=int, nargs="+", default=[1, 2, 3], choices=[0, 1, 2, 3])
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, help="sequence length (default: the model's context, at most 2048)")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--gas", type=int, default=1, help="gradient accumulation steps (fp32 gradients when > 1)")
    ap.add_argument("--checkpointing", action="store_true", help="checkpoint every block (GPT models)")
    ap.add_argument("--loss-chunk", type=int, default=None,
                    help="tokens per piece of the output head and loss (GPTConfig.loss_chunk)")
    ap.add_argument("--reduce-bucket-size", type=int, default=DEFAULT_BUCKET, help="elements (default %(default)s)")
    ap.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: master, gradient copy and "
                    "optimizer states in host memory (formula; the fake-tensor step runs it too)")
    ap.add_argument("--offload-param", action="store_true", help="stage 3: the parameter partition in host "
                    "memory too (formula only)")
    ap.add_argument("--bf16-master-weights", action="store_true", help="--dtype bf16: masters as the bf16 "
                    "weight + a 16-bit remainder, 2 bytes per parameter instead of 4 (bf16.bf16_master_weights_and_"
                    "grads; the formula columns)")
    ap.add_argument("--bf16-optimizer-states", action="store_true", help="--dtype bf16: optimizer states in bf16, "
                    "Adam 4 bytes per parameter instead of 8 (bf16.bf16_optimizer_states; the formula columns)")
    ap.add_argument("--measure", choices=["fake", "real", "none"], help="the peak: a step on fake tensors "
                    "(default), on this machine's real tensors, or none (formula and estimates; the default with --tp)")
    ap.add_argument("--no-measure", dest="measure", action="store_const", const="none", help=argparse.SUPPRESS)
    ap.add_argument("--fake-tensors", dest="measure", action="store_const", const="fake", help=argparse.SUPPRESS)
    ap.add_argument("--fsdp2", action="store_true", help="GPT, --measure fake: also FSDP2 (reshard True/False)")
    ap.add_argument("--plain", action="store_true", help="GPT, --measure fake: also plain PyTorch AMP")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--fit", type=parse_bytes, metavar="BUDGET", help="per-rank device budget, e.g. 80GiB")
    ap.add_argument("--setup", choices=["meta", "whole"], default="meta", help="the set-up --fit and 'plan with' "
                    "count: meta (built on meta, each rank materialising its part; default) or whole (every rank "
                    "builds the whole model first)")
    for name in SECTION_MODULES:
        importlib.import_module(name).add_arguments(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from zerodp.lazy import require
    require("zerodp estimate", "rich")
    from rich.console import Console

    from zerodp.plan.models import PlanModel, PlanModelError
    try:
        model = PlanModel.parse(args.model or "125M")
    except PlanModelError as e:
        ap.error(str(e))
    _check(ap, args, model)
    console = Console(width=WIDTH)
    from zerodp.plan import finetune
    from zerodp.plan.tables import fit_table, memory_tables
    try:  # --tp, --lora, --trainable-fraction: their section is the estimate, and leads
        for table in ([] if args.tp > 1 or finetune.requested(args) else [fit_table(args, model)]
                      if args.fit is not None else memory_tables(args, model, console)):
            console.print(table)
    except PlanModelError as e:  # e.g. a factory that is not there: found when the model is built
        ap.error(str(e))
    for name in SECTION_MODULES:
        importlib.import_module(name).render(args, model, console)


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace, model) -> None:
    """Flags that cannot go together fail here, before anything is built."""
    from zerodp.plan import tensor_parallel
    tensor_parallel.check(ap, args, model.shape())
    if args.measure is None:
        args.measure = "none" if args.tp > 1 else "fake"
    if args.loss_chunk is not None:
        if model.kind != "gpt":
            ap.error("--loss-chunk is a GPT option (GPTConfig.loss_chunk)")
        model.fields["loss_chunk"] = args.loss_chunk
    shape = model.shape()
    if args.seq is None:
        args.seq = min(shape.block_size, 2048) if shape is not None else 1
    if model.kind == "gpt" and args.seq > model.fields["block_size"]:
        model.fields["block_size"] = args.seq  # the position table must cover the sequence
    if (args.fsdp2 or args.plain) and (args.measure != "fake" or model.kind != "gpt"):
        ap.error("--fsdp2 and --plain measure a GPT on fake tensors (--measure fake)")
    if args.checkpointing and model.kind != "gpt":
        ap.error("--checkpointing knows a GPT's blocks only; for other models it is not estimated")
    if args.measure == "fake" and args.gas != 1:
        ap.error("--measure fake runs one micro-step per step: leave --gas at 1, or --measure real/none")
    if args.measure == "fake" and args.dtype == "fp16":
        ap.error("--measure fake cannot run fp16 (the step's overflow check reads a value, which fake tensors "
                 "do not have); --dtype bf16 has the same sizes")
    if args.fit is not None and (args.lora is not None or args.trainable_fraction is not None):
        ap.error("--fit plans full training (the largest micro-batch and model); with --lora or "
                 "--trainable-fraction the fine-tune's table is the estimate: leave --fit out")
    if args.fit is not None and model.kind == "factory":
        ap.error("--fit scales a GPT or Hugging Face config's width and depth; a factory's shape is unknown")
    if (args.bf16_master_weights or args.bf16_optimizer_states) and args.dtype != "bf16":
        ap.error("--bf16-master-weights and --bf16-optimizer-states keep bf16 beside bf16 weights: add --dtype bf16")
    if args.bf16_master_weights and args.offload_optimizer:
        ap.error("--bf16-master-weights with --offload-optimizer: zerodp refuses the two together (offloaded "
                 "masters cost no device memory)")
    if args.offload_param and set(args.stage) != {3}:
        ap.error("--offload-param is stage 3's (the parameters must be partitioned): add --stage 3")
    if min(args.world) < 1 or args.micro_batch < 1 or args.gas < 1:
        ap.error("--world, --micro-batch and --gas must be at least 1")


if __name__ == "__main__":
    main()
