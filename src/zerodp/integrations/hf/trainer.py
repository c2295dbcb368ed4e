"""`ZeroTrainer`: Hugging Face's `transformers.Trainer` with zerodp doing the data-parallel part.

The Trainer keeps everything it owns: data loading and sharding across ranks (through accelerate),
the loss (`compute_loss`, token-count normalisation), callbacks, logging, evaluation, TrainerState,
RNG files and checkpoint rotation. zerodp owns the model's parameters, gradients, optimizer step,
clipping, precision and lr schedule. The seams, the same places where the Trainer branches for
DeepSpeed (`deepspeed_init`, `accelerator.prepare`, `deepspeed_load_checkpoint`):

  _move_model_to_device   a model built on meta is left there: initialize materialises each rank's share
  _prepare_for_training   builds the engine instead of `accelerator.prepare(model, optimizer)` (no
                          DDP wrapper), and loads a zerodp checkpoint on resume
  training_step           the Trainer's own loss, then `engine.backward` instead of `accelerator.backward`
  optimizer.step()        the Trainer's loop calls it at each accumulation boundary: `engine.step()`
  _clip_grad_norm /       no norm before the step (gradients live in the engine's buckets); the engine
  _get_grad_norm          clips inside step() at max_grad_norm and reports the norm, which is logged
  save_model /            the HF folder: config, tokenizer and arguments as Trainer._save writes them,
                          the fp32 weights streamed from the engine bucket by bucket; the
  _save_optimizer_and_... sharded zerodp checkpoint (`global_stepN/`, `latest`) beside it
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import has_length

from zerodp import initialize
from zerodp.config import ConfigError
from zerodp.engine.engine import Engine, inside
from zerodp.engine.faces import EngineModule, EngineOptimizer, EngineScheduler
from zerodp.engine.summary import no_stage_chosen, set_up_line
from zerodp.integrations.hf.auto import fill_from_training_args
from zerodp.models import hf_folder

# The Trainer's own logger: ZeroTrainer's set-up line shows wherever the Trainer's own set-up lines do
# (Hugging Face's example scripts set it to INFO on the main process).
_trainer_log = transformers.utils.logging.get_logger("transformers.trainer")

# TrainingArguments that would take the data-parallel part away from zerodp, or act on a model the
# engine owns behind the Trainer's back.
_REFUSED = {
    "deepspeed": "zerodp replaces DeepSpeed here; give its config as zero_config, or in the environment "
                 "variable ZERODP_CONFIG in place of --deepspeed",
    "fsdp": "zerodp replaces FSDP here; leave fsdp unset",
    "auto_find_batch_size": "the engine is built once per run for one batch size; set "
                            "per_device_train_batch_size",
    "load_best_model_at_end": "loading weights into a model the engine has partitioned is not supported; "
                              "resume from the best checkpoint with train(resume_from_checkpoint=...)",
    "torch_compile": "the Trainer would compile the model outside the engine; compile the model before "
                     "passing it to ZeroTrainer",
}


# Where a script that passes no zero_config (a Hugging Face example script, whose only change is to import
# ZeroTrainer as Trainer) takes its config from: what it would have given as --deepspeed CONFIG.
CONFIG_ENV = "ZERODP_CONFIG"

# The Trainer methods ZeroTrainer overrides or relies on; a transformers without them would silently
# train without the engine (present since transformers 5.3; tested with 5.23).
_SEAMS = ("_prepare_for_training", "_wrap_model", "_move_model_to_device", "training_step", "_clip_grad_norm",
          "_get_grad_norm", "_maybe_log_save_evaluate", "save_model", "_save", "_save_optimizer_and_scheduler")


class ZeroTrainer(Trainer):
    """A `transformers.Trainer` that trains with zerodp's ZeRO engine (stages 0-3, offload).

        trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                              zero_config={"zero_optimization": {"stage": 2}})
        trainer.train()

    zero_config: a zerodp / DeepSpeed-style config (dict or JSON path); when None, the JSON file the
    environment variable ZERODP_CONFIG names (where a script would pass --deepspeed CONFIG). Its "auto" values, and the batch
    sizes, gradient_clipping and fp16/bf16 where absent, come from the TrainingArguments as Hugging Face
    does for DeepSpeed (`zerodp.integrations.hf.fill_from_training_args`). Without an `optimizer` or
    `scheduler` section the Trainer's own (from TrainingArguments, or `optimizers=`) are used.
    weights: where the model's parameter values come from (`zerodp.initialize(..., weights=)`): a Hugging
    Face folder, a .safetensors file, a zerodp or DeepSpeed checkpoint; each rank reads only its share,
    so the model can be built from its config alone (`AutoModelForCausalLM.from_config`) instead of
    `from_pretrained` loading it whole on every rank.
    Launch with torchrun (or accelerate launch); checkpoints hold the HF model files plus a sharded zerodp
    checkpoint, from which `train(resume_from_checkpoint=...)` resumes.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that puts another Trainer subclass first in its bases (`class T(SFTTrainer, ZeroTrainer)`)
        would hand zero_config= to that class's __init__, which does not take it: such a subclass gets an
        __init__ that sets zerodp's keywords aside before the chain of __init__s runs."""
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        first_init = next(c for c in mro if "__init__" in c.__dict__)
        if not issubclass(first_init, ZeroTrainer):
            cls.__init__ = _setting_zero_keywords_aside(first_init.__init__)

    def __init__(self, *args: Any, zero_config: dict[str, Any] | str | os.PathLike[str] | None = None,
                 weights: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        zero_config, weights = self.__dict__.pop("_zero_keywords", (zero_config, weights))
        missing = [m for m in _SEAMS if not hasattr(Trainer, m)]
        if missing:
            raise ImportError(f"ZeroTrainer needs a transformers whose Trainer has {', '.join(missing)} (the "
                              f"installed {transformers.__version__} has not); pip install 'zerodp[hf]'")
        super().__init__(*args, **kwargs)
        refused = [f"TrainingArguments.{k} is not supported by ZeroTrainer: {why}"
                   for k, why in _REFUSED.items() if getattr(self.args, k, None)]
        if refused:
            raise ValueError("\n".join(refused))
        self.zero_config = zero_config if zero_config is not None else os.environ.get(CONFIG_ENV) or None
        self.weights = weights
        self.engine: Engine | None = None

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """A model built on meta has nothing to move: initialize materialises this rank's share on the device."""
        if not any(t.is_meta for t in model.parameters()):
            super()._move_model_to_device(model, device)

    # ---- building the engine ----------------------------------------------------------------------
    def _prepare_for_training(self, max_steps: int, train_dataloader, resume_from_checkpoint: str | None):
        """Build the engine where the Trainer would `accelerator.prepare` the model (DDP) and optimizer."""
        if self.engine is not None:
            raise RuntimeError("ZeroTrainer.train() builds its zerodp engine once; make a new ZeroTrainer "
                               "(on a fresh model) for another run, resuming from a checkpoint if needed")
        # Before the batch sizes, which are computed for the Trainer's world size and would otherwise
        # fail on the group's with an arithmetic error that hides the cause.
        _check_same_world(_group_world_size(), self.args.world_size)
        config = fill_from_training_args(self.zero_config, self.args, self.args.world_size, max_steps, self.model)
        _check_full_windows(train_dataloader, config["gradient_accumulation_steps"], max_steps)
        optimizer = self._optimizer_for(config)
        scheduler = self._scheduler_for(config, max_steps)
        self.engine = initialize(self.model, optimizer, config, lr_scheduler=scheduler, weights=self.weights)
        _check_same_world(inside(self.engine).comm.world_size, self.args.world_size)
        if inside(self.engine).comm.rank == 0:
            self._say_set_up()
        self.optimizer = EngineOptimizer(self.engine)
        self.lr_scheduler = EngineScheduler(self.optimizer)
        self.model_wrapped = EngineModule(self.engine.module, self.engine)
        if resume_from_checkpoint is not None:
            self.engine.load_checkpoint(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model_wrapped, train_dataloader

    def _say_set_up(self) -> None:
        """One line on rank 0: the stage, offload and dtype that run, among the Trainer's own set-up lines
        (its logger, at INFO), or as a warning when no stage was chosen (plain data parallelism)."""
        line = set_up_line(self.engine.config, inside(self.engine).comm.world_size, inside(self.engine).spec.shard_size,
                           collectives=inside(self.engine).comm.plan.describe())
        if no_stage_chosen(self.engine.config):
            _trainer_log.warning("ZeroTrainer was given no ZeRO stage (no zero_config, or one without "
                                 "zero_optimization.stage), so it trains plain data parallelism: %s. Pass e.g. "
                                 "zero_config={\"zero_optimization\": {\"stage\": 2}} to shard the model states",
                                 line)
        else:
            _trainer_log.info("%s", line)

    def _optimizer_for(self, config: dict[str, Any]) -> torch.optim.Optimizer | None:
        """The config's optimizer section (built by the engine), or the Trainer's own."""
        if "optimizer" not in config:
            return self.create_optimizer()
        if self.optimizer is not None:
            raise ConfigError("an optimizer was passed to the Trainer (optimizers=) and the zerodp config has "
                              "an 'optimizer' section; keep one of them")
        return None

    def _scheduler_for(self, config: dict[str, Any], max_steps: int):
        """None for the config's scheduler section (built by the engine), or a callable building the
        Trainer's own (TrainingArguments' lr_scheduler_type, or optimizers=) on the engine's optimizer.
        Either way the engine steps it after every update it does not skip."""
        if "scheduler" not in config:
            return lambda optimizer: self.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)
        if self.lr_scheduler is not None:
            raise ConfigError("an lr scheduler was passed to the Trainer (optimizers=) and the zerodp config has "
                              "a 'scheduler' section; keep one of them")
        return None

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        # Evaluation after training runs through the engine too (stage 3 gathers the parameters).
        if self.engine is not None:
            return self.model_wrapped
        return super()._wrap_model(model, training, dataloader)

    # ---- one step ---------------------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The Trainer's loss on one micro-batch, then `engine.backward`; returns the loss it reports."""
        gas = inside(self.engine).spec.gas
        if self.current_gradient_accumulation_steps != gas:
            raise ValueError(f"this optimizer step has {self.current_gradient_accumulation_steps} micro-batches "
                             f"per rank where gradient_accumulation_steps is {gas}; zerodp updates after exactly "
                             f"{gas}: make the batches per rank in an epoch a multiple of {gas}")
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self._loss_is_scaled_for_ga(num_items_in_batch):
            # Already a share of the whole window's loss: the engine must not divide it by gas again.
            self.engine.backward(loss, scale_wrt_gas=False)
            return loss.detach()
        self.engine.backward(loss)
        return loss.detach() / gas

    def _loss_is_scaled_for_ga(self, num_items_in_batch: torch.Tensor | int | None) -> bool:
        """The Trainer's own rule (Trainer.training_step) for a loss already normalised over the window."""
        if getattr(self, "loss_is_scaled_for_ga", None) is not None:
            return bool(self.loss_is_scaled_for_ga)
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # the engine clips inside step(), at gradient_clipping = max_grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm=None) -> None:
        return None  # known only after the step: logged from the engine in _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args: Any, **kwargs: Any) -> None:
        norm = self.engine.grad_norm if self.engine is not None else grad_norm
        super()._maybe_log_save_evaluate(tr_loss, norm, *args, **kwargs)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The HF folder (config, model.safetensors, tokenizer) with the engine's full fp32 weights.
        Collective once the engine exists: call it on every rank."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if isinstance(self.model, transformers.PreTrainedModel):
            # Trainer._save with no weights writes the config, tokenizer and training arguments (the
            # writing rank); the weights follow bucket by bucket from every rank, never gathered whole.
            super()._save(output_dir, state_dict={})
            hf_folder.write_weights(output_dir, inside(self.engine).weights(), hf_folder.meta_like(self.model),
                                    writer=self.args.should_save)
        else:
            self._save(output_dir, state_dict=self.engine.full_state_dict())
        if self.args.push_to_hub and not _internal_call:  # as Trainer.save_model does
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The sharded zerodp checkpoint (masters, optimizer, scheduler, loss scale, counters) in
        # output_dir/global_stepN with output_dir/latest, where DeepSpeed's would be.
        self.engine.save_checkpoint(output_dir)


def _setting_zero_keywords_aside(init):
    """`init` (the first base's __init__) called without zero_config= and weights=, which ZeroTrainer.__init__,
    reached later in the chain, takes from the instance instead."""

    def __init__(self, *args: Any, zero_config=None, weights=None, **kwargs: Any) -> None:
        self._zero_keywords = (zero_config, weights)
        init(self, *args, **kwargs)

    return __init__


def _group_world_size() -> int:
    """The ranks of the process group zerodp.initialize will use: the existing one, or torchrun's."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _check_same_world(group: int, trainer: int) -> None:
    if group != trainer:
        raise ValueError(f"zerodp's process group has {group} ranks but the Trainer (accelerate) sees {trainer} "
                         "processes; launch every rank with torchrun or accelerate launch so both agree")


def _check_full_windows(train_dataloader, gas: int, max_steps: int) -> None:
    """zerodp updates after exactly `gas` micro-batches; the Trainer would make a shorter last step
    of an epoch whose batches per rank are not a multiple of gas. Refused before training starts."""
    if not has_length(train_dataloader):
        return
    batches = len(train_dataloader)
    per_epoch = -(-batches // gas)
    if batches % gas and max_steps >= per_epoch:
        raise ValueError(f"an epoch has {batches} batches per rank, not a multiple of gradient_accumulation_steps "
                         f"{gas}, so its last optimizer step would have {batches % gas} micro-batch(es); zerodp "
                         f"updates after exactly {gas}: change the dataset size, per_device_train_batch_size or "
                         "dataloader_drop_last, or stop before (max_steps < "
                         f"{per_epoch})")
