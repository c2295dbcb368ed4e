"""The job's options: built-in defaults, then --ds-config, then --config, then flags; checked early.

Bad options fail here, before any rank starts, with the flag or key that is wrong. `ds_config` turns
the settled options into the zerodp config the engine is built with.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import shlex
from typing import TYPE_CHECKING, Any

from zerodp.models.hf_folder import is_model_folder  # torch-free

# No torch here, nor modules that import it: `--help` answers before any heavy import (torch and
# zerodp.config are imported inside parse_options, after argparse has run).
from zerodp.models.sizes import HF_MODELS, SIZES

if TYPE_CHECKING:  # torch underneath: imported where the config is built, after argparse
    from zerodp.config import Config

# A NonFiniteError stops every rank at the same step; rank 0 says why, once, and the launcher only
# passes the code on (defined here, torch-free: the launcher does not import the training loop).
EXIT_NON_FINITE = 3

# Built-in defaults, the lowest layer: --ds-config, then --config, then flags override them.
# On CPU the default run (small model, 2 ranks, 8 x 256 tokens each) takes a few minutes.
DEFAULTS: dict[str, Any] = dict(
    model="small", data=None, steps=100, micro_batch=8, grad_accum=1, block_size=None,
    lr=1e-3, min_lr=1e-4, warmup=20, weight_decay=0.1, clip=1.0, stage=2, offload=False, nvme_path=None,
    dtype=None, eval_every=20, eval_batches=4, save_every=50, keep_last=None, out=None, resume=False,
    move_aside=False,
    resume_from=None, seed=1337, nproc=None, tp=1, sequence_parallel=False, ds_config=None, timeout=600.0, save_on_signal=True,
    on_non_finite="raise", crash_after=None, crash_rank=None, crash_signal="SIGKILL", crash_where="step",
)
# Fault injection for the tests, not for --config.
HIDDEN = ("crash_after", "crash_rank", "crash_signal", "crash_where")
# A choice for one command, not a setting a --config file keeps: every run from it would move the last aside.
ONE_COMMAND = ("move_aside",)
DTYPES = ("fp32", "bf16", "fp16")  # the working precision; fp32 master weights in every case


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zerodp train", description="Train a GPT with ZeRO data parallelism. With no launcher "
        "it starts --nproc ranks itself (2 gloo ranks on CPU, one per GPU on CUDA).")
    # Every default is None so that a flag given on the command line can be told from one not given.
    p.add_argument("--config", help="JSON file with any of the keys below (underscores), "
                   "e.g. {\"steps\": 500, \"micro_batch\": 16}; flags override it")
    p.add_argument("--model", help=f"a GPT size ({', '.join(SIZES)}; default small), a Hugging "
                   f"Face model built with random weights: {', '.join(HF_MODELS)}, optionally "
                   "with a GPT size for its shape (default small), e.g. hf-llama:tiny, or a local HF "
                   "model folder (save_pretrained's) to fine-tune; HF models also end as OUT/hf")
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
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    p.add_argument("--offload", nargs="?", const=True, type=_offload, metavar="cpu|nvme",
                   help="ZeRO-Offload: the fp32 master, its gradient and AdamW's state in host memory, stepped there "
                   "(--offload or --offload cpu: zero_optimization.offload_optimizer.device = cpu); --offload nvme: "
                   "the same step, with the master and AdamW's state in a scratch file under --nvme-path")
    p.add_argument("--nvme-path", help="--offload nvme: the directory of each rank's scratch file (default: the "
                   "--ds-config's offload_optimizer.nvme_path, else OUT/nvme)")
    p.add_argument("--dtype", choices=list(DTYPES), help="working precision (default bf16 on "
                   "CUDA, fp32 on CPU)")
    p.add_argument("--eval-every", type=int, help="validation every K steps, 0 = none (default 20)")
    p.add_argument("--eval-batches", type=int, help="validation batches per evaluation (default 4)")
    p.add_argument("--save-every", type=int, help="checkpoint every K steps, 0 = only at the end "
                   "(default 50)")
    p.add_argument("--keep-last", type=int, help="keep only this run's N newest checkpoints, never "
                   "another run's (default: all)")
    p.add_argument("--out", help="output directory (default runs/<model>-zero<stage>, -tp<N> added with --tp N)")
    add_run_options(p)
    p.add_argument("--seed", type=int, help="seed of the weights and of the data order (default 1337)")
    p.add_argument("--nproc", type=int, help="ranks to start when not under torchrun (default: "
                   "2 on CPU, the GPU count on CUDA); 1 runs in this process")
    add_parallel_options(p)
    p.add_argument("--ds-config", help="a DeepSpeed-style JSON config; its batch, precision, "
                   "clipping and zero settings fill the options not given here")
    p.add_argument("--timeout", type=float, help="seconds a collective may wait for a stalled or dead "
                   "peer before the job ends with an error naming it (default 600)")
    p.add_argument("--no-save-on-signal", dest="save_on_signal", action="store_false", default=None,
                   help="on SIGTERM/SIGINT, stop after the current step without writing a checkpoint "
                   "(default: write one, then exit with 128 + the signal number)")
    p.add_argument("--on-non-finite", choices=["raise", "skip"], help="a step whose gradient norm is "
                   "nan/inf is skipped on every rank; raise: stop the job after 3 such steps in a row "
                   "(the default), skip: go on (the config's non_finite section)")
    add_fault_options(p)
    return p


def add_run_options(p: argparse.ArgumentParser) -> None:
    """--resume, --move-aside and --resume-from: which run the job continues, or how a new one takes --out."""
    p.add_argument("--resume", nargs="?", const=True, metavar="TAG",
                   help="continue from OUT/checkpoints' latest checkpoint if there is one (the newest "
                   "intact one of the same run, with a warning, if latest is broken; from scratch, with a warning, if "
                   "there is none), or from checkpoint TAG; on "
                   "another number of ranks --grad-accum is adjusted to keep the global batch")
    p.add_argument("--move-aside", action="store_true", default=None,
                   help="start a new run in --out even though it holds another run's checkpoints or outputs: "
                   "the folder is first renamed to OUT.moved-YYYYMMDD-HHMMSS (UTC), that run's work kept whole "
                   "there (without this, or --resume, such a run stops before any rank starts)")
    p.add_argument("--resume-from", metavar="DIR", help="continue from the checkpoint in DIR: a zerodp or "
                   "DeepSpeed ZeRO save_dir or tag directory (without --resume, or when OUT has none)")


def add_parallel_options(p: argparse.ArgumentParser) -> None:
    """--tp and --sequence-parallel: the GPT split over tensor-parallel ranks, ZeRO over the rest."""
    p.add_argument("--tp", type=int, help="tensor parallelism: each GPT block's attention heads and MLP split "
                   "over N ranks (Megatron's layout, torch's parallelize_module), ZeRO over the world / N "
                   "data-parallel ranks (default 1: none); e.g. --tp 2 --nproc 4 is 2 data-parallel x 2 "
                   "tensor-parallel")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="with --tp: sequence parallelism for the GPT's norms (each tp rank normalises its slice of "
                   "the sequence and keeps only that slice's activations between the blocks' halves)")


def add_fault_options(p: argparse.ArgumentParser) -> None:
    """For the fault tests, hidden: after step K (and its checkpoint, if any) send SIGNAL (default
    SIGKILL) to every rank's own process, or to rank R's only; --crash-where eval / save: at step K,
    just before its evaluation / its checkpoint save instead."""
    p.add_argument("--crash-after", type=int, help=argparse.SUPPRESS)
    p.add_argument("--crash-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--crash-signal", help=argparse.SUPPRESS)
    p.add_argument("--crash-where", choices=["step", "eval", "save"], help=argparse.SUPPRESS)


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over the --config file over the --ds-config file over DEFAULTS."""
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    from_file = _read_options_file(args.config) if args.config else {}
    from zerodp.distributed.device import device_count  # after argparse: --help and a bad flag answer without torch

    accelerators = device_count()
    nproc = given.get("nproc", from_file.get("nproc")) or accelerators or 2
    # The data-parallel world: torchrun's world when under torchrun, over --tp (checked in _check_tp).
    tp = given.get("tp", from_file.get("tp", DEFAULTS["tp"]))
    world = int(os.environ.get("WORLD_SIZE", nproc)) // tp if type(tp) is int and tp >= 1 else 1
    ds = _from_ds_config(given.get("ds_config", from_file.get("ds_config")), {**DEFAULTS, **from_file, **given}, world)
    opts = {**DEFAULTS, **ds, **from_file, **given, "nproc": nproc}
    opts["explicit"] = sorted({*ds, *from_file, *given})  # what a resume must not change (resume.py)
    opts["user_set"] = sorted({*from_file, *given})  # these win over the --ds-config's sections (ds_sections.py)
    opts["flags"], opts["config"] = given, args.config  # what command_line repeats in a printed command
    if opts["dtype"] is None:
        opts["dtype"] = "bf16" if accelerators else "fp32"
    if opts["out"] is None:
        opts["out"] = default_out(opts)
    _check(opts)
    return argparse.Namespace(**opts)


# Left out of a printed command: the fault tests' flags, and what command_line sets itself.
_NOT_REPEATED = ("resume", "move_aside", "out", "steps", *HIDDEN)


def command_line(opts: argparse.Namespace, steps: int, resume: bool | str = True, move_aside: bool = False,
                 out: str | None = None, **changes: Any) -> str:
    """The whole `zerodp train` command that runs opts' job on (the hints "resume with: ..." print it): its
    --config file and the flags it was given (`changes` replacing some), with --out (opts.out unless `out`),
    --steps `steps`, and --resume (`resume`: True, a tag, or False for none) or --move-aside."""
    words = ["zerodp", "train", *(["--config", opts.config] if opts.config else [])]
    for key, value in {**opts.flags, **changes}.items():
        flag = f"--{key.replace('_', '-')}"
        if key in _NOT_REPEATED:
            continue
        if key == "save_on_signal":
            words += [] if value else ["--no-save-on-signal"]
        elif value is True:  # --offload, --sequence-parallel
            words.append(flag)
        elif value is not False and value is not None:
            words += [flag, str(value)]
    words += ["--out", out or opts.out, "--steps", str(steps)]
    words += ["--resume"] if resume is True else ["--resume", resume] if resume else []
    return shlex.join(words + (["--move-aside"] if move_aside else []))


def default_out(opts: dict[str, Any]) -> str:
    """runs/<model>-zero<stage>, and -tp<N> for a tensor-parallel job: the README's `--tp 2 --nproc 4` must
    not replace the main job's checkpoints (resume.py refuses a default folder another job wrote)."""
    name = os.path.basename(os.path.normpath(opts["model"]))  # a model folder: its name
    tp = f"-tp{opts['tp']}" if opts["tp"] != 1 else ""
    return os.path.join("runs", f"{name.replace(':', '-')}-zero{opts['stage']}{tp}")


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
        if name in ONE_COMMAND:
            raise SystemExit(f"zerodp train: {key!r} in --config file {path!r}: it is a choice for one command "
                             f"(each run from this file would move the previous one aside); pass "
                             f"--{name.replace('_', '-')} on the command line")
        if name not in DEFAULTS or name in HIDDEN:
            close = difflib.get_close_matches(name, DEFAULTS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(DEFAULTS)}"
            raise SystemExit(f"zerodp train: unknown key {key!r} in --config file {path!r}; {hint}")
        opts[name] = value
    return opts


def _from_ds_config(path: str | None, prelim: dict[str, Any], world: int) -> dict[str, Any]:
    """The job's options that a DeepSpeed-style config settles (validated by zerodp's loader); its
    "auto" values are the other layers' (`prelim`), so they settle nothing."""
    if path is None:
        return {}
    from zerodp.config import ConfigError, load_config
    from zerodp.train.ds_sections import read_ds_config
    try:
        cfg = load_config(read_ds_config(path, prelim, world))
        batch = cfg.batch(world) if cfg.train_batch_size or cfg.train_micro_batch_size_per_gpu else None
    except ConfigError as e:
        raise SystemExit(f"zerodp train: --ds-config {path!r}: {e}")
    opts: dict[str, Any] = {"stage": cfg.zero_optimization.stage, "clip": cfg.gradient_clipping,
                            "on_non_finite": cfg.non_finite.policy,
                            "offload": {"none": False, "cpu": True, "nvme": "nvme"}[
                                cfg.zero_optimization.offload_optimizer.device]}
    if batch is not None:
        opts["micro_batch"], opts["grad_accum"] = batch.micro_batch_size, batch.gradient_accumulation_steps
    if cfg.fp16.enabled or cfg.bf16.enabled:
        opts["dtype"] = "fp16" if cfg.fp16.enabled else "bf16"
    low = [f"bf16.{k}" for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states") if getattr(cfg.bf16, k)]
    if low and prelim["dtype"] not in (None, "bf16"):  # for_job would turn bf16 off under them, on every rank
        raise SystemExit(f"zerodp train: --ds-config {path!r} sets {' and '.join(low)}, which keep the optimizer's "
                         f"masters and states beside bf16 weights, but the job runs in {prelim['dtype']} (--dtype); "
                         "give --dtype bf16 or remove them")
    if cfg.optimizer is not None:
        for key in ("lr", "weight_decay"):
            if key in cfg.optimizer.params:
                opts[key] = cfg.optimizer.params[key]
    return opts


def _check(o: dict[str, Any]) -> None:
    """Bad options fail here, before any rank starts, with the flag that is wrong."""
    family, colon, size = o["model"].partition(":")
    if is_model_folder(o["model"]):
        pass  # a save_pretrained folder: each rank reads its tokenizer (build.py) and its share of its weights
    elif os.path.isdir(o["model"]):
        raise SystemExit(f"zerodp train: --model {o['model']!r} is a directory without config.json; "
                         "expected a Hugging Face model folder as save_pretrained writes it")
    elif not (o["model"] in SIZES or family in HF_MODELS and (not colon or size in SIZES)):
        raise SystemExit(f"zerodp train: --model {o['model']!r}: expected one of "
                         f"{', '.join(list(SIZES) + list(HF_MODELS))} (HF models may add ':SIZE') "
                         "or a local HF model folder")
    for key in ("steps", "micro_batch", "grad_accum", "eval_batches", "nproc", "tp"):
        if type(o[key]) is not int or o[key] < 1:  # a JSON true is not a count
            raise SystemExit(f"zerodp train: --{key.replace('_', '-')} {o[key]!r}: expected a "
                             "positive integer")
    if type(o["eval_every"]) is not int or o["eval_every"] < 0:
        raise SystemExit(f"zerodp train: --eval-every {o['eval_every']!r}: expected a positive integer, or 0 "
                         "for no validation")
    if o["keep_last"] is not None and (type(o["keep_last"]) is not int or o["keep_last"] < 1):
        raise SystemExit(f"zerodp train: --keep-last {o['keep_last']!r}: expected a positive integer")
    if not isinstance(o["resume"], (bool, str)):
        raise SystemExit(f"zerodp train: --resume {o['resume']!r}: expected true/false or a checkpoint tag")
    if o["move_aside"] and o["resume"] and "resume" not in o["flags"]:
        o["resume"] = False  # --move-aside given for this command wins over a --config file's resume
    if o["move_aside"] and o["resume"]:
        raise SystemExit("zerodp train: --move-aside starts a new run (the folder's old one moved aside) and --resume "
                         "continues the folder's run: pass one of them")
    if isinstance(o["timeout"], bool) or not isinstance(o["timeout"], (int, float)) or not 0 < o["timeout"] < math.inf:
        raise SystemExit(f"zerodp train: --timeout {o['timeout']!r}: expected a positive number of seconds")
    if not isinstance(o["offload"], bool) and o["offload"] != "nvme":
        raise SystemExit(f"zerodp train: offload {o['offload']!r}: expected true (cpu), false or \"nvme\"")
    if o["stage"] not in (0, 1, 2, 3):
        raise SystemExit(f"zerodp train: --stage {o['stage']!r}: expected 0, 1, 2 or 3")
    if not isinstance(o["save_on_signal"], bool):
        raise SystemExit(f"zerodp train: save_on_signal {o['save_on_signal']!r}: expected true or false")
    if o["data"] is not None and not os.path.exists(o["data"]):
        raise SystemExit(f"zerodp train: --data {o['data']!r} does not exist")
    if o["dtype"] not in DTYPES:
        raise SystemExit(f"zerodp train: --dtype {o['dtype']!r}: expected one of {', '.join(DTYPES)}")
    if o["on_non_finite"] not in ("raise", "skip"):
        raise SystemExit(f"zerodp train: --on-non-finite {o['on_non_finite']!r}: expected raise or skip")
    _check_tp(o)
    if o["warmup"] >= o["steps"]:
        o["warmup"] = max(0, o["steps"] // 10)  # a short run still gets a cosine to decay over


def _check_tp(o: dict[str, Any]) -> None:
    """--tp: what the tensor-parallel job supports, refused here with the reason (every rank parses alike)."""
    tp, world = o["tp"], int(os.environ.get("WORLD_SIZE", o["nproc"]))
    if not isinstance(o["sequence_parallel"], bool):
        raise SystemExit(f"zerodp train: sequence_parallel {o['sequence_parallel']!r}: expected true or false")
    if tp == 1:
        if o["sequence_parallel"]:
            raise SystemExit("zerodp train: --sequence-parallel splits the sequence over the tensor-parallel ranks: "
                             "give --tp N with N > 1 too")
        return
    if world % tp:
        raise SystemExit(f"zerodp train: --tp {tp} does not divide the {world} rank(s) (--nproc or torchrun's "
                         f"world): the ranks form data-parallel groups of --tp ranks; use a world that is a "
                         f"multiple of {tp}")
    if o["model"] not in SIZES:
        raise SystemExit(f"zerodp train: --tp {tp} with --model {o['model']!r}: only zerodp's own GPT sizes have "
                         f"a tensor-parallel plan ({', '.join(SIZES)}); train a Hugging Face model with --tp 1")
    shape = SIZES[o["model"]]
    if shape["n_head"] % tp or shape["n_embd"] % tp:
        raise SystemExit(f"zerodp train: --tp {tp}: --model {o['model']} has n_head={shape['n_head']} and "
                         f"n_embd={shape['n_embd']}, which tensor parallelism splits by heads; use a --tp that "
                         "divides both")
    block = o["block_size"] or shape["block_size"]
    if o["sequence_parallel"] and block % tp:
        raise SystemExit(f"zerodp train: --sequence-parallel with --tp {tp}: the sequence ({block} tokens, "
                         f"--block-size) must be divisible by {tp}")
    if o["stage"] == 0:  # the engine's too: tensor parallelism needs ZeRO's one step over the whole world
        raise SystemExit(f"zerodp train: --tp {tp}: --stage 0 is not supported with tensor parallelism; use "
                         "--stage 1, 2 or 3, or --tp 1")


def _offload(value: str) -> bool | str:
    """--offload's value: cpu (True, as the flag alone) or nvme."""
    if value not in ("cpu", "nvme"):
        raise argparse.ArgumentTypeError(f"expected cpu or nvme, got {value!r}")
    return True if value == "cpu" else value


def ds_config(opts: argparse.Namespace) -> Config:
    """The zerodp config: the --ds-config file's, under the job's settled options (Config.for_job's precedence)."""
    from zerodp.config import load_config
    from zerodp.train.ds_sections import job_world, read_ds_config
    base = load_config(read_ds_config(opts.ds_config, vars(opts), job_world(opts)) if opts.ds_config else None)
    nvme_path = None
    if opts.offload == "nvme":
        nvme_path = (opts.nvme_path or base.zero_optimization.offload_optimizer.nvme_path
                     or os.path.join(opts.out, "nvme"))
        os.makedirs(nvme_path, exist_ok=True)  # (each rank's file is removed from it as soon as it is open)
    offload = "nvme" if opts.offload == "nvme" else "cpu" if opts.offload else "none"
    return base.for_job(stage=opts.stage, offload_optimizer=offload, nvme_path=nvme_path, dtype=opts.dtype,
                        micro_batch_size=opts.micro_batch, gradient_accumulation_steps=opts.grad_accum,
                        gradient_clipping=opts.clip, comm_timeout_s=opts.timeout, non_finite_policy=opts.on_non_finite)
