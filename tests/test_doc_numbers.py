"""Numbers the docs quote from `zerodp estimate` are what the command prints today: each quote names its
command, and this test runs that command and finds the printed values in the quote. A number that no
test runs is not written (docs/COMMANDS.md once said 17.5 GiB for a command that printed 11.2: the
quote had lost its --seq 2048).

One measured run (the step and both set-up paths on fake tensors: 23 s of CPU on the project's 2-core
machine; a 1.3B model costs nearly as much, 17 s) and one formula run (`--measure none`, 0.1 s) serve
every quote. The measuring runs in this process (in_process.py: the same function on the same JSON as the
command's child, less a fresh interpreter's imports, ~4 s). Their cost is per operation, not per byte: 82,000
ops on fake tensors go through FakeTensorMode and PyTorch's MemTracker at 0.2-0.4 ms each (a profile found
nothing done twice); 40 layers take them, so a shallower model would be cheaper, not a narrower one.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from in_process import children_here

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
    with children_here():
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


LORA_COMMAND = "zerodp estimate --model benchmarks/llama2-70b --world 8 --stage 2 3 --lora 8 --measure none"
# The fine-tune table's rows (plan/finetune.py): N, stage, frozen base, trained states, activations, device, host.
LORA_ROW = re.compile(rf"^\s*8\s+(\d)\s+{SIZE}\s+{SIZE}\s+{SIZE}\s+{SIZE}\s+-\s*$", re.M)
LORA_QUOTE = ("(`{command}`: rank-8 adapters on every Linear but the head, {trained} of {total} parameters, "
              "{percent}): {frozen2} of frozen base per rank at stage 2, {frozen3} at stage 3, beside {states3} "
              "of trained states and {act} of activations ({batch}), {device3} on each GPU;")


def test_documented_lora_numbers_are_what_the_fine_tune_estimate_prints():
    """The command as written (run in this process, repo-relative --model): its fine-tune table is the
    whole estimate, two small meta builds of the 70B."""
    argv = LORA_COMMAND.split()[2:]
    argv[argv.index("--model") + 1] = str(REPO / argv[argv.index("--model") + 1])
    text = _run(*argv)
    rows = {int(m[1]): m.groups()[1:] for m in LORA_ROW.finditer(text)}
    head = re.search(r"(micro-batch \d+ x \d+ tokens): LoRA rank 8 trained \((\S+) of (\S+), (\S+)\)",
                     " ".join(text.split()))
    assert head is not None and set(rows) == {2, 3}, text
    quote = LORA_QUOTE.format(command=LORA_COMMAND, trained=head[2], total=head[3], percent=head[4],
                              frozen2=rows[2][0], frozen3=rows[3][0], states3=rows[3][1], act=rows[3][2],
                              batch=head[1], device3=rows[3][3])
    doc = " ".join((REPO / "docs/COMMANDS.md").read_text().split())
    assert quote in doc, f"docs/COMMANDS.md should quote `{LORA_COMMAND}` as: {quote}"
