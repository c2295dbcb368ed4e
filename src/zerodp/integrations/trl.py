"""TRL's trainers on zerodp: `ZeroSFTTrainer`, `ZeroDPOTrainer`, `ZeroGRPOTrainer`, and `ZeroTRLMixin` for any
other TRL trainer (every one is a `transformers.Trainer`, so `ZeroTrainer` does the data-parallel part).

    from zerodp.integrations.trl import ZeroSFTTrainer as SFTTrainer   # the one line a TRL script changes

The config comes as `zero_config=` or, in a script that passes none, from the file the environment variable
ZERODP_CONFIG names, as for `ZeroTrainer`. What TRL does outside the Trainer's seams, and zerodp answers here:
  reading the policy's weights  TRL gathers them only under DeepSpeed ZeRO-3 (it asks Accelerate), and
                                otherwise reads `param.data`, which zerodp's stage 3 leaves empty between
                                forwards. `sync_ref_model` (SyncRefModelCallback) and GRPO's generation run
                                inside `engine.gathered_parameters()` (every stage; a no-op below 3).
  the reference model (DPO, GRPO with beta > 0)  TRL keeps it outside the Trainer (Accelerate places it,
                                whole on every rank). At stage 3 `reference_model` makes it a sharded
                                module (zerodp.shard), 1/N per rank and gathered per unit in its forward, as TRL's
                                prepare_deepspeed does under DeepSpeed ZeRO-3; below 3 it stays whole, as
                                the policy's weights are. sync_ref_model mixes inside both engines'
                                gathered_parameters(), keeping the result in the reference's shards.
  refused at set-up             what would read the policy's weights through another path: vLLM generation,
                                DPO's generate_during_eval, GRPO's ds3_gather_for_generation=False at stage 3.
  a route placed wrong          importing this module adds `RouteCheck` to transformers' DEFAULT_CALLBACKS
                                (every Trainer built after it, none before): at train begin it refuses a
                                Trainer that zerodp does not train while ZERODP_CONFIG is set (the script's
                                own `from trl import SFTTrainer`, inside TRL's main(), rebound the name), and
                                a TRL trainer mixed with ZeroTrainer by hand whose sync_ref_model would copy
                                stage 3's empty param.data. zerodp's TRL trainers drop it.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import transformers
import transformers.trainer
from torch import nn
from trl import DPOTrainer, GRPOTrainer, SFTTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from zerodp import shard
from zerodp.engine.engine import Engine, inside
from zerodp.engine.sharding.module import ShardedModule
from zerodp.integrations.hf.trainer import CONFIG_ENV, ZeroTrainer

_trainer_log = transformers.utils.logging.get_logger("transformers.trainer")

# TRL arguments whose code path reads or writes the policy's weights around the engine.
_REFUSED = {
    "use_vllm": "vLLM generation reads the policy's weights outside the engine; zerodp's TRL trainers generate "
                "with transformers (use_vllm=False)",
    "generate_during_eval": "DPO's evaluation-time generation reads the policy outside the engine; leave it False",
}

# TRL trainer methods that generate with the policy (through unwrap_model_for_generation).
_GENERATING = ("_generate_single_turn",)


class ZeroTRLMixin(ZeroTrainer):
    """zerodp's part of a TRL trainer: `class ZeroKTOTrainer(ZeroTRLMixin, KTOTrainer)` (either base order)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refused = [f"{type(self.args).__name__}.{k} is not supported by {type(self).__name__}: {why}"
                   for k, why in _REFUSED.items() if getattr(self.args, k, False)]
        if refused:
            raise ValueError("\n".join(refused))

    def _prepare_for_training(self, max_steps: int, train_dataloader, resume_from_checkpoint: str | None):
        # Here rather than in __init__: with TRL's class first in the bases, its __init__ sets the reference
        # model and callbacks up after ZeroTrainer's has returned.
        for callback in list(self.callback_handler.callbacks):
            if type(callback) is RouteCheck:  # this trainer is the route
                self.callback_handler.remove_callback(callback)
            if type(callback) is SyncRefModelCallback:  # TRL's, which copies param.data as it finds it
                self.callback_handler.remove_callback(callback)
                self.add_callback(GatheredSyncRefModel(self))
        prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if getattr(self, "ref_model", None) is not None:
            self.ref_model = reference_model(self.ref_model, self.engine, self.args)
        if inside(self.engine).spec.gathers_per_unit and getattr(self.args, "ds3_gather_for_generation", True) is False:
            raise ValueError("ds3_gather_for_generation=False would generate from stage 3's partitioned parameters "
                             "unit by unit; zerodp gathers the policy whole for generation: leave it True")
        return prepared

    @contextmanager
    def whole_policy(self) -> Iterator[nn.Module]:
        """The policy with whole parameters (stage 3 gathers them; collective: every rank enters), seen by TRL's
        `unwrap_model_for_generation` as the plain module it generates with."""
        if self.engine is None:  # before train(): the model is TRL's own
            yield self.model
            return
        wrapped = self.model_wrapped
        self.model_wrapped = self.model
        try:
            with self.engine.gathered_parameters():
                yield self.model
        finally:
            self.model_wrapped = wrapped

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """TRL's generation (GRPO's, RLOO's `_generate_single_turn`) runs inside `whole_policy`, whichever base
        comes first: the subclass gets a wrapper of the method its bases define."""
        super().__init_subclass__(**kwargs)
        for name in _GENERATING:
            method = next((c.__dict__[name] for c in cls.__mro__ if name in c.__dict__), None)
            if method is not None and not getattr(method, "gathers_policy", False):
                setattr(cls, name, _on_whole_policy(method))


def _on_whole_policy(method):
    def run(self, *args: Any, **kwargs: Any):
        # transformers' generate on the policy's whole weights, as TRL does under DeepSpeed ZeRO-3.
        with self.whole_policy():
            return method(self, *args, **kwargs)

    run.gathers_policy = True
    return functools.wraps(method)(run)


class RouteCheck(transformers.TrainerCallback):
    """A Trainer that does not train through zerodp's TRL trainers where the script meant it to (see the
    module's docstring): refused by name when training begins, on every rank alike, before its first step."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs) -> None:
        engine = getattr(optimizer, "engine", None)  # ZeroTrainer's optimizer steps its engine
        if not isinstance(engine, Engine):
            if os.environ.get(CONFIG_ENV):
                raise RuntimeError(
                    f"{CONFIG_ENV} is set and zerodp.integrations.trl was imported, but this Trainer is not zerodp's "
                    "(it would train plain TRL and ignore the config): a script's own `from trl import SFTTrainer` "
                    "rebinds the name imported before it (TRL's scripts import inside main()); put `from "
                    "zerodp.integrations.trl import ZeroSFTTrainer as SFTTrainer` after that line (docs/HF_TRAINER.md, "
                    f"TRL), or unset {CONFIG_ENV}")
        elif getattr(args, "sync_ref_model", False) and inside(engine).spec.gathers_per_unit:
            raise ValueError(
                "a TRL trainer mixed with ZeroTrainer by hand (`class T(ZeroTrainer, DPOTrainer)`) syncs the reference "
                "model with TRL's SyncRefModelCallback, which reads the policy's param.data that ZeRO stage 3 leaves "
                "empty between forwards: use zerodp.integrations.trl's ZeroDPOTrainer (or `class T(ZeroTRLMixin, "
                "DPOTrainer)`), which syncs on the gathered weights")


if RouteCheck not in transformers.trainer.DEFAULT_CALLBACKS:
    transformers.trainer.DEFAULT_CALLBACKS.append(RouteCheck)


class GatheredSyncRefModel(SyncRefModelCallback):
    """TRL's `sync_ref_model` (ref <- (1 - alpha) ref + alpha policy every ref_model_sync_steps) on the policy's
    whole weights, gathered on every rank, into the reference's (whole below stage 3, its shards at stage 3)."""

    def __init__(self, trainer: ZeroTRLMixin) -> None:
        super().__init__(ref_model=trainer.ref_model, accelerator=None)
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step % args.ref_model_sync_steps:
            return
        with self.trainer.whole_policy() as policy, _writable(self.trainer.ref_model) as ref:
            self._sync_target_model(policy, ref, args.ref_model_mixup_alpha)


@contextmanager
def _writable(ref: nn.Module | ShardedModule) -> Iterator[nn.Module]:
    """The reference module with whole parameters to write into: a sharded reference gathers them, and every
    rank computes the same mix, so rank 0's result is what each rank's shard keeps (collective)."""
    if not isinstance(ref, ShardedModule):
        yield ref
        return
    with torch.no_grad(), ref.gathered_parameters(modifier_rank=0):
        yield ref.module


def reference_model(model: nn.Module, policy: Engine, args: transformers.TrainingArguments
                    ) -> nn.Module | ShardedModule:
    """The frozen reference model as the trainer keeps it. Where the policy's parameters are sharded, a sharded
    module over the policy's ranks (1/N of it per rank, gathered per unit in its forward, as TRL's
    prepare_deepspeed does under DeepSpeed ZeRO-3), with the policy's config for a model that trains nothing
    (Config.for_frozen_model); otherwise whole on every rank (placed by Accelerate), as the policy's weights are."""
    parts = inside(policy)
    if not parts.spec.gathers_per_unit:
        return model
    count = sum(p.numel() for p in model.parameters())
    model.requires_grad_(False)
    ref = shard(model, policy.config.for_frozen_model(), process_group=parts.comm.group)
    if args.process_index == 0:
        _trainer_log.info("zerodp: the reference model (%d parameters) is a sharded module over %d ranks at ZeRO "
                          "stage 3", count, parts.comm.world_size)
    return ref


class ZeroSFTTrainer(ZeroTRLMixin, SFTTrainer):
    """TRL's SFTTrainer with zerodp doing the data parallelism (`zero_config=` or ZERODP_CONFIG)."""


class ZeroDPOTrainer(ZeroTRLMixin, DPOTrainer):
    """TRL's DPOTrainer with zerodp doing the data parallelism; at stage 3 the reference model is sharded too."""


class ZeroGRPOTrainer(ZeroTRLMixin, GRPOTrainer):
    """TRL's GRPOTrainer with zerodp doing the data parallelism; generation (transformers', no vLLM) on the
    policy's gathered weights."""
