"""A checkpoint directory on disk: its names, and writing it so that a crash loses nothing.

Everything is written into `save_dir/.tmp.{tag}` and renamed into place by rank 0 after every rank
has finished; `latest` is replaced atomically after that. Re-saving a tag moves the old directory
aside as `.old.{tag}` first, which `read.resolve` falls back on if a crash comes between the renames.
Every file's size and crc32 (`record`) go into `zerodp.json`, so that a truncated or changed file is
found on load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

FORMAT = 1
META = "zerodp.json"
LATEST = "latest"
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)  # a temp dir left by a crashed save
    os.makedirs(path)


def finish(save_dir: str, tmp: str, tag: str, meta: dict) -> None:
    """Write zerodp.json last, so a temp dir without it is an unfinished save; then commit."""
    write_atomic(os.path.join(tmp, META), json.dumps(meta, indent=1))
    commit(save_dir, tmp, tag)


def commit(save_dir: str, tmp: str, tag: str) -> None:
    """Rename the finished temp dir into place, then point `latest` at it."""
    final = os.path.join(save_dir, tag)
    old = os.path.join(save_dir, f".old.{tag}")
    if os.path.exists(final):  # re-saving a tag: the old one is moved aside, then dropped
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    write_atomic(os.path.join(save_dir, LATEST), tag)
    shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def record(path: str) -> dict:
    """{"size", "crc32"} of a written file, as zerodp.json keeps it."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": crc}
