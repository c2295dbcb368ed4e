"""A rank's scratch file under an nvme_path, read and written with O_DIRECT: what both disk tiers share
(stepping/disk.py: the optimizer's masters and states, offload_optimizer "nvme"; sharding/on_disk.py: stage 3's
parameter shards, offload_param "nvme").

`ScratchFile` checks the directory and its free space, reserves the file's blocks up front (posix_fallocate: no
later write can fail for space) and removes its name as soon as it is open, so that the kernel frees its blocks
when the tier is collected or the process ends, however it ends. A transfer is cut into the `aio` section's
block_size requests, split into at most queue_depth runs on thread_count threads (os.preadv/os.pwritev release
the GIL); the buffers are `aligned_bytes`, whose addresses, offsets and lengths are multiples of 4096 bytes, as
O_DIRECT needs. A filesystem that refuses O_DIRECT (some network filesystems) is read through the page cache,
dropped after each transfer with posix_fadvise(DONTNEED).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

BLOCK = 4096  # O_DIRECT's alignment of offsets, lengths and addresses (every disk's logical block divides it)
_IOV_MAX = 1024  # buffers one preadv/pwritev call takes (Linux's IOV_MAX)


class DiskTierError(OSError):
    """A disk tier cannot be made or written, or a read stalled."""


class Aio(Protocol):
    """The `aio` section's keys a transfer follows (config.AioConfig)."""

    block_size: int  # bytes per request
    queue_depth: int  # runs of requests of one transfer in flight at once
    thread_count: int  # threads issuing requests
    single_submit: bool  # one system call per request rather than one per run


def round_up(nbytes: int) -> int:
    """nbytes rounded up to whole O_DIRECT blocks."""
    return -(-nbytes // BLOCK) * BLOCK


def aligned_bytes(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor of nbytes whose address is BLOCK-aligned (O_DIRECT's rule)."""
    raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % BLOCK
    return raw[start:start + nbytes]


class ScratchFile:
    """This rank's file under nvme_path, with O_DIRECT, its blocks reserved up front. Its name is removed as
    soon as it is open: the kernel frees its blocks when the last descriptor closes, which is when the tier is
    collected or the process ends, however it ends (an error, os._exit, a signal).

    key: the config key that names the directory (offload_optimizer.nvme_path), holds: what the file holds,
    suffix: the file name's ending; all three only name things in errors and listings."""

    def __init__(self, root: str, rank: int, nbytes: int, aio: Aio, key: str = "offload_optimizer.nvme_path",
                 holds: str = "fp32 masters and optimizer states", suffix: str = ".states"):
        check_directory(root, key)
        free = shutil.disk_usage(root).free
        if free < nbytes:
            raise DiskTierError(errno.ENOSPC, f"{key} {root!r} has {free:,} bytes free; rank {rank}'s {holds} need "
                                f"{nbytes:,}: free space there, or point {key.rsplit('.', 1)[-1]} at a larger disk")
        self.fd, path = tempfile.mkstemp(prefix=f"zerodp-rank{rank}-", suffix=suffix, dir=root)
        os.unlink(path)
        self.path = f"{path} (rank {rank}'s scratch file, removed from the directory once open)"
        self.nbytes, self.s = nbytes, aio
        self._close = weakref.finalize(self, os.close, self.fd)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_DIRECT)
            self.direct = True
        except OSError:  # a filesystem without O_DIRECT: the page cache dropped after each transfer instead
            self.direct = False
        try:
            os.posix_fallocate(self.fd, 0, max(nbytes, 1))  # no write can then fail for space
        except OSError as e:
            self._close()
            raise DiskTierError(e.errno, f"{key} {root!r}: reserving {nbytes:,} bytes for rank {rank}'s {holds} "
                                f"failed ({os.strerror(e.errno)}): free space there, or point "
                                f"{key.rsplit('.', 1)[-1]} at a larger disk") from e
        self.pool = ThreadPoolExecutor(aio.thread_count, thread_name_prefix="zerodp-disk")

    def transfer(self, write: bool, offset: int, buf: torch.Tensor) -> list[Future]:
        """Start reading (or writing) buf, a BLOCK-aligned uint8 tensor, at offset: block_size requests in at
        most queue_depth runs, on the pool's threads."""
        view = memoryview(buf.numpy())
        bs = self.s.block_size
        requests = [(offset + i, view[i:i + bs]) for i in range(0, len(view), bs)]
        per_run = -(-len(requests) // self.s.queue_depth)
        return [self.pool.submit(self._run, write, requests[i:i + per_run]) for i in range(0, len(requests), per_run)]

    def _run(self, write: bool, requests: list[tuple[int, memoryview]]) -> None:
        step = 1 if self.s.single_submit else _IOV_MAX
        for i in range(0, len(requests), step):
            batch = requests[i:i + step]
            want, offset = sum(len(v) for _, v in batch), batch[0][0]
            done = (os.pwritev if write else os.preadv)(self.fd, [v for _, v in batch], offset)
            if done != want:
                raise OSError(errno.EIO, f"{'wrote' if write else 'read'} {done} of {want} bytes at offset {offset}")
            if not self.direct:
                os.posix_fadvise(self.fd, offset, want, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._close()


def check_directory(root: str, key: str = "offload_optimizer.nvme_path") -> None:
    """A clear error unless root is a directory this process may create files in."""
    if not os.path.isdir(root):
        raise DiskTierError(errno.ENOENT, f"{key} {root!r} is not a directory: create it (on the disk for the "
                            f"tier) or point {key.rsplit('.', 1)[-1]} at one")
    if not os.access(root, os.W_OK | os.X_OK):
        raise DiskTierError(errno.EACCES, f"{key} {root!r} is not writable by this process (uid {os.getuid()}): "
                            "each rank creates its scratch file there")
