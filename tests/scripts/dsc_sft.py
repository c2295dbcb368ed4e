"""DeepSpeed-Chat's step-1 supervised fine-tuning script (applications/DeepSpeed-Chat/training/
step1_supervised_finetuning/main.py) in miniature, written for DeepSpeed as that script is.

The test ports it by replacing `deepspeed` with `zerodp.deepspeed` in its import lines and nothing else.
What it uses, as DeepSpeed-Chat does: `--local_rank` (default -1) read right after parse_args, and
deepspeed.init_distributed() only when it is not -1; `from deepspeed import get_accelerator`;
dschat's get_train_ds_config (a `hybrid_engine` section, disabled; `offload_param` beside
`offload_optimizer`, at stage 2 too); `DeepSpeedCPUAdam if offload else FusedAdam` on two param
groups; LoRA put in with `deepspeed.compression.helper`'s recursive_getattr / recursive_setattr; an
lr scheduler object; evaluation in eval mode; `tput_timer.update_epoch_count()` after each epoch.
A small MLP on random regression data stands in for the language model.
"""

import argparse
import math

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed import get_accelerator
from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from zerodp.engine.engine import inside  # (the probe below reads zerodp's parts)

D_IN, HIDDEN, D_OUT = 12, 24, 3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Finetune a model")
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1, help="local_rank for distributed training on gpus")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", type=str, default="fp32")
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--lora_dim", type=int, default=4)
    parser.add_argument("--lora_module_name", type=str, default="blocks.")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def get_train_ds_config(offload, dtype, stage=2, enable_hybrid_engine=False, inference_tp_size=1,
                        release_inference_cache=False, pin_parameters=True, tp_gather_partition_size=8,
                        max_out_tokens=512):
    """dschat/utils/ds_utils.py's, less tensorboard; "fp32" (fp16 disabled) is this test's addition, for an
    exact comparison (DeepSpeed-Chat writes fp16 or bf16)."""
    device = "cpu" if offload else "none"
    if dtype == "bf16":
        data_type, dtype_config = "bfloat16", {"enabled": True}
    else:
        data_type, dtype_config = "fp16", {"enabled": dtype == "fp16", "loss_scale_window": 100}
    zero_opt_dict = {
        "stage": stage, "overlap_comm": True, "offload_param": {"device": device},
        "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False,
    }
    return {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": zero_opt_dict, data_type: dtype_config, "gradient_clipping": 1.0,
        "prescale_gradients": False, "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": enable_hybrid_engine, "max_out_tokens": max_out_tokens,
                          "inference_tp_size": inference_tp_size, "release_inference_cache": release_inference_cache,
                          "pin_parameters": pin_parameters, "tp_gather_partition_size": tp_gather_partition_size},
    }


class LinearLayer_LoRA(nn.Module):
    """dschat/utils/module/lora.py's: the linear layer plus a scaled low-rank update."""

    def __init__(self, weight, lora_dim=0, lora_scaling=1, bias=None):
        super().__init__()
        self.weight, self.bias = weight, bias
        rows, columns = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim))
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows))
        self.lora_scaling = lora_scaling / lora_dim
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def convert_linear_layer_to_lora(model, part_module_name, lora_dim=0, lora_scaling=1):
    replace_name = [name for name, module in model.named_modules()
                    if isinstance(module, nn.Linear) and part_module_name in name]
    for name in replace_name:
        module = recursive_getattr(model, name)
        tmp = LinearLayer_LoRA(module.weight, lora_dim, lora_scaling, module.bias)
        recursive_setattr(model, name, tmp)
    return model


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x, y):
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return F.mse_loss(self.head(self.norm(h)), y)


def build_model(args):
    torch.manual_seed(args.seed)
    model = Model()
    return convert_linear_layer_to_lora(model, args.lora_module_name, args.lora_dim) if args.lora_dim > 0 else model


def get_optimizer_grouped_parameters(model, weight_decay, no_decay_name_list=("bias", "norm.weight")):
    decay = [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay_name_list) and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay_name_list) and p.requires_grad]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def datasets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, D_IN, generator=g)
    y = torch.randn(80, D_OUT, generator=g)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


def warmup_linear(optimizer, warmup, total):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (total - s) / max(1, total - warmup)))


def main(argv=None):
    args = parse_args(argv)
    seen_local_rank = args.local_rank
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (args.per_device_train_batch_size * torch.distributed.get_world_size()
                                     * args.gradient_accumulation_steps)
    torch.distributed.barrier()

    model = build_model(args)
    train_dataset, eval_dataset = datasets()
    train_dataloader = DataLoader(train_dataset, sampler=DistributedSampler(train_dataset),
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, sampler=DistributedSampler(eval_dataset, shuffle=False),
                                 batch_size=args.per_device_train_batch_size)

    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(get_optimizer_grouped_parameters(model, args.weight_decay),
                              lr=args.learning_rate, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = warmup_linear(optimizer, 2, args.num_train_epochs * steps_per_epoch)

    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)

    def evaluation(model, eval_dataloader):
        model.eval()
        losses = 0
        for step, (x, y) in enumerate(eval_dataloader):
            with torch.no_grad():
                losses += model(x.to(device), y.to(device)).float()
        losses = losses / (step + 1)
        torch.distributed.all_reduce(losses)
        return (losses / torch.distributed.get_world_size()).item()

    losses = []
    for epoch in range(args.num_train_epochs):
        model.train()
        train_dataloader.sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(train_dataloader):
            loss = model(x.to(device), y.to(device))
            model.backward(loss)
            model.step()
            losses.append(loss.item())
        eval_loss = evaluation(model, eval_dataloader)
        model.tput_timer.update_epoch_count()
    return {"seen_local_rank": seen_local_rank, "local_rank_after": args.local_rank, "losses": losses,
            "eval_loss": eval_loss, "weights": {n: p.detach().clone() for n, p in model.module.named_parameters()},
            "optimizer": type(optimizer).__name__, "fused": optimizer.defaults["fused"],
            "masters_not_model": not ({id(p) for g in optimizer.param_groups for p in g["params"]}
                                      & {id(p) for p in model.module.parameters()}),
            "offload_param": inside(model.engine).spec.offload_param,
            "offload_optimizer": inside(model.engine).training.partitioned_optimizer.offload,
            "epochs": model.tput_timer.epoch_count, "timed_steps": model.tput_timer.global_step_count,
            "samples_per_sec": model.tput_timer.avg_samples_per_sec()}


if __name__ == "__main__":
    main()
