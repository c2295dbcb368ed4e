"""The fake backend is asked about in one place: `Comm.is_fake` (zerodp/distributed/comm.py).

The planner (plan/peak.py: fake tensors) and the measured step (plan/measure.py: real tensors) run the
engine as rank 0 of N on torch's "fake" process group. The step path asks `comm.is_fake()` (no peer to
agree with) or `comm.is_fake(value)` (a fake tensor the host cannot read); nothing outside comm.py
compares a backend with "fake" or calls torch's fake_tensor.is_fake. Importing comm.py does not load
the fake process group's module (which registers the backend): only init_fake does.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
OWNER = "zerodp/distributed/comm.py"


def fake_questions(src: Path, root: str = "zerodp", owner: str = OWNER) -> list[str]:
    """'file:line what' for each question about the fake backend or fake tensors asked outside `owner`
    other than through a Comm's is_fake: a backend compared with "fake", torch's is_fake named."""
    found = []
    for path in sorted((src / root).rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel == owner:
            continue
        asked = [(node.lineno, what) for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
                 if (what := _fake_question(node))]
        found += [f"{rel}:{line} {what}" for line, what in sorted(asked)]
    return found


def _fake_question(node: ast.AST) -> str | None:
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Constant) and s.value == "fake" for s in sides) and \
                any("backend" in ast.unparse(s) for s in sides):
            return ast.unparse(node)
    if isinstance(node, ast.Attribute) and node.attr == "is_fake" and not ast.unparse(node.value).endswith("comm"):
        return ast.unparse(node)
    if isinstance(node, ast.Name) and node.id == "is_fake":
        return "is_fake"
    if isinstance(node, ast.ImportFrom) and any(a.name == "is_fake" for a in node.names):
        return f"from {node.module} import is_fake"
    return None


def test_only_comm_asks_whether_the_backend_or_a_tensor_is_fake():
    found = fake_questions(SRC)
    assert not found, "ask Comm.is_fake() / comm.is_fake(value) instead: " + ", ".join(found)


def test_checker_reports_a_fake_question_planted_outside_comm(tmp_path):
    (tmp_path / "pkg/distributed").mkdir(parents=True)
    (tmp_path / "pkg/distributed/comm.py").write_text('def f(self):\n    return self.backend == "fake"\n')
    (tmp_path / "pkg/step.py").write_text(
        "import torch\n"
        "from torch._subclasses.fake_tensor import is_fake\n"
        "def f(comm, t, args):\n"
        '    a = comm.backend == "fake"\n'
        "    b = torch._subclasses.fake_tensor.is_fake(t)\n"
        '    c = "fake" != dist.get_backend()\n'
        "    ok = comm.is_fake(t) or self.comm.is_fake() or args.measure == 'fake'\n")
    assert fake_questions(tmp_path, "pkg", "pkg/distributed/comm.py") == [
        "pkg/step.py:2 from torch._subclasses.fake_tensor import is_fake",
        "pkg/step.py:4 comm.backend == 'fake'",
        "pkg/step.py:5 torch._subclasses.fake_tensor.is_fake",
        "pkg/step.py:6 'fake' != dist.get_backend()"]


_CHILD = """
import sys
import torch
import zerodp.distributed.comm as comm
FAKE_PG = "torch.testing._internal.distributed.fake_pg"
loaded_by_import = FAKE_PG in sys.modules
comm.init_fake(4)
c = comm.Comm()
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    fake = torch.ones(3)
print(loaded_by_import, FAKE_PG in sys.modules, c.is_fake(), c.is_fake(torch.ones(3)), c.is_fake(fake))
torch.distributed.destroy_process_group()
comm.init_distributed("gloo")
print(comm.Comm().is_fake(), comm.Comm().is_fake(fake))
"""


def test_comm_loads_the_fake_process_group_only_for_init_fake_and_answers_is_fake():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.returncode == 0, out.stderr[-3000:]
    fake_world, gloo_world = out.stdout.split("\n")[:2]
    # not loaded by the import; loaded by init_fake; a fake group, a real tensor, a fake tensor
    assert fake_world.split() == ["False", "True", "True", "False", "True"]
    assert gloo_world.split() == ["False", "False"]  # a real group asks no fake question
