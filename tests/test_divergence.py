"""Ranks whose stage-3 forwards diverge end with one line naming it within comm_timeout_s, whoever created the
process group; forwards that differ in number between ranks on purpose (generate() of different lengths, an
eval loop over data the ranks do not divide) complete, in both of the ways given for them, with the whole
model's results (issue 35)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zerodp
from zerodp.engine.engine import inside
from spawn import run_ranks
from zerodp.distributed.groups import group_timeout_s

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 10    # the comm_timeout_s in its scripts
SPAWN_S = 120     # the timeout of the group spawn.py creates: the script's own group here
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # tiny units gathered, not kept whole


# ---- the two scripts, as real processes under torchrun's environment ---------------------------------
@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Both scripts at once (2 x 2 processes, tests/diverge_jobs.py: forked from one process that imported torch
    once, each ending through the interpreter's exit). Started before `cases`, which runs while they wait
    out their comm_timeout_s (the two launches overlap instead of taking their sum)."""
    out = tmp_path_factory.mktemp("diverge")
    with open(out / "launcher.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(TESTS / "diverge_jobs.py"), str(out)], stdout=log, stderr=log,
                                start_new_session=True)  # its ranks in its process group: killed with it
    yield out, proc
    if proc.poll() is None:  # its test was not run (deselected) or failed before waiting for it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def script_runs(launched, request) -> dict[str, list[tuple[int, str, float]]]:
    """{mode: [(exit code, output, time.time() it ended)] per rank}; `cases` first, run while these wait."""
    try:
        request.getfixturevalue("cases")
    except pytest.skip.Exception:  # no transformers: the scripts do not need it
        pass
    out, proc = launched
    proc.wait(timeout=400)  # the launcher kills what still runs after 300 s
    assert proc.returncode == 0, (out / "launcher.log").read_text()[-3000:]
    return {mode: [tuple(r) for r in ranks] for mode, ranks in json.loads((out / "runs.json").read_text()).items()}


def _stamp(text: str, what: str) -> float:
    found = re.search(rf"{what} ([0-9.]+)", text)
    assert found, text[-3000:]
    return float(found.group(1))


def test_divergent_eval_forwards_on_the_scripts_own_group_end_within_comm_timeout_naming_the_divergence(script_runs):
    """The script creates its group (gloo's 30-minute timeout); comm_timeout_s 10. Rank 0 runs a third eval
    forward that rank 1 never runs: rank 1 then waits in a dist.barrier() of its own, or works on."""
    runs = script_runs
    for mode, ((code0, out0, end0), (code1, out1, end1)) in runs.items():
        assert end0 != float("inf") and end1 != float("inf"), f"{mode}: a process was left running\n{out0[-3000:]}"
        waiting = _stamp(out0, "waiting since")
        raised = _stamp(out0, "exit hooks at") - waiting  # the script's exit hook runs once the error is raised
        print(f"{mode}: rank 0 raised {raised:.1f} s after its forward began and ended {end0 - waiting:.1f} s "
              f"after; rank 1 ended {end1 - waiting:.1f} s after")
        assert code0 != 0
        line = next(line for line in out0.splitlines() if "PeerFailure:" in line)
        assert "all_gather for forward 3 of unit 1 ('0') in eval after step 0 timed out after 10 s" in line, line
        assert "rank 1 is in no zerodp collective" in line and "engine.uneven_forwards()" in line, line
        assert "engine.gathered_parameters()" in line and "'comm_timeout_s'" in line, line
        assert TIMEOUT_S <= raised < TIMEOUT_S + 20, raised  # the bound, and no more (generous under load)
        # The process then ends, not after gloo's 30 minutes: 0.3 s after its error on an idle machine, 86 s
        # once beside two busy loops and the `cases` launch (interpreter finalization, not yet explained); the
        # bound stays under the launcher's 300 s kill, so a process that hangs still fails here.
        assert end0 - waiting < TIMEOUT_S + 200, end0 - waiting
    (_, _, end0), (code1, out1, end1) = runs["barrier"]
    assert code1 != 0 and "Connection closed by peer" in out1, out1[-3000:]  # its barrier ends with rank 0
    assert end1 - end0 < 60
    code1, out1, _ = runs["work"][1]
    assert code1 == 0 and "rank 1: done" in out1, out1[-3000:]


# ---- one launch of 2 ranks on a group of the script's own (spawn.py's, 120 s), every other case ------------------
def _blocks() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)))


def _engine(model: nn.Module, **config) -> zerodp.Engine:
    return zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": STAGE3, **config})


def _bound_groups(rank: int) -> dict:
    """comm_timeout_s given: zerodp's collectives run on a twin of the script's group with that timeout, and
    hierarchical sharding's groups have it too; not given: the script's group itself."""
    model = _blocks()
    given = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "train_micro_batch_size_per_gpu": 1, "comm_timeout_s": 7,
        "zero_optimization": {**STAGE3, "mics_shard_size": 1}})
    model = _blocks()
    plain = _engine(model)
    return {"twin": group_timeout_s(inside(given).comm.group), "replica": group_timeout_s(inside(given).comm.replica.group),
            "script's": group_timeout_s(dist.group.WORLD), "twin is not the script's": inside(given).comm.group
            is not dist.group.WORLD, "not given is the script's": inside(plain).comm.group is dist.group.WORLD}


def _unbound_line(rank: int) -> dict:
    """A backend that takes no timeout: initialize says so in one line, and the engine runs on the group."""
    c10d, err = dist.distributed_c10d, io.StringIO()
    new_group, set_timeout = dist.new_group, c10d._set_pg_timeout  # a twin, or the timeout of one made before

    def refused(*args, **kwargs):
        raise RuntimeError("this backend has no timeout")
    dist.new_group = c10d._set_pg_timeout = refused
    try:
        with contextlib.redirect_stderr(err):
            model = _blocks()
            engine = _engine(model, comm_timeout_s=5)
    finally:
        dist.new_group, c10d._set_pg_timeout = new_group, set_timeout
    engine.eval()
    with torch.no_grad():
        engine(torch.ones(1, 6))
    return {"lines": [line for line in err.getvalue().splitlines() if "comm_timeout_s" in line],
            "group": inside(engine).comm.group is dist.group.WORLD}


def _generate(rank: int) -> dict:
    """A tiny GPT-2 at stage 3: generate() of 3 new tokens on rank 0 and 8 on rank 1, in both modes, and on
    the whole model in this one process."""
    import transformers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
    whole = copy.deepcopy(model).eval()
    engine = _engine(model, comm_timeout_s=3)
    engine.eval()
    prompt = torch.randint(1, 300, (1, 4 + rank), generator=torch.Generator().manual_seed(rank))
    names = {"engine": engine, "model": model, "prompt": prompt, "new_tokens": 3 + 5 * rank}
    exec(compile(_generation_block(), "docs/CONFIG.md", "exec"), names)  # the documented example, as written
    return {"whole": whole.generate(prompt, max_new_tokens=3 + 5 * rank, do_sample=False).tolist(),
            "per_unit": names["tokens_per_unit"].tolist(), "gathered": names["tokens_gathered"].tolist()}


def _generation_block() -> str:
    """docs/CONFIG.md's python block of its section on generation at stage 3."""
    text = (TESTS.parent / "docs" / "CONFIG.md").read_text()
    section = text[text.index("## Evaluation and generation at stage 3"):]
    return re.search(r"^```python\n(.*?)^```", section, flags=re.S | re.M).group(1)


def _data() -> tuple[TensorDataset, nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = _blocks()
    return TensorDataset(torch.randn(5, 6)), model, copy.deepcopy(model)


def _eval(engine: zerodp.Engine, whole: nn.Module, batches) -> list[bool]:
    engine.eval()
    with torch.no_grad():
        return [torch.allclose(engine(x), whole(x), atol=1e-6) for (x,) in batches]


def _sampler_eval(rank: int) -> list[bool]:
    """5 samples, 2 ranks, DistributedSampler(drop_last=False): it pads to 3 each, so the loop completes."""
    dataset, model, whole = _data()
    engine = _engine(model, comm_timeout_s=3)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False, drop_last=False)
    return _eval(engine, whole, DataLoader(dataset, batch_size=2, sampler=sampler))


def _uneven_eval(rank: int) -> list[bool]:
    """5 samples cut by hand, 3 batches on rank 0 and 2 on rank 1, inside uneven_forwards()."""
    dataset, model, whole = _data()
    engine = _engine(model, comm_timeout_s=3)
    with engine.uneven_forwards():
        return _eval(engine, whole, DataLoader(torch.utils.data.Subset(dataset, range(rank, 5, 2))))


def _both_waiting(rank: int) -> str:
    """Both ranks in zerodp, in collectives that do not match: rank 0 in a third eval forward, rank 1 at the
    end of an uneven_forwards() block. Each line names where the other waits. (A group of the script's own
    with a 3 s timeout, comm_timeout_s not given: this group alone is left timed out.)"""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    _, model, _ = _data()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": STAGE3}, process_group=group)
    engine.eval()
    try:
        with torch.no_grad():
            for _ in range(3 - rank):
                engine(torch.ones(1, 6))
            if rank == 1:
                with engine.uneven_forwards():
                    pass
    except zerodp.PeerFailure as e:
        return str(e)
    return "no error"


def _diverged_eval(rank: int) -> tuple[str, float]:
    """The same loop without it: rank 0's third forward times out and names the divergence. (Last: the
    engine's group is left with a timed-out collective.)"""
    dataset, model, whole = _data()
    engine = _engine(model, comm_timeout_s=3)
    t0 = time.monotonic()
    try:
        _eval(engine, whole, DataLoader(torch.utils.data.Subset(dataset, range(rank, 5, 2))))
    except zerodp.PeerFailure as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def _named_at_the_gather(rank: int, rank0_only: bool) -> tuple[str, float]:
    """Issue 43's two scripts at stage 3 (persistence threshold 0), on the script's own group, no comm_timeout_s:
    an eval loop split by hand (3 batches on rank 0, 2 on rank 1) then a training step; or nanoGPT's rank-0-only
    estimate_loss() before each step. The first gather that differs raises on every rank, naming what each gathers."""
    dataset, model, _ = _data()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": STAGE3})
    t0 = time.monotonic()
    try:
        for _ in range(2):
            if not rank0_only or rank == 0:
                engine.eval()
                with torch.no_grad():
                    for (x,) in DataLoader(torch.utils.data.Subset(dataset, range(rank if not rank0_only else 0, 5,
                                                                              2 if not rank0_only else 5))):
                        engine(x)
            engine.train()
            engine.backward(engine(torch.ones(1, 6)).sum())
            engine.step()
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def _cases(rank: int, world: int) -> dict:
    return {"groups": _bound_groups(rank), "unbound": _unbound_line(rank), "generate": _generate(rank),
            "sampler": _sampler_eval(rank), "uneven": _uneven_eval(rank), "both": _both_waiting(rank),
            "hand_split": _named_at_the_gather(rank, False), "rank0_eval": _named_at_the_gather(rank, True),
            "diverged": _diverged_eval(rank), "slow": _slow_rank(rank)}


def _slow_rank(rank: int) -> dict:
    """Stage 3, wait_notice_s 0.5, no comm_timeout_s (the script's own group): rank 1 is 3 s late for the
    second step's first forward. Rank 0's stderr, and that every rank finished both steps."""
    torch.manual_seed(0)
    model = _blocks()
    engine = zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               {"train_micro_batch_size_per_gpu": 1, "wait_notice_s": 0.5,
                                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        for step in range(2):
            if rank == 1 and step == 1:
                time.sleep(3)
            engine.backward(engine(torch.randn(1, 6)).sum())
            engine.step()
    return {"said": err.getvalue(), "steps": engine.global_steps}


@pytest.fixture(scope="module")
def cases(launched):  # the scripts start first, and wait out their comm_timeout_s while these run
    pytest.importorskip("transformers")
    return run_ranks(_cases, 2, timeout_s=SPAWN_S)


def test_comm_timeout_s_bounds_zerodp_collectives_on_the_scripts_own_group(cases):
    for rank in cases:
        assert rank["groups"] == {"twin": 7.0, "replica": 7.0, "script's": SPAWN_S, "twin is not the script's": True,
                                  "not given is the script's": True}


def test_a_group_whose_backend_takes_no_timeout_is_named_in_one_line_at_initialize(cases):
    lines = cases[0]["unbound"]["lines"]
    assert len(lines) == 1 and "comm_timeout_s=5 cannot bound zerodp's collectives" in lines[0], lines
    assert "this backend has no timeout" in lines[0] and "timeout=datetime.timedelta(seconds=5)" in lines[0]
    assert cases[1]["unbound"]["lines"] == []  # rank 0 says it
    assert all(rank["unbound"]["group"] for rank in cases)


@pytest.mark.parametrize("mode", ["per_unit", "gathered"])
def test_generate_of_different_lengths_per_rank_at_stage3_gives_the_whole_models_tokens(cases, mode):
    for rank, out in enumerate(cases):
        assert out["generate"][mode] == out["generate"]["whole"]
        assert len(out["generate"]["whole"][0]) == 4 + rank + 3 + 5 * rank  # stopped at different lengths


def test_eval_over_data_the_ranks_do_not_divide_completes_or_names_the_divergence(cases):
    assert [len(rank["sampler"]) for rank in cases] == [2, 2] and all(all(r["sampler"]) for r in cases)
    assert [len(rank["uneven"]) for rank in cases] == [3, 2] and all(all(r["uneven"]) for r in cases)
    (message, seconds), (other, _) = cases[0]["diverged"], cases[1]["diverged"]
    assert other == "no error"  # rank 1 ran its 2 forwards and went on
    assert "all_gather for forward 3 of unit 1 ('0') in eval after step 0 timed out after 3 s" in message, message
    assert "rank 1 is in no zerodp collective" in message and "engine.uneven_forwards()" in message
    print(f"uneven eval without uneven_forwards(): rank 0 raised after {seconds:.1f} s (comm_timeout_s 3)")
    assert 3 <= seconds < 3 + 15


@pytest.mark.parametrize("script", ["hand_split", "rank0_eval"])
def test_a_divergent_forward_is_named_at_its_first_gather_on_every_rank(cases, script):
    """Within seconds, on the script's own group with no comm_timeout_s (its timeout is the spawn's minutes):
    every rank raises at the first gather that differs, naming what each rank gathers it for."""
    for rank in cases:
        message, seconds = rank[script]
        assert "stage-3 ranks diverged at this gather" in message, message
        assert "forward in eval" in message and "training forward" in message, message
        assert "engine.uneven_forwards()" in message, message
        assert seconds < 30, seconds  # not the group's timeout (SPAWN_S)


def test_ranks_waiting_in_collectives_that_do_not_match_name_where_the_other_waits(cases):
    mine, other = cases[0]["both"], cases[1]["both"]
    forward = "all_gather for forward 3 of unit 1 ('0') in eval after step 0"
    answering = "all_reduce answering other ranks' gathers at the end of engine.uneven_forwards() after step 0"
    # Whichever rank times out first closes its connections: the other may see that before its own timeout
    # (both ranks enter theirs at about the same moment; in CI once rank 1 reached its 3 s first).
    assert mine.startswith(forward) and other.startswith(answering), (mine, other)
    timed_out = [" timed out after 3 s: " in line for line in (mine, other)]
    closed = [" failed: a peer rank died, or closed its connection after a timeout of its own" in line
              for line in (mine, other)]
    assert any(timed_out) and all(t or c for t, c in zip(timed_out, closed)), (mine, other)
    # A rank that times out waits up to 2 s for the others' places: the later of the two always sees the
    # earlier's (written before it raised); the earlier sees the later's unless load parts them more.
    named = [f"rank 1 waits in {answering}" in mine, f"rank 0 waits in {forward}" in other]
    assert any(named), (mine, other)
    for line, peer, seen in zip((mine, other), (1, 0), named):
        assert seen or f"rank {peer} is in no zerodp collective" in line, line
    print(f"rank 0: {mine}\nrank 1: {other}")


def _script_group_taken_for_zerodps(rank: int, world: int) -> dict:
    from zerodp.distributed import teardown
    return {"owns": teardown.owns(dist.group.WORLD), "timeout": group_timeout_s(dist.group.WORLD)}


def test_a_forked_rank_never_takes_its_scripts_group_for_one_zerodp_created(monkeypatch):
    """This process let zerodp create (and then destroyed) a default group; a rank forked from it inherits that
    memory but runs on a group of its script's own, whose timeout comm_timeout_s must leave alone (a twin gets
    it). Taken for zerodp's, the script's group got comm_timeout_s: in the suite, after any test that ran a world
    of one in this process, spawn.py's own closing barrier then timed out at 3 s."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    from zerodp.distributed.comm import init_distributed
    init_distributed("gloo")
    dist.destroy_process_group()
    for rank in run_ranks(_script_group_taken_for_zerodps, 2, timeout_s=SPAWN_S):
        assert rank == {"owns": False, "timeout": SPAWN_S}


def test_a_rank_that_sees_its_peer_close_the_connection_reads_where_the_peer_waited():
    """Two ranks in mismatched collectives: the first to time out writes its place and closes its gloo
    connections, so the later one may see "Connection closed by peer" rather than a timeout of its own (it
    did under load). It still names where the peer waited, read from the store. (One process as rank 0 of
    2 on the fake group, with a store of its own holding what the peer wrote.)"""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    from zerodp.distributed.comm import Comm

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    store = dist.distributed_c10d._get_default_store()  # the group's view of it, as the ranks share it
    comm = Comm(None)
    peer = "all_gather for forward 3 of unit 1 ('0') in eval after step 0"
    store.set(f"zerodp/waiting/{comm.group.group_name}/1", peer)
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5")
    failure = comm.peer_failure(closed, "answering other ranks' gathers", "all_reduce")
    assert str(failure).startswith("all_reduce answering other ranks' gathers failed: a peer rank died, or closed"), failure
    assert f"rank 1 waits in {peer}" in str(failure), failure
    assert store.get(f"zerodp/waiting/{comm.group.group_name}/0").decode() == "all_reduce answering other ranks' gathers"


def test_a_plain_slow_rank_gets_waiting_lines_and_no_error(cases):
    """The waiting rank says where it waits and where the other is, at 0.5, 1 and 2 s (doubling), and goes on."""
    assert [rank["slow"]["steps"] for rank in cases] == [2, 2]
    lines = cases[0]["slow"]["said"].splitlines()
    assert 2 <= len(lines) <= 4, lines  # 0.5, 1, 2 s of a 3 s wait (the sleep starts a little before the wait)
    for line in lines:
        assert line.startswith("[zerodp] rank 0: waiting ") and " s in all_gather in the forward pass" in line, line
        assert "(for forward 1 of unit " in line and "in forward at step 2)" in line, line
        assert "rank 1 is in no zerodp collective (slower, or running code of its own)" in line, line
    assert cases[1]["slow"]["said"] == ""  # rank 1 waited for nobody
