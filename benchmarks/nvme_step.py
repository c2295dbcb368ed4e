"""The disk tier against host-RAM offload and no offload, in one run (issue 42; benchmarks/RESULTS.md):

  1. this disk's raw O_DIRECT bandwidth: one stream of 1 MiB requests writing, then reading, a file of
     the states' size under DIR (the physical limit a step with states on disk can approach);
  2. for each of "none", "cpu", "nvme" and "nvme-serial" (nvme without pipeline_read/write; each in a fresh process, so that its RSS is its own): a stack
     of LAYERS Linear(H, H) layers at stage 2 on one rank, AdamW, STEPS steps; per step the time of
     forward + backward (compute) and of engine.step(); the RSS before initialize, after it and after the
     steps; with "nvme", the bytes the step moves (the file read and written once) over the step's time.

    python benchmarks/nvme_step.py DIR [LAYERS] [H] [STEPS]   # writes benchmarks/results/nvme_step.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

MIB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def raw_bandwidth(root: str, nbytes: int) -> dict[str, float]:
    """Bytes per second of one O_DIRECT stream of 1 MiB requests, writing then reading nbytes."""
    from zerodp.engine.stepping.disk import aligned_bytes
    buf = aligned_bytes(MIB)
    buf.copy_(torch.randint(0, 255, (MIB,), dtype=torch.uint8))
    view = memoryview(buf.numpy())
    path = os.path.join(root, "zerodp-raw-bandwidth.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    os.unlink(path)
    try:
        out = {}
        for kind, call in (("write", os.pwritev), ("read", os.preadv)):
            start = time.perf_counter()
            for offset in range(0, nbytes, MIB):
                call(fd, [view], offset)
            if kind == "write":
                os.fsync(fd)
            out[kind] = nbytes / (time.perf_counter() - start)
        return out
    finally:
        os.close(fd)


def child(mode: str, root: str, layers: int, h: int, steps: int) -> dict:
    import zerodp
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    before = rss()
    model = torch.nn.Sequential(*[torch.nn.Linear(h, h) for _ in range(layers)])
    per_layer = h * h + h
    offload = {"none": None, "cpu": {"device": "cpu"},
               "nvme": {"device": "nvme", "nvme_path": root, "pipeline_read": True, "pipeline_write": True,
                        "buffer_count": 12, "fast_init": True},
               # the same without the pipeline: each transfer waited for before the next step
               "nvme-serial": {"device": "nvme", "nvme_path": root, "buffer_count": 4, "fast_init": True}}[mode]
    # Two layers per bucket and per sub-group: the pool is 12 buffers of two layers' shard.
    cfg = {"train_micro_batch_size_per_gpu": 4, "aio": {"thread_count": 2, "queue_depth": 4},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 2 * per_layer, "sub_group_size": 2 * per_layer,
                                 **({"offload_optimizer": offload} if offload else {})}}
    engine = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg)
    after_init = rss()
    compute, step = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.backward(engine(torch.randn(4, h)).square().mean())
        middle = time.perf_counter()
        engine.step()
        compute.append(middle - start)
        step.append(time.perf_counter() - middle)
    report = engine.memory_report()
    out = {"mode": mode, "params": layers * per_layer, "rss_before": before, "rss_after_init": after_init,
           "rss_after_steps": rss(), "compute_s": compute, "step_s": step, "memory_report": report}
    if mode.startswith("nvme"):
        moved = 2 * report["nvme_file"]  # each step reads the file and writes it back
        out["disk_bytes_per_step"] = moved
        out["step_disk_bandwidth"] = moved / statistics.median(step[1:] or step)
    return out


def main(root: str, layers: int, h: int, steps: int) -> None:
    states = layers * (h * h + h) * 12  # fp32 master + AdamW's two moments
    raw = raw_bandwidth(root, states // MIB * MIB)
    runs = []
    for mode in ("none", "cpu", "nvme", "nvme-serial"):
        done = subprocess.run([sys.executable, __file__, "--child", mode, root, str(layers), str(h), str(steps)],
                              capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = {"torch": torch.__version__, "cpus": os.cpu_count(), "states_bytes": states, "raw_bandwidth": raw,
              "runs": runs, "left_in_dir": os.listdir(root)}
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "nvme_step.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


def table(result: dict) -> str:
    raw = result["raw_bandwidth"]
    lines = [f"states {result['states_bytes'] / 2**30:.2f} GiB per rank; raw O_DIRECT write "
             f"{raw['write'] / 1e9:.2f} GB/s, read {raw['read'] / 1e9:.2f} GB/s; medians after the first step", "",
             "| offload | forward+backward s | step s | RSS growth, initialize | RSS growth, +steps | "
             "host_model_states | disk bytes/step | step's disk GB/s |", "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        med = lambda xs: statistics.median(xs[1:] or xs)  # noqa: E731
        host = r["memory_report"].get("host_model_states", 0)
        disk = r.get("disk_bytes_per_step")
        moved = "" if disk is None else f"{disk / 2**30:.2f} GiB"
        speed = "" if disk is None else f"{r['step_disk_bandwidth'] / 1e9:.2f}"
        lines.append(f"| {r['mode']} | {med(r['compute_s']):.2f} | {med(r['step_s']):.2f} | "
                     f"{(r['rss_after_init'] - r['rss_before']) / MIB:,.0f} MiB | "
                     f"{(r['rss_after_steps'] - r['rss_before']) / MIB:,.0f} MiB | {host / MIB:,.0f} MiB | "
                     f"{moved} | {speed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))))
    else:
        main(sys.argv[1], *map(int, sys.argv[2:5]))
