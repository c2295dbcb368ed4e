"""The disk tier against host-RAM offload and no offload, in one run (issue 42; benchmarks/RESULTS.md):

  1. this disk's raw O_DIRECT bandwidth: 1 MiB requests writing, then reading, a file of one rank's states
     under DIR, from one stream and from WORLD streams at once (one per rank: what WORLD ranks' tiers share);
     the physical limit a step with states on disk can approach;
  2. for each of "none", "cpu", "nvme" and "nvme-serial" (nvme without pipeline_read/write), WORLD fresh
     processes (one per rank, gloo; the RSS of each is its own): a stack of LAYERS Linear(H, H) layers at
     stage 2, AdamW, STEPS steps; per step the time of forward + backward (compute), of engine.step(), of
     the gather of the new weights that ends it and, with nvme, of the tier's stream (read, step, write of
     every sub-group) and of its waits for the disk;
     each rank's RSS before the model is built, after initialize, after the steps, and its peak; with nvme,
     the bytes the stream moves (the file read and written once) over the stream's time.

    python benchmarks/nvme_step.py DIR [LAYERS] [H] [STEPS] [WORLD]   # writes benchmarks/results/nvme_step-nWORLD.json
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

MIB = 1 << 20
MODES = ("none", "cpu", "nvme", "nvme-serial")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def raw_bandwidth(root: str, nbytes: int, streams: int) -> dict[str, float]:
    """Bytes per second of `streams` O_DIRECT streams at once (threads; os.preadv/pwritev release the GIL),
    each of 1 MiB requests writing, then reading, nbytes of a file of its own: all streams' bytes over the
    time from the first start to the last end."""
    from zerodp.engine.stepping.disk import aligned_bytes
    fds, views = [], []
    for i in range(streams):
        buf = aligned_bytes(MIB)
        buf.copy_(torch.randint(0, 255, (MIB,), dtype=torch.uint8))
        views.append(memoryview(buf.numpy()))
        path = os.path.join(root, f"zerodp-raw-bandwidth-{i}.bin")
        fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600))
        os.unlink(path)
        os.posix_fallocate(fds[-1], 0, nbytes)  # as the tier's file: blocks reserved, not yet written

    def one(kind: str, i: int) -> None:
        call = os.pwritev if kind == "write" else os.preadv
        for offset in range(0, nbytes, MIB):
            call(fds[i], [views[i]], offset)
        if kind == "write":
            os.fsync(fds[i])

    try:
        out = {}
        with ThreadPoolExecutor(streams) as pool:
            for kind in ("write", "read"):
                start = time.perf_counter()
                list(pool.map(lambda i: one(kind, i), range(streams)))
                out[kind] = streams * nbytes / (time.perf_counter() - start)
        return out
    finally:
        for fd in fds:
            os.close(fd)


def _timed_tier(times: dict[str, list[float]]) -> None:
    """Record each step's DiskTier.stream time, the part of it spent waiting for the disk (_finish), and the
    time of the gather of the new weights after it (PartitionedOptimizer.all_gather): the rest of the step."""
    from zerodp.engine.stepping import disk, optimizer
    stream, finish, gather = disk.DiskTier.stream, disk.DiskTier._finish, optimizer.PartitionedOptimizer.all_gather

    def timed(name: str, call):
        def run(*args, **kwargs):
            start = time.perf_counter()
            call(*args, **kwargs)
            times[name][-1] += time.perf_counter() - start
        return run

    def timed_stream(*args, **kwargs):
        times["disk_wait_s"].append(0.0)
        times["stream_s"].append(0.0)
        timed("stream_s", stream)(*args, **kwargs)

    def timed_gather(*args, **kwargs):
        times["gather_s"].append(0.0)
        timed("gather_s", gather)(*args, **kwargs)

    disk.DiskTier.stream, optimizer.PartitionedOptimizer.all_gather = timed_stream, timed_gather
    disk.DiskTier._finish = lambda *a, **k: (timed("disk_wait_s", finish) if times["disk_wait_s"] else finish)(*a, **k)


def offload_of(mode: str, root: str) -> dict | None:
    return {"none": None, "cpu": {"device": "cpu"},
            "nvme": {"device": "nvme", "nvme_path": root, "pipeline_read": True, "pipeline_write": True,
                     "buffer_count": 12, "fast_init": True},
            # the same without the pipeline: each transfer waited for before the next sub-group steps
            "nvme-serial": {"device": "nvme", "nvme_path": root, "buffer_count": 4, "fast_init": True}}[mode]


def child(mode: str, root: str, layers: int, h: int, steps: int) -> dict:
    import zerodp
    from zerodp.engine.engine import inside
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("WORLD_SIZE", "1"))))
    times = {"stream_s": [], "disk_wait_s": [], "gather_s": []}
    _timed_tier(times)
    before = rss()
    model = torch.nn.Sequential(*[torch.nn.Linear(h, h) for _ in range(layers)])
    per_layer = h * h + h
    offload = offload_of(mode, root)
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
    out = {"mode": mode, "rank": engine.global_rank, "params": layers * per_layer, "rss_before": before,
           "rss_after_init": after_init, "rss_after_steps": rss(), "rss_peak": peak_rss(), "compute_s": compute,
           "step_s": step, "gather_s": times["gather_s"][-steps:], "memory_report": report}
    if mode.startswith("nvme"):
        out["disk_bytes_per_step"] = 2 * report["nvme_file"]  # each step reads the file and writes it back
        out["stream_s"], out["disk_wait_s"] = times["stream_s"], times["disk_wait_s"]
        slot = inside(engine).training.partitioned_optimizer.disk.slots[0]
        out["sub_group_buffer_bytes"] = slot.states.numel() + slot.grads.numel()  # one sub-group's in the pool
    return out


def launch(mode: str, root: str, layers: int, h: int, steps: int, world: int) -> list[dict]:
    """`world` ranks of `child`, each in a fresh process, rendezvous by TCP on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, root, str(layers), str(h), str(steps)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    for r, p in enumerate(procs):
        if p.returncode:
            raise RuntimeError(f"{mode} rank {r} exited with {p.returncode}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def load_average() -> list[float]:
    return list(os.getloadavg())


def main(root: str, layers: int, h: int, steps: int, world: int) -> None:
    states = layers * (h * h + h) * 12 // world  # one rank's fp32 master + AdamW's two moments
    span = max(MIB, states // MIB * MIB)
    raw = {"1": raw_bandwidth(root, span, 1)}
    if world > 1:
        raw[str(world)] = raw_bandwidth(root, span, world)
    runs, loads = [], [load_average()]
    for mode in MODES:
        runs.append(launch(mode, root, layers, h, steps, world))
        loads.append(load_average())
    result = {"torch": torch.__version__, "cpus": os.cpu_count(), "world": world, "layers": layers, "h": h,
              "steps": steps, "states_bytes_per_rank": states, "raw_bandwidth": raw, "runs": runs,
              "load_average": loads, "left_in_dir": os.listdir(root)}
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", f"nvme_step-n{world}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


def med(xs: list[float]) -> float:
    """The median after the first step (which allocates and, with nvme, writes every state for the first time)."""
    return statistics.median(xs[1:] or xs)


def mixed(rates: dict[str, float]) -> float:
    """Equal bytes read and written, one after the other, at these rates."""
    return 2 / (1 / rates["read"] + 1 / rates["write"])


def table(result: dict) -> str:
    world, raw = result["world"], result["raw_bandwidth"]
    shared = raw[str(world)]
    lines = [f"{world} rank(s), states {result['states_bytes_per_rank'] / 2**30:.2f} GiB per rank; raw O_DIRECT "
             + "; ".join(f"{n} stream(s): write {r['write'] / 1e9:.2f}, read {r['read'] / 1e9:.2f} GB/s "
                         f"(mixed {mixed(r) / 1e9:.2f})" for n, r in raw.items())
             + f"; load average {', '.join(f'{a[0]:.1f}' for a in result['load_average'])} (1 min, after each "
             "phase); medians after the first step", "",
             "| offload | rank | forward+backward s | step s | of which gather s | stream s (disk waits) | RSS growth: initialize / "
             "+steps / peak | host_model_states | disk bytes/step | stream's disk GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for ranks in result["runs"]:
        for r in ranks:
            host = r["memory_report"].get("host_model_states", 0)
            disk = r.get("disk_bytes_per_step")
            stream = "" if disk is None else f"{med(r['stream_s']):.2f} ({med(r['disk_wait_s']):.2f})"
            moved = "" if disk is None else f"{disk / 2**30:.2f} GiB"
            speed = "" if disk is None else f"{disk / med(r['stream_s']) / 1e9:.2f}"
            grown = " / ".join(f"{(r[k] - r['rss_before']) / MIB:,.0f}"
                               for k in ("rss_after_init", "rss_after_steps", "rss_peak"))
            lines.append(f"| {r['mode']} | {r['rank']} | {med(r['compute_s']):.2f} | {med(r['step_s']):.2f} | "
                         f"{med(r['gather_s']):.2f} | {stream} | {grown} MiB | {host / MIB:,.0f} MiB | {moved} | {speed} |")
    lines += ["", summary(result, shared)]
    return "\n".join(lines)


def summary(result: dict, shared: dict[str, float]) -> str:
    """All ranks' disk bytes over the slowest rank's stream against the raw rate of as many streams, and each
    nvme rank's RSS growth beyond the cpu rank's (less the host block that holds its states) against the pool."""
    runs = {ranks[0]["mode"]: ranks for ranks in result["runs"]}
    out = []
    for mode in ("nvme", "nvme-serial"):
        ranks = runs[mode]
        moved = sum(r["disk_bytes_per_step"] for r in ranks) / max(med(r["stream_s"]) for r in ranks)
        out.append(f"{mode}: all ranks' {moved / 1e9:.2f} GB/s = {moved / mixed(shared):.0%} of the raw mixed rate "
                   f"of {len(ranks)} stream(s); step {max(med(r['step_s']) for r in ranks):.2f} s against cpu's "
                   f"{max(med(r['step_s']) for r in runs['cpu']):.2f} s and none's "
                   f"{max(med(r['step_s']) for r in runs['none']):.2f} s")
        for r, c in zip(ranks, runs["cpu"]):
            beyond = (r["rss_after_steps"] - r["rss_before"]) - (c["rss_after_steps"] - c["rss_before"]
                                                                  - c["memory_report"]["host_model_states"])
            pool, one = r["memory_report"]["nvme_host_buffers"], r["sub_group_buffer_bytes"]
            out.append(f"  rank {r['rank']}: RSS growth beyond cpu's without its host block {beyond / MIB:,.0f} MiB; "
                       f"the pool (nvme_host_buffers) {pool / MIB:,.0f} MiB + one sub-group {one / MIB:,.0f} MiB = "
                       f"{(pool + one) / MIB:,.0f} MiB")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))))
    else:
        main(sys.argv[1], *map(int, sys.argv[2:6]))
