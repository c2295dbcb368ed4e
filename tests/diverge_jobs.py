"""Run tests/scripts/diverge_stage3.py's two modes at once (2 jobs of 2 ranks) as tests/exits.py runs a
script's ranks: forked from this one process, which imported torch and zerodp once (a fresh process per
rank imported them 4 times, ~4 s of CPU each), each rank under torchrun's environment and ending through
the interpreter's own exit, as `python diverge_stage3.py` ends. "work"'s rank 1 works on until its rank 0
has ended (STOP appears then); a process still running after 300 s is killed.

    python tests/diverge_jobs.py DIR    # writes DIR/runs.json: {mode: [[exit code, output, time.time()
                                        # it ended (inf: killed)] per rank]}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from exits import become_rank, free_port, reap  # imports torch and zerodp (once, for every rank) and freezes gc

SCRIPT = Path(__file__).resolve().parent / "scripts" / "diverge_stage3.py"
MODES = ("barrier", "work")


def main(out: Path) -> None:
    pids = {}
    for mode in MODES:
        port = free_port()
        for rank in range(2):
            pid = os.fork()
            if pid == 0:  # no `with` or `finally` around the forks: a rank unwinding out of here would run it
                log, args = str(out / f"{mode}.{rank}.log"), [mode, str(out / f"stop-{mode}")]
                become_rank(rank, 2, port, log, str(SCRIPT), args)
                sys.exit(0)  # leaves through the interpreter's exit, as the script does
            pids[pid] = (mode, rank)

    def stop_work_once_its_rank_0_ended(codes: dict) -> None:
        if ("work", 0) in codes:
            (out / "stop-work").touch()

    codes, ended = reap(pids, time.monotonic() + 300, between=stop_work_once_its_rank_0_ended)
    runs = {mode: [[codes[mode, r], (out / f"{mode}.{r}.log").read_text(), ended[mode, r]] for r in range(2)]
            for mode in MODES}
    (out / "runs.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
