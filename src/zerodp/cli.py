"""`zerodp train | estimate | consolidate | bench`: each subcommand is its module's main()."""

from __future__ import annotations

import difflib
import importlib
import sys

COMMANDS = {
    "train": ("zerodp.train", "train a GPT (or a Hugging Face model) with ZeRO"),
    "estimate": ("zerodp.plan.estimate", "per-rank memory: the formula, a measured step, the peak on fake tensors"),
    "consolidate": ("zerodp.checkpoint", "write a sharded checkpoint as one full fp32 state dict"),
    "bench": ("zerodp.bench", "throughput and memory side by side with PyTorch, DDP, FSDP2, DeepSpeed"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<12} {help}" for name, (_, help) in COMMANDS.items()]
        usage = "usage: zerodp COMMAND [ARGS]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] in ("-h", "--help"):
            print(usage)
            sys.exit(0)
        print(usage, file=sys.stderr)
        if argv:  # a mistyped command: say so, and which one was meant
            close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            print(f"zerodp: unknown command '{argv[0]}'{hint}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
