"""What the docs say about installing agrees with pyproject.toml: the torch floor they name is its
dependency's, zerodp is installed from a clone (it is not on PyPI: `pip install zerodp` finds nothing), and the
transformers release they say was tested is the one pyproject.toml's pins were tested with."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerodp import lazy

REPO = Path(__file__).resolve().parents[1]


def pages() -> dict[str, str]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in paths}


def pyproject() -> str:
    return (REPO / "pyproject.toml").read_text(encoding="utf-8")


def test_the_torch_floor_the_docs_name_is_pyprojects():
    floor = re.findall(r'"torch>=([\d.]+)"', pyproject())
    assert len(floor) == 1, "pyproject.toml names torch's floor once"
    named = {(page, v) for page, text in pages().items() for v in re.findall(r"torch >= ?([\d.]+)", text)}
    assert ("README.md", floor[0]) in named
    assert {v for _, v in named} == {floor[0]}, sorted(named)


# `pip install zerodp`, `pip install 'zerodp[hf]'`, `pip install zerodp[monitor]`: from the index, where it is not
FROM_THE_INDEX = re.compile(r"pip install ['\"]?zerodp\b")


def test_no_page_installs_zerodp_from_the_index_and_the_readme_says_how():
    assert [page for page, text in pages().items() if FROM_THE_INDEX.search(text)] == []
    readme = pages()["README.md"]
    assert "not on PyPI" in readme and "pip install -e '.[train]'" in readme


def test_a_command_missing_an_extra_names_the_install_from_the_clone():
    with pytest.raises(SystemExit) as raised:
        lazy.require("zerodp train", "a_module_nobody_installed")
    message = str(raised.value)
    assert "pip install -e '.[train]'" in message and not FROM_THE_INDEX.search(message), message


def test_the_transformers_release_the_docs_say_was_tested_is_pyprojects():
    tested = set(re.findall(r"tested with[^\n]*?transformers (\d+\.\d+)", pyproject()))
    assert len(tested) == 1, tested
    named = {(page, v) for page, text in pages().items()
             for v in re.findall(r"tested with[^.()]*?transformers (\d+\.\d+)", text)}
    assert ("docs/HF_TRAINER.md", *tested) in named
    assert {v for _, v in named} == tested, sorted(named)
