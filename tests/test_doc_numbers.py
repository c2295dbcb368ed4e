"""Numbers the docs quote from `zerodp estimate` are what the command prints today: each quote names its
command, and this test runs that command and finds the printed values in the quote. A number that no
test runs is not written (docs/COMMANDS.md once said 17.5 GiB for a command that printed 11.2: the
quote had lost its --seq 2048).

One measured run (the step and both set-up paths on fake tensors: 23 s of CPU on the project's 2-core
machine; a 1.3B model costs nearly as much, 17 s) and one formula run (`--measure none`, 0.1 s) serve
every quote.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from zerodp.plan import estimate

REPO = Path(__file__).resolve().parents[1]
COMMAND = "zerodp estimate --model 13B --world 64 --stage 3 --seq 2048"
SIZE = r"(\d[\d.]* [KMGT]?i?B)"
# The set-up table's row of N = 64, stage 3: meta, whole, step peak, plan with.
SETUP_ROW = re.compile(rf"^\s*64\s+3\s+{SIZE} \((fake|formula)\)\s+{SIZE} \((fake|formula)\)\s+{SIZE}\s+{SIZE} \((\w+)\)",
                       re.M)
PSI = re.compile(r"Ψ = ([\d,]+) parameters")

# file: the quote, with {placeholders} for the printed values.
QUOTES = {
    "docs/COMMANDS.md": "(`{command}`: {meta} on meta, {whole} whole, {step} the step;",
    "docs/DESIGN.md": "(`{command}`, rank 0 of 64, bf16: meta {meta}, whole {whole}, step {step};",
    "benchmarks/RESULTS.md": "| GPT 13B | {psi} | {meta} | {meta_formula} | {whole} (formula {whole_formula_number}) | "
                             "{step} | {plan} ({plan_of}) |",
}


def _run(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        estimate.main(list(args))
    return out.getvalue()


@pytest.fixture(scope="module")
def printed() -> dict[str, str]:
    """The values the quotes hold, as the command prints them today."""
    measured = _run(*COMMAND.split()[2:])
    formula = _run(*COMMAND.split()[2:], "--measure", "none")
    m, f = SETUP_ROW.search(measured), SETUP_ROW.search(formula)
    assert m is not None and f is not None and m[2] == m[4] == "fake" and f[2] == f[4] == "formula", measured + formula
    return {"command": COMMAND, "psi": f"{int(PSI.search(measured)[1].replace(',', '')) / 1e9:.2f}B",
            "meta": m[1], "whole": m[3], "step": m[5], "plan": m[6], "plan_of": m[7],
            "meta_formula": f[1], "whole_formula_number": f[3].split()[0]}


@pytest.mark.parametrize("doc", sorted(QUOTES))
def test_documented_estimate_numbers_are_what_the_command_prints(printed, doc):
    text = " ".join((REPO / doc).read_text().split())  # lines rewrapped: a quote may break anywhere
    quote = QUOTES[doc].format(**printed)
    assert quote in text, f"{doc} should quote `{COMMAND}` as: {quote}"
