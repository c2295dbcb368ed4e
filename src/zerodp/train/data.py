"""Training data with no download: a corpus of tokens and reproducible per-rank batches.

The default corpus is the Python standard library's own source, read as bytes (vocabulary 256):
real text present on every machine, identical wherever the Python version is the same. A user's
text file or directory is read the same way; a nanoGPT-style `.bin` file of uint16 tokens is
memory-mapped.

Batches are drawn so that the global batch of a step depends only on (seed, step, global batch
size): rank r takes its rows of it. A run resumed on a different number of ranks, with the same
world_size * micro_batch_size, therefore continues with exactly the same data.
"""

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_MAX_BYTES = 8 * 2**20  # ~8M tokens: a few minutes of CPU training never repeats much
VAL_FRACTION = 0.05  # the tail of the corpus is held out for validation
VAL_SEED = 1234  # validation windows are fixed, whatever the training seed
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids (uint8 for bytes, uint16 for .bin files)
    val: np.ndarray
    vocab_size: int
    source: str  # where it came from, for logs


def load_corpus(
    source: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = VAL_FRACTION,
) -> Corpus:
    """Tokens to train on.

    source None: the standard library's .py files; a directory: its text files; a file ending in
    .bin: uint16 tokens (validation from a sibling val.bin when present); any other file: its bytes.
    Text is capped at max_bytes; a .bin file is memory-mapped whole.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if source is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        data = _concat(_stdlib_files(root), root, max_bytes)
        name = f"python stdlib ({root})"
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"data source {source!r} does not exist")
        if path.is_file() and path.suffix == ".bin":
            return _load_bin(path, val_fraction)
        files = _text_files(path) if path.is_dir() else [path]
        data = _concat(files, path if path.is_dir() else path.parent, max_bytes)
        name = str(path)
    if len(data) == 0:
        raise ValueError(f"corpus from {name} is empty")
    tokens = np.frombuffer(data, dtype=np.uint8)
    n_val = max(1, int(len(tokens) * val_fraction))
    return Corpus(train=tokens[:-n_val], val=tokens[-n_val:], vocab_size=256, source=name)


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune the walk
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _text_files(root: Path) -> list[Path]:
    """Regular files under root, hidden ones skipped, sorted; binary ones (a NUL byte in the
    first 8 KiB, git's rule) left out."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            path = Path(dirpath, f)
            if not f.startswith(".") and path.is_file():
                with open(path, "rb") as fh:
                    if b"\0" not in fh.read(8192):
                        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _concat(files: list[Path], root: Path, max_bytes: int) -> bytes:
    """The files' bytes, each after a header line naming it, cut at max_bytes."""
    parts, size = [], 0
    for path in files:
        header = f"\n# ==== {path.relative_to(root).as_posix()} ====\n".encode()
        parts += [header, path.read_bytes()]
        size += len(header) + len(parts[-1])
        if size >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def _load_bin(path: Path, val_fraction: float) -> Corpus:
    if path.stat().st_size == 0:
        raise ValueError(f"token file {path} is empty")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    val_path = path.with_name("val.bin")
    if val_path.exists() and val_path.resolve() != path.resolve():
        train, val = tokens, np.memmap(val_path, dtype=np.uint16, mode="r")
    else:
        n_val = max(1, int(len(tokens) * val_fraction))
        train, val = tokens[:-n_val], tokens[-n_val:]
    vocab_size = max(_max_token(train), _max_token(val)) + 1
    return Corpus(train=train, val=val, vocab_size=vocab_size, source=str(path))


def _max_token(tokens: np.ndarray, chunk: int = 2**26) -> int:
    # In chunks, so a file larger than memory is scanned without being loaded.
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))


class Batches:
    """Random windows of a token array: (x, y) int64 tensors of shape (micro_batch_size,
    block_size), y being x shifted one token ahead.

    Step k samples world_size * micro_batch_size window starts from a generator seeded with
    (seed, k); rank r takes rows r * micro_batch_size up to (r + 1) * micro_batch_size. The
    state is only (step, seed), so a resumed run picks up exactly where it stopped.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if len(tokens) < block_size + 1:
            raise ValueError(
                f"corpus has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}: "
                f"use a larger corpus or a smaller block_size"
            )
        if micro_batch_size < 1 or world_size < 1:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and world_size ({world_size}) must be >= 1"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.tokens = tokens
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.step = 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch of global step `step` (a pure function of seed and step)."""
        rng = np.random.default_rng([self.seed, step])
        n_windows = len(self.tokens) - self.block_size  # starts with a full window and its target
        starts = rng.integers(0, n_windows, size=self.world_size * self.micro_batch_size)
        mine = starts[self.rank * self.micro_batch_size : (self.rank + 1) * self.micro_batch_size]
        windows = self.tokens[mine[:, None] + np.arange(self.block_size + 1)].astype(np.int64)
        x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
        return x, y

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(self.step)
        self.step += 1
        return x, y

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])


def val_batches(
    tokens: np.ndarray,
    block_size: int,
    micro_batch_size: int,
    n: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of a fixed validation set: n global batches of the validation split,
    the same windows whatever the training seed and (for a fixed global batch) the world size."""
    batches = Batches(tokens, block_size, micro_batch_size, rank, world_size, seed=VAL_SEED)
    return [batches.batch(k) for k in range(n)]


def encode(text: str) -> torch.Tensor:
    """Byte-level token ids of text, shape (len,)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor | np.ndarray | list[int]) -> str:
    """Text of byte-level token ids; bytes that do not form UTF-8 become U+FFFD."""
    ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    return bytes(ids).decode("utf-8", errors="replace")
