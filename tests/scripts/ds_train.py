"""A DeepSpeed ZeRO training script of DeepSpeedExamples' kind (training/cifar's cifar10_deepspeed.py:
add_config_arguments, initialize with args + model_parameters + training_data, the engine loop,
save_checkpoint / load_checkpoint), with the `deepspeed` module as a parameter so that the very same
code runs on `zerodp.deepspeed` (and, outside CI, on DeepSpeed itself).

`zerodp_main` is that script written for zerodp's own API, for the acceptance test to compare with.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 12, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long())


def param_groups(net: nn.Module) -> list[dict]:
    """No weight decay on biases and norms, as the examples' get_optimizer_grouped_parameters."""
    decay = [p for n, p in net.named_parameters() if p.dim() > 1]
    rest = [p for n, p in net.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def main(deepspeed, argv: list[str], save_dir: str) -> list[float]:
    parser = argparse.ArgumentParser(description="toy")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    deepspeed.init_distributed()
    torch.manual_seed(1)
    net = Net()
    engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=param_groups(net), training_data=dataset())
    losses = []
    for epoch in range(EPOCHS):
        trainloader.sampler.set_epoch(epoch)
        for inputs, labels in trainloader:
            loss = F.cross_entropy(engine(inputs.to(engine.device)), labels.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    engine.save_checkpoint(save_dir, client_state={"epoch": epoch})
    _, client_state = engine.load_checkpoint(save_dir)
    assert client_state["epoch"] == EPOCHS - 1
    return losses + [engine.global_steps, engine.get_lr()[0]]


def zerodp_main(config: dict) -> list[float]:
    import zerodp

    torch.manual_seed(1)
    net = Net()
    config = {k: v for k, v in config.items() if k != "optimizer"}
    opt = torch.optim.AdamW(param_groups(net), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    engine = zerodp.initialize(net, opt, config)
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=engine.world_size, rank=engine.global_rank)
    loader = DataLoader(data, batch_size=config["train_micro_batch_size_per_gpu"], sampler=sampler)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            loss = F.cross_entropy(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses + [engine.global_steps, engine.get_lr()[0]]
