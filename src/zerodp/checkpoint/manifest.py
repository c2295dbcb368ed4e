"""zerodp.json: what it holds, by type and range, checked when it is written and when it is read.

One pydantic model, strict (a string is not a step count, `true` is not a stage) and closed (no
unknown keys), shared by the writer (files.finish validates the text it writes) and the reader
(read.resolve). A checkpoint whose zerodp.json does not fit is refused with the field, the value
and the file named, before any tensor file is opened.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zerodp.checkpoint.errors import CheckpointError

FORMAT = 1  # the layout of a checkpoint directory; a reader refuses any other
Count = Annotated[int, Field(ge=0)]  # a counter, a size, an index


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Counters(_Strict):
    global_steps: Count
    skipped_steps: Count
    micro_steps: Count


class TpShards(_Strict):
    """A tensor-parallel shard's placement: the axis its tp ranks' shards join along (None: the model did
    not say, e.g. Megatron's tensor_model_parallel without partition_dim) and each tp rank's shape."""

    dim: int | None = Field(ge=0)
    shapes: list[list[Count]]
    parts: int = Field(default=1, ge=1)  # flat.tp_parts: each shard holds its slice of each of `parts` parts


class ModelEntry(_Strict):
    """One state_dict entry of the saved model (pieces.signature). `shape` is the whole tensor's; a tp shard
    with no recorded axis has only its shards' (`tp`), and tp rank 0's stands there."""

    name: str
    kind: Literal["trained", "frozen", "buffer"]
    shape: list[Count]
    dtype: str
    alias_of: str | None
    group: int | None = Field(default=None, ge=0)
    tp: TpShards | None = None  # a tensor-parallel shard; absent: every tp rank holds the whole tensor
    # a frozen parameter stage 3 shards: saved as pieces `frozen/{name}@{start}`, not whole in `model/{name}`
    sharded: bool = False


class LayoutBucket(_Strict):
    group: Count
    numel: Count
    partitions: int = Field(ge=1)
    params: list[tuple[str, int, int]]


class FileRecord(_Strict):
    size: Count
    crc32: int = Field(ge=0, lt=2**32)


class HostRng(_Strict):
    python: tuple[int, list[int], float | None]
    numpy: tuple[str, list[int], int, int, float] | None = None


class CheckpointMeta(_Strict):
    format: Literal[FORMAT]
    tag: str
    # The run it belongs to (files.py); absent in a checkpoint saved before runs had names (files.UNNAMED).
    run: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
    world_size: int = Field(ge=1)  # the data-parallel ranks (what ZeRO shards over)
    tp: int = Field(default=1, ge=1)  # the tensor-parallel size; checkpoints from before tp have none: 1
    stage: int = Field(ge=0, le=3)
    dtype: Literal["torch.float32", "torch.bfloat16", "torch.float16"]
    counters: Counters
    loss_scaler: dict[str, bool | int | float]
    optimizer: str
    lr_scheduler: dict[str, Any] | None
    param_groups: list[dict[str, Any]]
    optim_scalars: dict[str, dict[str, Any]]
    client_state: Any
    config: dict[str, Any]
    model: list[ModelEntry]
    layout: list[LayoutBucket]
    rng: dict[str, HostRng] = {}
    files: dict[str, FileRecord]
    # Each parameter's own optimizer step count, when some were not stepped at every step (unused.py).
    step_counts: dict[str, Count] | None = None
    # Per param group, how its optimizer saw the parameters (engine/stepping/optimizer_view.py): "flat shards" keep
    # their state in pieces (optim/), "whole parameters" each parameter's state whole (optim_param/).
    optimizer_views: list[Literal["flat shards", "whole parameters"]] | None = None


def validate(text: str, where: str) -> dict:
    """The parsed zerodp.json `text` (from file `where`), checked; CheckpointError naming the field."""
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{where} cannot be read (not JSON: {e})") from None
    try:
        CheckpointMeta.model_validate_json(text)
    except ValidationError as e:
        raise CheckpointError(f"{where} is not a valid zerodp checkpoint description: "
                              f"{field_errors(e)}") from None
    return manifest


def field_errors(e: ValidationError, limit: int = 3) -> str:
    """'field a.b = value: reason' for the first few errors of `e`."""
    parts = []
    for err in e.errors()[:limit]:
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        value = repr(err["input"])
        value = value if len(value) <= 60 else value[:57] + "..."
        parts.append(f"field '{loc}' = {value}: {err['msg']}" if err["type"] != "missing"
                     else f"field '{loc}' is missing")
    more = len(e.errors()) - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
