"""`zerodp bench` against another commit, in one run: does a change move the step time beyond the bench's own spread?

    python benchmarks/versus_commit.py BASE_TREE [--rounds 5] [--modes zerodp1 zerodp2 zerodp3] [-- BENCH FLAGS]

BASE_TREE is a checkout of the commit to compare with (`git worktree add --detach /tmp/base e8ef4f5`); this
checkout is the head. Each round runs `python -m zerodp.bench --fork --repeats 1` once from each tree (the order
alternating round by round), with the same flags, DDP always among the modes. Within one invocation each zerodp mode's
tokens/s is divided by DDP's, which cancels most of what the machine's load does to both; over the rounds each tree's
ratio has a min / median / max, and the two trees are told apart only where their ranges do not overlap (the rule of
zerodp/bench/spread.py: by chance alone that happens 2 / C(2n, n) of the time, 2/252 at n = 5). Prints a table and
writes every run's numbers to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from math import comb

HEAD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FLAGS = ["--model", "small", "--micro-batch", "2", "--seq", "64", "--steps", "10", "--warmup", "2",
                 "--threads", "1"]


def run_once(tree: str, modes: list[str], flags: list[str], tmp: str) -> dict[str, float]:
    """tokens/s of each mode in one `zerodp bench` of `tree`'s source."""
    out = os.path.join(tmp, "bench.json")
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
    cmd = [sys.executable, "-m", "zerodp.bench", "--fork", "--repeats", "1", "--modes", "ddp", *modes,
           "--json", out, *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench of {tree} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(out, encoding="utf-8") as f:
        results = json.load(f)["results"]
    return {r["mode"]: r["tokens_per_s"] for r in results if r["status"] == "ok"}


def spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="a checkout of the commit to compare with")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["zerodp1", "zerodp2", "zerodp3"])
    p.add_argument("--json", help="every run's tokens/s, by tree and round")
    args, rest = p.parse_known_args()
    flags = [f for f in rest if f != "--"] or DEFAULT_FLAGS
    trees = {"base": os.path.abspath(args.base), "head": HEAD}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in (["base", "head"] if r % 2 == 0 else ["head", "base"]):
                got = run_once(trees[name], args.modes, flags, tmp)
                runs.append({"round": r, "tree": name, "tokens_per_s": got})
                print(f"round {r} {name}: " + ", ".join(f"{m} {v:,.0f}" for m, v in got.items()), file=sys.stderr)
    chance = 2 / comb(2 * args.rounds, args.rounds)
    print(f"{'mode':<10} {'base: ratio to DDP (min median max)':<38} {'head: ratio to DDP':<26} verdict")
    rows = {}
    for mode in args.modes:
        ratio = {t: [x["tokens_per_s"][mode] / x["tokens_per_s"]["ddp"] for x in runs if x["tree"] == t]
                 for t in trees}
        b, h = spread(ratio["base"]), spread(ratio["head"])
        apart = b[2] < h[0] or h[2] < b[0]
        verdict = (f"told apart ({chance:.1%} by chance): head {'faster' if h[1] > b[1] else 'slower'}" if apart
                   else "cannot be told apart")
        rows[mode] = {"base": b, "head": h, "told_apart": apart}
        print(f"{mode:<10} {b[0]:.2f} {b[1]:.2f} {b[2]:.2f}{'':<24} {h[0]:.2f} {h[1]:.2f} {h[2]:.2f}{'':<12} {verdict}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"flags": flags, "trees": trees, "runs": runs, "ratios": rows}, f, indent=1)


if __name__ == "__main__":
    main()
