"""Weight files written one tensor at a time: the whole model is never in memory.

Both writers fix the file's layout from the names, shapes and dtypes first, then take each tensor's
values as they arrive (`put`), in any order, and write them in place:
  SafetensorsFile  the safetensors format (an 8-byte header length, the JSON header, the data):
                   the header is laid out as `safetensors.torch.save_file` lays it out (tensors by
                   dtype alignment, then name; offsets packed; padded with spaces to 8 bytes), so the
                   file is the one save_file writes from the same tensors; the values go at their
                   offsets with positioned writes.
  TorchSaveFile    `torch.save`'s format: torch.save itself writes the file from fake tensors with
                   `torch.serialization.skip_data` (storages laid out, bytes left empty); each value
                   then goes into its storage's zip record, and its CRC-32 into the record's two
                   headers, so the zip is as torch.save writes it. Names that share a tensor share
                   its storage, as torch.save keeps them.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable

import torch

# safetensors' dtype names, and its order of dtypes (the file holds the larger alignments first).
_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64",
          torch.int64: "I64"}
_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16",
          "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]


class _LaidOutFile:
    """What both writers share: the layout's names, shapes and dtypes (`shapes`), the check of each
    tensor put against it, and a close that names what was never written."""

    path: str | os.PathLike
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    pending: set[str]

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        shape, dtype = self.shapes[name]
        if tensor.shape != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor '{name}' is {tuple(tensor.shape)} {tensor.dtype}; "
                             f"{self.path} lays out {tuple(shape)} {dtype}")

    def close(self) -> None:
        self.file.close()
        if self.pending:
            missing = sorted(self.pending)
            raise ValueError(f"{self.path}: {len(missing)} tensor(s) never written, e.g. {', '.join(missing[:3])}")


class SafetensorsFile(_LaidOutFile):
    """One .safetensors file of `entries` (name -> (shape, dtype)); `put` each, then `close`."""

    def __init__(self, path: str | os.PathLike, entries: dict[str, tuple[torch.Size, torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        for name, (_, dtype) in entries.items():
            if dtype not in _NAMES:
                raise ValueError(f"tensor '{name}' has dtype {dtype}, which this writer does not store "
                                 f"(it stores {', '.join(str(d) for d in _NAMES)})")
        ordered = sorted(entries, key=lambda n: (-_ORDER.index(_NAMES[entries[n][1]]), n))
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name in ordered:
            shape, dtype = entries[name]
            end = offset + torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            self.offsets[name] = (offset, end)
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.shapes, self.start, self.pending = entries, 8 + len(text), set(entries)
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - open from here to close(), across the puts
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.file.truncate(self.start + offset)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        self._check(name, tensor)
        begin, _ = self.offsets[name]
        self.file.seek(self.start + begin)
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self.file.write(data.view(torch.uint8).numpy().data)
        self.pending.discard(name)



class TorchSaveFile(_LaidOutFile):
    """One torch.save file of a dict {name: tensor} (`shapes`: name -> (shape, dtype); `ties`:
    alias -> the name whose storage it shares); `put` each non-alias, then `close`."""

    def __init__(self, path: str | os.PathLike, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 ties: dict[str, str]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            skeleton = {n: torch.empty(s, dtype=d) for n, (s, d) in shapes.items() if n not in ties}
        for alias, name in ties.items():
            skeleton[alias] = skeleton[name]
        skeleton = {n: skeleton[n] for n in shapes}  # state_dict order, as torch.save(state) writes it
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, path)
        # torch.save numbers storages in the order it first meets them: the non-aliases in order.
        plain = [n for n in shapes if n not in ties]
        self.records = _records(path, [torch.Size(shapes[n][0]).numel() * shapes[n][1].itemsize for n in plain])
        self.names = dict(zip(plain, range(len(plain))))
        self.shapes, self.path, self.pending = shapes, path, set(plain)
        self.file = open(path, "r+b")  # noqa: SIM115 - open from here to close(), across the puts

    def put(self, name: str, tensor: torch.Tensor) -> None:
        self._check(name, tensor)
        data_at, local_crc, central_crc = self.records[self.names[name]]
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
        crc = struct.pack("<I", zlib.crc32(data))
        for offset, chunk in ((data_at, data), (local_crc, crc), (central_crc, crc)):
            self.file.seek(offset)
            self.file.write(chunk)
        self.pending.discard(name)



def _records(path: str | os.PathLike, sizes: list[int]) -> list[tuple[int, int, int]]:
    """For storage i of a torch.save zip (stored, uncompressed): (where its bytes start, where its
    local header's CRC-32 is, where its central directory entry's CRC-32 is)."""
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        infos = z.infolist()
        central, at = {}, z.start_dir
        for info in infos:  # central directory entries are consecutive, in this order
            central[info.filename] = at + 16
            at += 46 + len(info.orig_filename.encode()) + len(info.extra) + len(info.comment)
        archive = infos[0].filename.split("/")[0]
        out = []
        for i, size in enumerate(sizes):
            info = z.getinfo(f"{archive}/data/{i}")
            if info.file_size != size or info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{path}: storage {i} is laid out as {info.file_size} bytes, not {size}")
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
            out.append((info.header_offset + 30 + name_len + extra_len, info.header_offset + 14,
                        central[info.filename]))
        return out


def write_all(stream: Iterable[tuple[str, torch.Tensor]],
              routes: dict[str, list[tuple[SafetensorsFile | TorchSaveFile, str]]]) -> None:
    """Give each value of `stream` to every (file, name) its name routes to, then close every file.
    Names with no route are skipped (e.g. a tied alias a format does not store). A failed write
    still iterates the stream to its end, so that ranks sending it are not left waiting in a
    collective; the first error is raised then."""
    files = {id(f): f for targets in routes.values() for f, _ in targets}
    error: Exception | None = None
    for name, tensor in stream:
        if error is None:
            try:
                for file, key in routes.get(name, ()):
                    file.put(key, tensor)
            except (OSError, ValueError) as e:
                error = e
        del tensor  # before the stream makes its next bucket: one bucket alive at a time
    for f in files.values():
        try:
            f.close()
        except (OSError, ValueError) as e:
            error = error or e
    if error is not None:
        raise error
