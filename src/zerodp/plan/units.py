"""Bytes as people write them: one rule to print them for every table of `zerodp estimate`, and
the parser of the sizes its flags take. Torch-free, so the flags parse before torch loads."""

from __future__ import annotations

import argparse
import re

_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human(n: float, spec: str = ".2f", compact: bool = False) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1, formatted by `spec`:
    '1.23 GiB' (".2f"), '29.7 GiB' (".3g"), '456.0 MiB' (".1f"); compact drops the space and the
    "iB" for tight table cells: '29.7G'."""
    for unit, scale in _BINARY:
        if abs(n) >= scale:
            return f"{n / scale:{spec}}" + (unit[0] if compact else f" {unit}")
    return f"{n:.0f}" + ("B" if compact else " B")


def parse_bytes(text: str) -> int:
    """'80GiB', '16GB', '1.5e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GiB, 16GB or 1.5e9")
    units = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return int(float(m.group(1)) * units[m.group(2)])
