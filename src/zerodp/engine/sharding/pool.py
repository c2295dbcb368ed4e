"""Where stage 3's gathered buckets get their memory: allocated once and lent, or resized per gather.

A gathered bucket keeps one storage object for its life (`Bucket.data`'s): the views of it that autograd
saved in a forward (a Linear's `weight.t()`) see the data again once the bucket is gathered back, so a
gather must give that same storage memory again, never point the bucket at another storage. Two ways,
chosen once by the device (`gather_memory`):

  `Pooled` (host memory: a CPU device)  slots allocated once and lent: a gather swaps a free slot's
           memory into the bucket's storage (`UntypedStorage._swap_data_ptr_`, the storage object stays),
           a release swaps it back. glibc would otherwise keep the buckets malloc'ed and freed at every
           gather in its heap once its dynamic mmap threshold rose past their size, and the rank's RSS
           grew to 3-4x its model states (issue 42); the pool holds the most buckets of each size ever
           gathered at once, and nothing is allocated per gather after the first step. The transport's
           own staging (gloo copies each all_gather through a flat buffer of the bucket's size, malloc'ed
           and freed every time) is outside zerodp: its freed pages go back to the system once per
           backward (`trim`, glibc's malloc_trim), so that the heap does not keep them.
  `Resized` (an accelerator; fake tensors)  storage resize_ to whole and back to 0: the caching
           allocator already reuses its blocks (a resize there takes a cached block and returns it), and
           plan/peak.py's MemTracker follows resizes on fake tensors, not swaps.

Either way a released bucket's storage holds no bytes: a stray read of a view saved from it fails instead
of reading another bucket's values. `renew` gives a bucket a new storage when a script may keep a view of
the old one (Gatherer.gathered_parameters): the old one stays with that view (or returns to the pool when
nothing holds it).
"""

from __future__ import annotations

import ctypes
import os

import torch

from zerodp.engine.layout.flat import Bucket

# glibc's malloc_trim(pad) (None elsewhere): free pages of every arena returned to the system
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if os.name == "posix" else None


def _nbytes(b: Bucket) -> int:
    return b.numel * b.data.element_size()


def _views(b: Bucket) -> list[torch.Tensor]:
    """Each slot's view of b.data, made while its storage is whole (flat.Bucket.views: why)."""
    return [b.data[s.offset:s.offset + s.numel].view(s.shape) for s in b.slots]


class Resized:
    """Gathered memory by storage resize_: allocated at each gather, freed at each release."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets  # every gathered bucket, whose storages are the memory held

    def fill(self, b: Bucket) -> None:
        storage = b.data.untyped_storage()
        if storage.nbytes() != _nbytes(b):  # (a resize reallocates and copies, even to the same size)
            storage.resize_(_nbytes(b))

    def empty(self, b: Bucket) -> None:
        b.data.untyped_storage().resize_(0)

    def renew(self, b: Bucket) -> None:
        """b gets a new storage (whole, its views made); the old one stays with whoever holds a view of it."""
        dtype, device = b.data.dtype, b.data.device
        b.data, b.views = None, []  # the last references this engine holds to the old storage
        b.data = torch.empty(b.numel, dtype=dtype, device=device)
        b.views = _views(b)

    def trim(self) -> None:
        """Nothing: the device's caching allocator keeps what it reuses."""

    def idle_bytes(self) -> int:
        """Bytes held for gathers that no bucket uses now: none (a release frees its memory)."""
        return 0


class Pooled:
    """Gathered memory lent from slots allocated once: a slot per bucket gathered at once, by size."""

    def __init__(self) -> None:
        self.free: dict[int, list[torch.UntypedStorage]] = {}  # nbytes -> slots lent to no bucket
        # bucket index -> the empty storage its slot's memory was swapped with (to swap it back)
        self.lent: dict[int, torch.UntypedStorage] = {}

    def fill(self, b: Bucket) -> None:
        storage, nbytes = b.data.untyped_storage(), _nbytes(b)
        if storage.nbytes() == nbytes:  # whole already (a persistent bucket refreshed, set-up's memory)
            return
        free = self.free.get(nbytes)
        slot = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, device=b.data.device).untyped_storage()
        storage._swap_data_ptr_(slot)
        self.lent[b.index] = slot

    def empty(self, b: Bucket) -> None:
        slot, storage = self.lent.pop(b.index, None), b.data.untyped_storage()
        if slot is None:  # memory of its own, from set-up (flat.FlatGroup.allocate): freed once
            storage.resize_(0)
            return
        storage._swap_data_ptr_(slot)
        self.free.setdefault(slot.nbytes(), []).append(slot)

    def renew(self, b: Bucket) -> None:
        """b gets a new storage (whole, its views made); the old one keeps its slot's memory while a view
        of it lives elsewhere (the slot leaves the pool), else the memory returns to the pool."""
        old, shell = b.data.untyped_storage(), self.lent.pop(b.index, None)
        dtype, device = b.data.dtype, b.data.device
        b.data, b.views = None, []  # the last references this engine holds to the old storage
        if shell is not None and torch._C._storage_Use_Count(old._cdata) == 1:  # only `old` holds it
            old._swap_data_ptr_(shell)
            self.free.setdefault(shell.nbytes(), []).append(shell)
        del old
        b.data = torch.empty(0, dtype=dtype, device=device)
        self.fill(b)  # a slot's memory in the new storage, then the tensor over it
        b.data = b.data.set_(b.data.untyped_storage(), 0, (b.numel,))
        b.views = _views(b)

    def trim(self) -> None:
        """(end of a backward) Hand the heap's free pages back to the system: the transport stages each
        gather in memory of its own (gloo's all_gather a flat output the size of the bucket, malloc'ed and
        freed every time), which glibc would otherwise keep, a little more each step."""
        if _malloc_trim is not None:
            _malloc_trim(0)

    def idle_bytes(self) -> int:
        """Bytes held for gathers that no bucket uses now: the free slots."""
        return sum(s.nbytes() for slots in self.free.values() for s in slots)


def gather_memory(device: torch.device, fake: bool, buckets: list[Bucket]) -> Pooled | Resized:
    """Pooled for host memory; Resized on an accelerator, whose caching allocator pools already, on fake
    tensors (`zerodp estimate`), whose tracker follows resizes, and with a torch that cannot swap a storage's
    memory (`_swap_data_ptr_`, in torch 2.13)."""
    swaps = hasattr(torch.UntypedStorage, "_swap_data_ptr_") and hasattr(torch._C, "_storage_Use_Count")
    return Pooled() if device.type == "cpu" and not fake and swaps else Resized(buckets)
