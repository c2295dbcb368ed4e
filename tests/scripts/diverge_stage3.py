"""The issue's script (issue 35): the script creates its own process group, then stage 3 with comm_timeout_s;
in eval, rank 0 runs 3 forwards and rank 1 runs 2, then either waits in a dist.barrier() of its own
("barrier") or works on ("work": until the file STOP appears, at most 60 s).

    python diverge_stage3.py barrier|work STOP      (as one rank of 2: torchrun's environment)

Rank 0 prints "waiting since T" (time.time()) before the forward no other rank runs."""

import atexit
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import zerodp

mode, stop = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")  # the script's own group: gloo's default timeout, 30 minutes
rank = dist.get_rank()
atexit.register(lambda: print(f"exit hooks at {time.time()}", flush=True))  # before zerodp's: runs after it
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)))
engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
    "train_micro_batch_size_per_gpu": 2, "comm_timeout_s": 10,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
engine.eval()
x = torch.randn(2, 16)
with torch.no_grad():
    for i in range(3 if rank == 0 else 2):
        if i == 2:
            print(f"waiting since {time.time()}", flush=True)
        engine(x)
if mode == "barrier":
    dist.barrier()
else:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not os.path.exists(stop):
        time.sleep(0.1)  # the script's own work
print(f"rank {rank}: done", flush=True)
dist.destroy_process_group()
