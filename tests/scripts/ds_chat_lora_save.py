"""A LoRA fine-tuning script written as DeepSpeed-Chat's are (applications/DeepSpeed-Chat/dschat/utils:
module/lora.py's LinearLayer_LoRA and convert_lora_to_linear_layer, utils.py's save_zero_three_model
and _z3_params_to_fetch): a tiny language model whose linear layers get LoRA branches, trained a few
steps, then saved twice: `torch.save(model.state_dict())` with every rank calling state_dict() (the
plain torch way), and after merging the LoRA branches (inside GatheredParameters(..., modifier_rank=0))
by save_zero_three_model, which at stage 3 gathers only the parameters carrying `ds_id` whose
`ds_status` is NOT_AVAILABLE and keeps `v.data.cpu()` of each.

With --step1_save it ends as DeepSpeed-Chat's step 1 (training/step1_supervised_finetuning/main.py) does,
with --only_optimize_lora as its flag of that name: the LoRA branches alone train (the base is frozen, so
stage 3 partitions it frozen), the branches are merged, rank 0 ALONE writes `save_hf_format`'s
`model.state_dict()` (DeepSpeed returns placeholders there at stage 3), and at stage 3 every rank then
runs save_zero_three_model, which overwrites that file with the gathered weights.

Its import lines are DeepSpeed's; the test replaces `deepspeed` with `zerodp.deepspeed` in them and
nothing else.
"""

import argparse
import math
import os

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn

VOCAB, SEQ, WIDTH = 64, 8, 64


class LinearLayer_LoRA(nn.Module):
    # an simple implementation of LoRA (DeepSpeed-Chat's, unchanged but for the dropout)
    def __init__(self, weight, lora_dim=0, lora_scaling=1, bias=None):
        super(LinearLayer_LoRA, self).__init__()
        self.weight = weight
        self.bias = bias
        try:
            # for zero stage 3
            rows, columns = weight.ds_shape
        except:  # noqa: E722
            rows, columns = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim))  # apply transpose so in forward we do not need to
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows))
        self.lora_scaling = lora_scaling / lora_dim
        self.reset_parameters()
        self.fuse_lora = False

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_left_weight)

    def fuse_lora_weight(self):
        if not self.fuse_lora:
            self.weight.data += self.lora_scaling * torch.matmul(self.lora_left_weight.t(),
                                                                 self.lora_right_weight.t())
        self.fuse_lora = True

    def forward(self, input):
        if self.fuse_lora:
            return F.linear(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias) + (
            input @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def recursive_getattr(model, module_name):
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name, module):
    split_list = module_name.split(".")
    output = model
    for name in split_list[:-1]:
        output = getattr(output, name)
    output.__setattr__(split_list[-1], module)


def convert_linear_layer_to_lora(model, part_module_name, lora_dim=0, lora_scaling=1):
    replace_name = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and part_module_name in name:
            replace_name.append(name)
    for name in replace_name:
        module = recursive_getattr(model, name)
        tmp = LinearLayer_LoRA(module.weight, lora_dim, lora_scaling, module.bias).to(module.weight.device).to(
            module.weight.dtype)
        recursive_setattr(model, name, tmp)
    return model


def only_optimize_lora_parameters(model, force_optimize_params=[]):
    # turn off the gradient of all the parameters except the LoRA parameters
    for name, param in model.named_parameters():
        if "lora_right_weight" in name or "lora_left_weight" in name or name in force_optimize_params:
            param.requires_grad = True
        else:
            param.requires_grad = False
    return model


def save_hf_format(model, tokenizer, args, sub_folder=""):
    # used to save huggingface format, so we can use it for hf.from_pretrained (no config or tokenizer here)
    model_to_save = model.module if hasattr(model, 'module') else model
    WEIGHTS_NAME = "pytorch_model.bin"
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    output_model_file = os.path.join(output_dir, WEIGHTS_NAME)
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, output_model_file)


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, 'ds_id') and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def convert_lora_to_linear_layer(model):
    replace_name = []
    for name, module in model.named_modules():
        if isinstance(module, LinearLayer_LoRA):
            replace_name.append(name)
    for name in replace_name:
        module = recursive_getattr(model, name)
        zero_stage_3 = hasattr(module.weight, 'ds_id')
        with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([
                module.weight, module.bias, module.lora_left_weight, module.lora_right_weight
        ]), modifier_rank=0, enabled=zero_stage_3):
            module.fuse_lora_weight()
    return model


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = (zero_stage == 3)
    os.makedirs(save_dir, exist_ok=True)
    WEIGHTS_NAME = "pytorch_model.bin"
    output_model_file = os.path.join(save_dir, WEIGHTS_NAME)

    model_to_save = model_ema.module if hasattr(model_ema, 'module') else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, 'ds_id'):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 2 * width)
        self.fc_out = nn.Linear(2 * width, width)

    def forward(self, h):
        return h + self.fc_out(F.gelu(self.fc_in(self.norm(h))))


class TinyLM(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only_optimize_lora", action="store_true")
    parser.add_argument("--step1_save", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)

    deepspeed.init_distributed()
    global_rank = torch.distributed.get_rank()
    torch.manual_seed(1234)
    model = convert_linear_layer_to_lora(TinyLM(), "blocks.", lora_dim=4)
    if args.only_optimize_lora:
        model = only_optimize_lora_parameters(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)

    data = torch.Generator().manual_seed(global_rank)
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), SEQ + 1), generator=data)
        logits = engine(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()

    if args.step1_save:  # DeepSpeed-Chat step 1's end
        model = convert_lora_to_linear_layer(model)
        if global_rank == 0:
            save_hf_format(model, None, args)
        if args.zero_stage == 3:
            # For zero stage 3, each gpu only has a part of the model, so we need a special save function
            save_zero_three_model(model, global_rank, args.output_dir, zero_stage=args.zero_stage)
        return engine

    state = model.state_dict()  # every rank: with LoRA branches, before the merge
    if global_rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(state, os.path.join(args.output_dir, "with_lora.pt"))
    del state
    model = convert_lora_to_linear_layer(model)
    save_zero_three_model(model, global_rank, args.output_dir, zero_stage=args.zero_stage)
    return engine
