"""Every relative link of README.md, docs/ and benchmarks/*.md leads to a file or folder of the repository,
resolved as GitHub and every viewer resolve it: from the folder of the file that holds the link."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
# [text](target) and [text](target "title"); images too. Not inside `code`.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]


def dead_links(page: Path, repo: Path = REPO) -> list[str]:
    """'page: target' for each relative link of `page` whose target does not exist."""
    out = []
    for target in LINK.findall(CODE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor of the page itself
        path = unquote(target.split("#", 1)[0])
        if not (page.parent / path).exists():
            out.append(f"{page.relative_to(repo)}: {target}")
    return out


def test_every_relative_link_leads_somewhere():
    assert len(pages()) > 5
    found = [bad for page in pages() for bad in dead_links(page)]
    assert not found, "dead links (a relative link resolves from its file's own folder): " + ", ".join(found)


def test_the_checker_resolves_from_the_files_folder(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/A.md").write_text("x")
    page = tmp_path / "docs/B.md"
    page.write_text("[ok](A.md) [ok](A.md#part) [up](../docs/A.md) [web](https://x.org/a.md) [self](#top)\n"
                    "[dead](docs/A.md) `[code](nowhere.md)` [img](missing.png \"title\")\n")
    assert dead_links(page, tmp_path) == ["docs/B.md: docs/A.md", "docs/B.md: missing.png"]
