"""How `zerodp train` runs: as one rank under torchrun, or as a launcher of --nproc ranks.

Under torchrun (RANK/WORLD_SIZE set) this process is one rank of the job. With no launcher it starts
--nproc ranks itself through torchrun's own launcher API (a standalone rendezvous on localhost), so a
newcomer types one command and sees ZeRO-2 train on 2 CPU ranks. As a launcher it says how the job
ended in one line: the rank that died first and how (FirstExit), or the signal / non-finite stop that
every rank agreed on (their codes: 128 + signal, EXIT_NON_FINITE). The training itself is loop.py.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import signal
import sys
import tempfile
import traceback
import uuid
from pathlib import Path

# options.py is torch-free: `--help` answers before torch is imported (loop/resume import it on use).
from zerodp.train.options import EXIT_NON_FINITE, parse_options
from zerodp.train.signals import PID_DIR, TRAINING

# A rank that stopped because a peer stalled or died (zerodp.PeerFailure) exits with this: the
# launcher then blames the peer, not the rank that only noticed it.
EXIT_PEER_FAILURE = 4


def main(argv: list[str] | None = None) -> None:
    stop_during_setup()
    opts = parse_options(argv)
    from zerodp.lazy import require

    require("zerodp train", "tqdm", "matplotlib", *(["transformers"] if opts.model.startswith("hf-") else []))
    from zerodp.train.ds_sections import job_world
    from zerodp.train.resume import choose_resume

    # Which checkpoint, and the batch it keeps: settled here, so a misfit stops before any rank starts.
    choose_resume(opts, job_world(opts))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ or opts.nproc == 1:  # one rank: this one
        # Imported here, not above: a launcher only starts ranks, and the loop's imports (the engine,
        # the models, pydantic's config models) would cost it CPU before any rank starts.
        from zerodp.train.loop import run_rank

        code = run_rank(opts)
        if code:
            raise SystemExit(code)  # stopped by a signal, checkpoint written: 128 + the signal number
        quick_exit()
    else:
        try:
            launch(opts)
        finally:
            quick_exit()


_SETUP_STOPPED = "zerodp train: stopped by {} during set-up, before any step of this run; no checkpoint written"


def stop_during_setup() -> None:
    """Until the training loop's StopSignal takes over (or torch's launcher, in a launcher), SIGTERM /
    SIGINT end set-up at once, with one line from the launcher or rank 0 and the exit code 128 + signal."""
    def stop(signum: int, frame) -> None:
        if os.environ.get("RANK", "0") == "0":
            print(_SETUP_STOPPED.format(signal.Signals(signum).name), flush=True)
        os._exit(128 + signum)  # set-up holds nothing worth a teardown, and a peer may wait in a collective
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def launch(opts: argparse.Namespace) -> None:
    """Start opts.nproc ranks on this machine, as `torchrun --standalone --nproc-per-node N` does."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # A SIGTERM/SIGINT to this process is forwarded to the ranks (torch's launcher does that), which
    # finish their step, checkpoint and exit; shutdown_timeout bounds the wait before it SIGKILLs them.
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=opts.nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, shutdown_timeout=max(10, math.ceil(opts.timeout)))
    # The ranks are spawned (torch's default), not forked from here: a SIGTERM that lands while os.fork() runs
    # its at-fork hooks raises in one of them (seen: logging's _releaseLock), where Python prints and drops it;
    # the stop is lost, or the lock left held, and the job never ends (`zerodp train` stopped 4 s into set-up).
    # A failing rank prints its own traceback; the launcher's copy of it would only repeat it.
    # Its shutdown warnings too ("Received 15 death signal"): the job says what happened in one line.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as pids, FirstExit(pids) as first:
        try:
            elastic_launch(config, _launched_rank)(opts)
            return
        except SignalException as e:  # the ranks were told and have stopped; rank 0 said how
            if not Path(pids, TRAINING.format(rank=0)).exists():  # unless it was still in set-up
                print(_SETUP_STOPPED.format(signal.Signals(int(e.sigval)).name), flush=True)
            stopped = 128 + int(e.sigval)
        except ChildFailedError as e:
            codes = {f.exitcode for f in e.failures.values()}
            # Every rank stopped together, and rank 0 said why: on a signal, or on non-finite steps.
            if codes <= {128 + signal.SIGTERM, 128 + signal.SIGINT} or codes == {EXIT_NON_FINITE}:
                raise SystemExit(max(codes))
            found = first.rank_and_code or min((r, f.exitcode) for r, f in e.failures.items())
            raise SystemExit(f"zerodp train: {describe_exit(*found, world=opts.nproc)}")
    # On a signal torch leaves its rendezvous open (launcher/api.py), and the keep-alive thread running: an
    # interpreter exit can free the rendezvous on that thread, whose finalizer then fails to join itself
    # ("cannot join current thread", a traceback after the job's one line). Nothing is left to clean up.
    exit_now(stopped)


class FirstExit:
    """Which rank exited first, and how: the one whose failure made the others fail.

    torch's launcher reports one failed rank: whichever its poll saw first, often rank 0 failing in
    a collective because its peer was SIGKILLed a moment before (and get_first_failure orders by
    error files, which a killed rank never writes). So the launcher watches SIGCHLD itself; each rank
    leaves its pid in `pid_dir`, and os.waitid(WNOWAIT) reads a dead rank's status without reaping it.
    """

    def __init__(self, pid_dir: str):
        self.pid_dir, self.rank_and_code = pid_dir, None

    def __enter__(self) -> "FirstExit":
        os.environ[PID_DIR] = self.pid_dir
        self._previous = signal.signal(signal.SIGCHLD, self._on_child_exit)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGCHLD, self._previous)
        os.environ.pop(PID_DIR, None)

    def _on_child_exit(self, signum: int, frame) -> None:
        if self.rank_and_code is not None:
            return
        pids = {}
        for name in os.listdir(self.pid_dir):
            try:
                pids[int(name)] = int(Path(self.pid_dir, name).read_text())
            except (OSError, ValueError):
                continue
        for rank, pid in sorted(pids.items()):
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if info is not None and (info.si_code != os.CLD_EXITED or info.si_status != 0):
                killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
                self.rank_and_code = (rank, -info.si_status if killed else info.si_status)
                # A stopped (SIGSTOP) rank cannot act on the SIGTERM the launcher sends next and
                # would be SIGKILLed only after torch's 30 s grace: let it run, and fail at once in
                # its next collective with the rank that is gone.
                for other in pids.values():
                    with contextlib.suppress(OSError):
                        os.kill(other, signal.SIGCONT)
                return


def describe_exit(rank: int, code: int, world: int | None = None) -> str:
    """'rank 1 was killed by SIGKILL (exit code -9)' or 'rank 0 failed (exit code 1)'; a rank that
    stopped on a peer's stall names the other ranks (it cannot tell which of them stalled)."""
    if code == EXIT_PEER_FAILURE:
        others = [str(r) for r in range(world or 0) if r != rank]
        suspect = (f"rank {others[0]}" if len(others) == 1 else
                   f"one of ranks {', '.join(others)}" if others else "another rank")
        return (f"{suspect} stopped responding (stalled or died): rank {rank} gave up waiting for it "
                "(its line above names the collective and where)")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name} (exit code {code})"
    return f"rank {rank} failed (exit code {code})"


def _launched_rank(opts: argparse.Namespace) -> None:
    """A rank that this job started: its error is printed once, plainly, then the rank exits."""
    # In set-up a signal ends this rank at once, from the kernel: a Python handler runs only between
    # bytecodes, and a rank whose peer has already gone can sit for comm_timeout_s inside one C++ call
    # (seen: ProcessGroupGloo's constructor waiting in the store for the peer's address) while torch's
    # launcher waits its shutdown_timeout for it. The launcher says the job's one line (launch).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if PID_DIR in os.environ:  # for FirstExit
        Path(os.environ[PID_DIR], os.environ["RANK"]).write_text(str(os.getpid()))
    import zerodp
    from zerodp.train.loop import run_rank

    try:
        code = run_rank(opts)
    except zerodp.PeerFailure as e:  # one line says it all: which collective, and why
        print(f"zerodp train: rank {os.environ.get('RANK', '?')}: {e}", file=sys.stderr)
        exit_now(EXIT_PEER_FAILURE)
    except Exception:
        traceback.print_exc()
        exit_now(1)  # no interpreter teardown: the other ranks may be waiting in a collective
    if code:
        exit_now(code)  # as on an error: an interpreter teardown here can stall for seconds
    # Trained. A signal that came after the last step (torch's launcher stopping the job while rank 0
    # wrote the final weights) only set the loop's StopSignal flag; returning now would leave the
    # launcher waiting its whole shutdown_timeout for this process. So end it, and on a later signal too.
    stopped = getattr(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), "signum", 0)
    if stopped:
        exit_now(128 + stopped)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    quick_exit()


def exit_now(code: int) -> None:
    """End this process at once with `code`, what it printed flushed: no exit hooks, no interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quick_exit() -> None:
    """Spare this process's exit the garbage collector's passes over every object torch and its imports
    (sympy, DTensor) made: in a rank or a launcher they cost 1.5-2 s of CPU at each exit, after the job's
    last line, and free nothing that matters (the interpreter still clears its modules, runs every exit
    hook). zerodp's process groups are freed first (teardown.release_at_exit: their gloo threads must
    not live into the interpreter's finalization), and what is garbage now is collected; only what is
    still alive is frozen."""
    if "torch.distributed" in sys.modules:
        from zerodp.distributed import teardown

        teardown.release_at_exit()  # runs again at exit, with nothing left to free
    gc.collect()
    gc.freeze()
