"""A finished ZeRO-2 job that ends as many scripts end: destroy_process_group(), then exit (tests/exits.py
runs it as the ranks of many jobs)."""

import torch
import torch.distributed as dist

import zerodp

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine = zerodp.initialize(model, optimizer, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
for step in range(3):
    loss = engine(torch.randn(2, 8)).square().mean()
    engine.backward(loss)
    engine.step()
print(f"rank {engine.global_rank}: {engine.global_steps} steps, loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
