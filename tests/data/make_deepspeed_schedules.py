"""Run with DeepSpeed installed: python tests/data/make_deepspeed_schedules.py tests/data/deepspeed_schedules.json

Reference lrs from DeepSpeed's own schedulers, emulating its engine: read the optimizer's lr (and
Adam betas), take the optimizer step, then scheduler.step() -- DeepSpeed's _take_model_step order."""
import json, logging, sys
import torch
from deepspeed.runtime import lr_schedules as L
logging.disable(logging.WARNING)

CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10}, "SGD", 14),
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}, "SGD", 7),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.3, "warmup_num_steps": 1, "warmup_type": "log"}, "SGD", 4),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 0.0, "warmup_max_lr": 0.4, "warmup_num_steps": 4,
                       "warmup_type": "linear"}, "SGD", 15),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 6},
     "SGD", 23),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear", "cos_min_ratio": 0.1},
     "SGD", 24),
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_min_ratio": 0.2, "warmup_num_steps": 4}, "SGD", 18),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0},
     "SGD", 10),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 0.5,
                     "lr_range_test_staircase": True}, "SGD", 9),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4, "cycle_momentum": False},
     "SGD", 12),
    ("OneCycle", {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 3, "cycle_second_step_size": 5,
                  "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
                  "decay_mom_rate": 0.01}, "AdamW", 14),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "cycle_first_step_size": 6, "cycle_second_step_size": 4,
                  "cycle_first_stair_count": 3, "cycle_second_stair_count": 2}, "AdamW", 12),
]

out = []
for name, params, opt_name, steps in CASES:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.2) if opt_name == "SGD" else torch.optim.AdamW([p], lr=0.2)
    sched = getattr(L, name)(opt, **params)
    lrs, betas = [], []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        if "betas" in opt.param_groups[0]:
            betas.append(list(opt.param_groups[0]["betas"]))
        p.grad = torch.zeros(2)
        opt.step()
        sched.step()
    out.append({"type": name, "params": params, "optimizer": opt_name, "optimizer_lr": 0.2, "lrs": lrs,
                "betas": betas if name == "OneCycle" and opt_name == "AdamW" else None})
import deepspeed
with open(sys.argv[1], "w") as f:
    json.dump({"made_by": f"tests/data/make_deepspeed_schedules.py with DeepSpeed {deepspeed.__version__}, "
                          f"torch {torch.__version__}", "cases": out}, f, indent=1)
