"""A DeepSpeedExamples-style CIFAR classifier (training/cifar/cifar10_deepspeed.py), written for DeepSpeed.

Its import lines are DeepSpeed's: the test ports it by replacing `deepspeed` with `zerodp.deepspeed` in
them and nothing else. It uses what such scripts use beside `deepspeed.initialize`: the accelerator
(device names, backend, bf16 support, seeds), `deepspeed.comm` (rank, world size, barrier,
all_reduce), `deepspeed.utils.logger` and the engine's rank properties. Random images stand in for CIFAR.
"""

import argparse

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger
from torch.utils.data import TensorDataset


def add_argument(argv=None):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", default=1, type=int)
    parser.add_argument("--log-interval", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 3 * 3, 24)
        self.fc2 = nn.Linear(24, 4)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def trainset():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 8, 8, generator=g)
    return TensorDataset(images, torch.randint(0, 4, (64,), generator=g))


def main(argv=None):
    args = add_argument(argv)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    get_accelerator().manual_seed(42)
    torch.manual_seed(42)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset())
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, (inputs, labels) in enumerate(trainloader):
            inputs, labels = inputs.to(local_device), labels.to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            loss = criterion(model_engine(inputs), labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            if local_rank == 0 and i % args.log_interval == args.log_interval - 1:
                logger.info(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {loss.item():.3f}")
    # Every rank's last loss, summed: the scripts' way of reporting one number for the job.
    total = torch.tensor([losses[-1]], device=local_device)
    dist.all_reduce(total)
    dist.barrier()
    get_accelerator().synchronize()
    return {"losses": losses, "mean_last": total.item() / dist.get_world_size(), "rank": dist.get_rank(),
            "global_rank": model_engine.global_rank, "world_size": model_engine.world_size,
            "device": local_device, "backend": get_accelerator().communication_backend_name()}


if __name__ == "__main__":
    main()
