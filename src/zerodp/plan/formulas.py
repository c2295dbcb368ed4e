"""The paper's formulas, torch-free: what each rank holds by DESIGN.md's table, estimated, never measured
(engine/memory.py's `memory_report` measures; `zerodp estimate` puts the two side by side).

`formula(num_params, world, stage)` is the ZeRO paper's model-state table (Ψ parameters, N ranks, Adam):
stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N. `placed` splits it into device and
host memory (ZeRO-Offload, offload_param), `finetune` adds frozen parameters, `offload_split` is stage 3's
split, `bucket_estimate` the reduce-buffer pool, `activation_estimate` the activation side of the budget.
The engine's facts they read (the pool's buffers, pinned memory's rounding, the default bucket) are
zerodp/sizes.py's, which the engine reads too.
"""

from __future__ import annotations

from zerodp.sizes import POOL_BUFFERS, REDUCE_BUCKET_SIZE, pinned_bytes

GiB = 1024 ** 3
# Optimizer state bytes per parameter (fp32): Adam/AdamW keep m and v; the others one buffer.
STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "adagrad": 4, "rmsprop": 4}
WORKING_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def optimizer_bytes(optimizer: str, dtype: str, bf16_master: bool = False, bf16_states: bool = False) -> int:
    """K: master + optimizer-state bytes per parameter. fp32: the master is the working parameter (0). bf16
    masters (bf16.bf16_master_weights_and_grads) are the working value + a 16-bit remainder: 2 instead of 4;
    bf16 states (bf16.bf16_optimizer_states) halve the states: Adam 12 -> 10, 8 or 6."""
    states = STATE_BYTES[optimizer.lower()] // (2 if bf16_states else 1)
    return states + (0 if dtype == "fp32" else 2 if bf16_master else 4)


# ---- formula ------------------------------------------------------------------------------------
def formula(num_params: int, world: int, stage: int, dtype: str = "bf16", optimizer: str = "adam",
            gradient_accumulation_steps: int = 1, bf16_master: bool = False, bf16_states: bool = False) -> int:
    """Model-state bytes per rank by DESIGN.md's table (Ψ = num_params, N = world).

    Mixed precision (bf16/fp16): 2-byte params and grads, fp32 master + optimizer states (K = 12 for
    Adam). fp32: 4-byte params and grads, and the master *is* the params, so K = 8 for Adam; e.g.
    stage 2 is 4Ψ + 12Ψ/N. With gradient_accumulation_steps > 1 the engine accumulates gradients in
    fp32 (4 bytes), which this applies too. Padding and reduce buckets are not included. bf16_master and
    bf16_states: K from optimizer_bytes (bf16 only).
    """
    if dtype not in WORKING_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(WORKING_BYTES)}")
    if optimizer.lower() not in STATE_BYTES:
        raise ValueError(f"optimizer {optimizer!r}: expected one of {', '.join(STATE_BYTES)}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage {stage}: expected 0, 1, 2 or 3")
    p = WORKING_BYTES[dtype]
    g = 4 if gradient_accumulation_steps > 1 else p
    if (bf16_master or bf16_states) and dtype != "bf16":
        raise ValueError(f"bf16 masters and optimizer states need dtype bf16, not {dtype!r}")
    k = optimizer_bytes(optimizer, dtype, bf16_master, bf16_states)
    full = {0: p + g + k, 1: p + g, 2: p, 3: 0}[stage]
    part = {0: 0, 1: k, 2: g + k, 3: p + g + k}[stage]
    return round(num_params * (full + part / world))


def placed(num_params: int, world: int, stage: int, dtype: str = "bf16", optimizer: str = "adam",
           gradient_accumulation_steps: int = 1, offload_optimizer: bool = False,
           offload_param: bool = False, pin_memory: bool = False, bf16_states: bool = False,
           bf16_master: bool = False) -> dict[str, int]:
    """Model-state bytes per rank, split into what the device holds and what host memory holds (bf16_states,
    bf16_master: formula's; bf16 masters are refused with offload_optimizer, as by the engine).

    offload_optimizer (ZeRO-Offload, stages 0-3): the rank's fp32 master, its optimizer states and an
    fp32 copy of its gradient partition live in host memory: 16Ψ/N for Adam (4 + 8 + 4; the master
    is a separate copy even in fp32), Ψ/N -> Ψ in stage 0; in bf16/fp16 also a staging copy of the
    partition in the working dtype, which the device<->host copies go through (2Ψ/N): 18Ψ/N. The device keeps the working parameters and
    gradients: stage 2 in bf16 2Ψ + 2Ψ/N (DeepSpeed's estimator: 2Ψ; it leaves the gradient partition out).
    offload_param (stage 3, ZeRO-Infinity's CPU offload): the working parameter partition pΨ/N moves to
    host memory too; the device then holds only what is gathered for the module running (buckets).
    DeepSpeed's estimators multiply host memory by additional_buffer_factor=1.5 for pinned-buffer
    slack; this is the tensors' bytes, no factor, plus with `pin_memory` (offload_optimizer.pin_memory
    on an accelerator) what the host allocator rounds the pinned block (master, gradient, staging) up to.
    """
    if offload_optimizer and bf16_master:
        raise ValueError("bf16 masters with offload_optimizer: the engine refuses the two together")
    device = formula(num_params, world, stage, dtype, optimizer, gradient_accumulation_steps, bf16_master, bf16_states)
    host = 0
    n = world if stage > 0 else 1
    if offload_optimizer:
        k = optimizer_bytes(optimizer, dtype, bf16_states=bf16_states)  # master + states (fp32: master in params)
        device -= round(num_params * k / n)
        staging = 0 if dtype == "fp32" else WORKING_BYTES[dtype]
        states = optimizer_bytes(optimizer, "fp32", bf16_states=bf16_states)
        host += round(num_params * (states + 4 + 4 + staging) / n)
        block = round(num_params * (4 + 4 + staging) / n)
        host += pinned_bytes(block, pin_memory) - block
    if offload_param:
        if stage != 3:
            raise ValueError(f"offload_param needs stage 3 (parameters partitioned), not stage {stage}")
        moved = round(num_params * WORKING_BYTES[dtype] / world)
        device, host = device - moved, host + moved
    return {"device": device, "host": host}


def on_disk(num_params: int, world: int, stage: int, optimizer: str = "adam", sub_group_size: int = 100_000_000,
            buffer_count: int = 4) -> dict[str, int]:
    """offload_optimizer "nvme" (engine/stepping/disk.py), per rank: `disk`, the fp32 master and optimizer
    states of its 1/N (Adam 12Ψ/N; stage 0 the whole model's), as tensor bytes (the file rounds each bucket's
    slots up to 4096 bytes); `host_buffers`, the pool the step streams them through: buffer_count buffers of
    the largest sub-group, at most sub_group_size fp32 elements and at most the rank's partition (a bucket larger
    than sub_group_size is a sub-group of its own, which this leaves out); `traffic`, the bytes one step moves
    (the file read and written once)."""
    n = world if stage > 0 else 1
    disk = round(num_params * (4 + STATE_BYTES[optimizer.lower()]) / n)
    sub_group = min(sub_group_size, -(-num_params // n))
    return {"disk": disk, "host_buffers": 4 * sub_group * buffer_count, "traffic": 2 * disk}


def params_on_disk(num_params: int, world: int, dtype: str = "bf16", buffer_count: int = 5,
                   buffer_size: int = 100_000_000, gas: int = 1) -> dict[str, int]:
    """offload_param "nvme" (stage 3, engine/sharding/on_disk.py), per rank: `disk`, the working-precision
    parameter partition (2Ψ/N in bf16; the file rounds each bucket's shard up to 4096 bytes; max_in_cpu's shards,
    kept in host memory, are left out); `host_buffers`, buffer_count buffers of the largest shard on disk, at most
    buffer_size elements (here: at most the partition); `traffic`, the bytes one step moves: each shard read for
    the forward and again for the backward of every micro-step, and written once after the step."""
    disk = round(num_params * WORKING_BYTES[dtype] / world)
    shard = min(buffer_size, -(-num_params // world))
    return {"disk": disk, "host_buffers": WORKING_BYTES[dtype] * shard * buffer_count,
            "traffic": (2 * gas + 1) * disk}


def finetune(num_params: int, trainable: int, world: int, stage: int, dtype: str = "bf16", optimizer: str = "adam",
             gradient_accumulation_steps: int = 1, offload_optimizer: bool = False,
             offload_param: bool = False) -> dict[str, int]:
    """A fine-tune's bytes per rank (plan/finetune.py): `trainable` of the `num_params` elements trained,
    by placed(); the rest frozen, its working copy alone (no gradient, master or optimizer state): whole
    on every rank below stage 3, 1/N at stage 3 (which partitions frozen parameters too), in host memory
    with offload_param. Returns frozen, trained (device and host), device and host."""
    trained = placed(trainable, world, stage, dtype, optimizer, gradient_accumulation_steps, offload_optimizer,
                     offload_param)
    frozen = WORKING_BYTES[dtype] * (num_params - trainable)
    frozen = round(frozen / world) if stage == 3 else frozen
    return {"frozen": frozen, "trained": trained["device"] + trained["host"],
            "device": trained["device"] + (0 if offload_param else frozen),
            "host": trained["host"] + (frozen if offload_param else 0)}


def bucket_estimate(num_params: int, world: int, stage: int, dtype: str = "bf16",
                    reduce_bucket_size: int = REDUCE_BUCKET_SIZE, largest_module: int | None = None) -> int:
    """Bytes of stage 2-3's reduce-buffer pool while backward runs: at most sizes.POOL_BUFFERS buckets
    in the working dtype, never more than the whole model. A stage 2 bucket holds up to
    reduce_bucket_size elements; a stage 3 bucket is whole units, small ones coalesced up to that size,
    and the pool holds POOL_BUFFERS x reduce_bucket_size elements, or one bucket when a unit is larger
    (largest_module, when known). Stages 0-1 (and one rank) reduce in place in the gradient buffer:
    no pool."""
    if stage < 2 or world == 1:
        return 0
    pool = max(POOL_BUFFERS * reduce_bucket_size, largest_module or 0 if stage == 3 else 0)
    return min(pool, num_params) * WORKING_BYTES[dtype]


def offload_split(num_params: int, world: int, dtype: str = "bf16", optimizer: str = "adam",
                  gradient_accumulation_steps: int = 1, offload_optimizer: bool = False,
                  offload_param: bool = False) -> dict[str, int]:
    """Stage 3's model-state bytes per rank in device and host memory (placed() at stage 3). bf16 +
    Adam: none 16Ψ/N on the device; offload_param 14Ψ/N device + 2Ψ/N host; both 2Ψ/N device +
    20Ψ/N host (with the staging copy)."""
    return placed(num_params, world, 3, dtype, optimizer, gradient_accumulation_steps,
                  offload_optimizer, offload_param)


# ---- activation estimate, for `estimate --fit` and the train job's report ------------------------
def activation_estimate(cfg, micro_batch: int, seq: int, dtype: str = "bf16", checkpointing: bool = False,
                        tp: int = 1, vocab_parallel: bool = True, sequence_parallel: bool = False) -> int:
    """Activation bytes of one forward held for backward, per GPU, estimated (not measured).

    Korthikanti et al. 2022, eq. 2 in 16-bit without sequence parallelism: s·b·h·(10 + 24/tp) bytes per
    layer when attention scores are not materialised (fused SDPA), 34 s·b·h at tp = 1; with sequence
    parallelism (eq. 4) the norms' and dropouts' 10 s·b·h are split over tp too: 34 s·b·h / tp; plus the logits
    (16-bit, their fp32 copy for the loss and its grad), split over tp by a vocabulary-parallel head
    (`vocab_parallel`; zerodp's own GPT keeps its tied head whole on every tp rank).
    With checkpointing each layer keeps only its input (2·s·b·h) and one layer is live in recompute.
    """
    scale = WORKING_BYTES[dtype] / 2
    sbh = seq * micro_batch * cfg.n_embd
    layer = (34 / tp if sequence_parallel else 10 + 24 / tp) * sbh * scale
    logits = seq * micro_batch * cfg.vocab_size * (WORKING_BYTES[dtype] + 8) / (tp if vocab_parallel else 1)
    if checkpointing:  # (each layer's input: a sequence slice with sequence parallelism)
        return int(cfg.n_layer * 2 * sbh * scale / (tp if sequence_parallel else 1) + layer + logits)
    return int(cfg.n_layer * layer + logits)

