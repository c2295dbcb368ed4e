"""`zerodp consolidate DIR OUT`: the command line of export.py, torch-free until the arguments parse."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zerodp consolidate",
                                     description="write a sharded checkpoint as one full fp32 state dict")
    parser.add_argument("dir", help="a save_dir (its 'latest' tag is used) or a checkpoint tag directory")
    parser.add_argument("out", help="output file, .safetensors or .pt")
    parser.add_argument("--tag", default=None, help="the tag to consolidate (default: latest)")
    args = parser.parse_args(argv)
    from .errors import CheckpointError
    from .export import write_consolidated

    try:
        write_consolidated(args.dir, args.out, args.tag)
    except CheckpointError as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {args.out}")
