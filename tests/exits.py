"""Run a script as the ranks of many small jobs and say how each process ended (exit code or signal).

    python tests/exits.py --jobs 40 --world 2 --batch 4 [--threads] SCRIPT [ARGS...]
    python tests/exits.py [--threads] --runs '[{"script": S, "jobs": 3, "world": 2, "batch": 3}, ...]'

Each rank starts as torchrun starts one (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in its
environment, SCRIPT run as __main__) and ends as a script's process ends: through the interpreter's own
exit (atexit, then finalization), never os._exit, since that exit is what can abort. To make 40 jobs cheap
the ranks are forked from this process, which has imported torch and zerodp once (and started no thread,
store or group a rank could inherit). Prints one JSON line: per job, per rank, [exit code, output tail];
a signal is a negative code, as subprocess reports it. With --threads each rank also prints, from an
exit hook registered before the script runs (so after any hook the script registers, such as zerodp's),
the threads it still has as the interpreter's finalization begins: "threads at exit: [...]".
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time

import torch

# What zerodp.initialize and a torch optimizer import (torch._dynamo: ~2 s of CPU), imported once here
# and inherited by every forked rank.
import torch._dynamo  # noqa: F401
import zerodp.checkpoint  # noqa: F401
import zerodp.engine.engine  # noqa: F401
import zerodp.engine.summary  # noqa: F401

# What was imported stays out of every rank's garbage collections (its own and its finalization's): a
# forked rank's exit then costs ~0.3 s of CPU instead of ~1.1 s. What a rank creates is collected as usual.
gc.freeze()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _print_threads() -> None:
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print("threads at exit:", sorted(names), flush=True)


def become_rank(rank: int, world: int, port: int, log: str, script: str, args: list[str],
                threads: bool = False) -> None:
    """In the forked child: become one rank of the job, run the script, end as its process would."""
    if threads:
        atexit.register(_print_threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    # Falling off the end from here (or an exception raised above reaching the top) ends this process
    # through the interpreter's exit, as `python script.py` ends.


def reap(pids: dict[int, tuple], deadline: float, between=None) -> tuple[dict[tuple, int], dict[tuple, float]]:
    """({key: exit code}, {key: time.time() it ended}) of the forked processes pids maps to their keys; one still
    running at `deadline` is killed (-9, ended inf). between(codes), if given, runs after each pass."""
    codes: dict[tuple, int] = {}
    ended: dict[tuple, float] = {}
    while len(codes) < len(pids):
        for pid, key in pids.items():
            if key in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[key], ended[key] = os.waitstatus_to_exitcode(status), time.time()
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[key], ended[key] = -signal.SIGKILL, float("inf")
        if between is not None:
            between(codes)
        time.sleep(0.02)
    return codes, ended


def run_jobs(script: str, args: list[str], jobs: int, world: int, batch: int, timeout_s: float,
             threads: bool = False) -> list[list]:
    """`jobs` jobs of `world` ranks each, `batch` jobs at a time; [[code, output tail] per rank] per job.
    Runs in this process: the caller (a parent that must stay free of groups) forks the ranks."""
    results: list[list] = []
    # No `with` or `finally` around the forks: a rank unwinding out of become_rank would run it too.
    tmp = tempfile.mkdtemp()
    for first in range(0, jobs, batch):
        pids, logs = {}, {}
        for job in range(first, min(first + batch, jobs)):
            port = free_port()
            for rank in range(world):
                logs[job, rank] = os.path.join(tmp, f"{job}.{rank}.log")
                pid = os.fork()
                if pid == 0:
                    become_rank(rank, world, port, logs[job, rank], script, args, threads)
                    sys.exit(0)  # leaves through the interpreter's exit, as a script does
                pids[pid] = (job, rank)
        codes = reap(pids, time.monotonic() + timeout_s)[0]
        for job in sorted({j for j, _ in pids.values()}):
            results.append([[codes[job, r], open(logs[job, r]).read()[-2000:]] for r in range(world)])
    shutil.rmtree(tmp)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="jobs run at once")
    parser.add_argument("--timeout", type=float, default=120, help="seconds a batch may take")
    parser.add_argument("--threads", action="store_true", help="print each rank's threads as it exits")
    parser.add_argument("--runs", help="instead of SCRIPT: a JSON list of {script, jobs, world, batch[, args]}, "
                        "run one after another from this one process (one import of torch for all); "
                        "prints a list of their results")
    parser.add_argument("script", nargs="?")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    if opts.runs:
        print(json.dumps([run_jobs(r["script"], r.get("args", []), r["jobs"], r["world"], r["batch"], opts.timeout,
                                   opts.threads) for r in json.loads(opts.runs)]))
        return
    print(json.dumps(run_jobs(opts.script, opts.args, opts.jobs, opts.world, opts.batch, opts.timeout,
                              opts.threads)))


if __name__ == "__main__":
    main()
