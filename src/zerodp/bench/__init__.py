"""`zerodp bench`: one GPT and one batch under every data-parallel mode, side by side.

Each mode runs in its own fresh process (torchrun for more than one rank), so no mode inherits
another's allocator state, compiled kernels or process group:
  plain            plain PyTorch: fp32 parameters, bf16 autocast (CUDA), fused AdamW
  ddp              DistributedDataParallel around the same
  fsdp2            torch.distributed.fsdp.fully_shard per block and root, bf16 params / fp32 reduce
  fsdp2-noreshard  the same with reshard_after_forward=False (ZeRO-2-like: no regather in backward)
  zerodp0/1/2/3    zerodp stages 0-3: bf16 working parameters, fp32 master (CUDA)
  deepspeed2       DeepSpeed ZeRO-2 with the same torch AdamW, when `import deepspeed` works
  zerodp2-offload  zerodp stage 2 with offload_optimizer cpu and torch.optim.AdamW as built by default
  deepspeed2-offload  DeepSpeed ZeRO-Offload (stage 2, DeepSpeedCPUAdam), when `import deepspeed` works
Every mode reports tokens/s, TFLOP/s per device (flops_per_token = 6N + 12·L·d·T), MFU against the
device's dense bf16 peak, CUDA peak allocated / reserved memory, and its TFLOP/s ratio to `plain`
measured in the same invocation; zerodp2 and zerodp2-offload also their step time over their DeepSpeed
counterpart's from the same invocation. The modes run in rounds (A B C, A B C, ...; --repeats, default 5):
each mode's median and min-max, its ratio to DDP and to FSDP2 round by round, and for each zerodp mode
whether it can be told apart from those two at the spread measured. `--fake-world N` adds a memory-only
run of zerodp stage 2 and FSDP2 acting as rank 0 of N ranks on the fake process group (collectives send
nothing).

Its modules (worker.py, then spread.py and driver.py, the three to read first):
  worker.py   one mode in this process: build it, time it, return its row (Result)
  spread.py   from the repeats: each mode's spread, its ratios round by round, which modes can be told apart
  driver.py   `zerodp bench` (main): one fresh process per mode, rounds of repeats, ratios, the table, --json
  rows.py     the modes and one mode's row (Result), torch-free: read before torch loads
  overhead.py the engine's own host work per step, with many small parameters
  __main__.py `python -m zerodp.bench`, how the driver starts each worker
"""

from zerodp.lazy import lazy_names

# zerodp.bench's public names, the driver's and the worker's; each is imported on first use (PEP 562),
# so that `zerodp bench --help` answers before torch loads.
_DRIVER = ("add_ratios", "device_name", "launch", "main", "median_result", "modes_to_run", "owned_total", "parser",
           "print_table", "source_commit")
_WORKER = ("FAKE_MODES", "GIB", "MODES", "PEAK_TFLOPS", "Result", "build_model", "checkpoint_blocks", "engine_bytes",
           "flops_per_token", "run_worker", "setup_mode")
__all__ = sorted(_DRIVER + _WORKER)


__getattr__ = lazy_names(__name__, {**dict.fromkeys(_DRIVER, "driver"), **dict.fromkeys(_WORKER, "worker")})
