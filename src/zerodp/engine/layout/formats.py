"""Storage formats of parameters: which ones zerodp carries exactly, and the refusal of the others.

zerodp moves a parameter as the bytes of its `.data` (sharded, gathered, offloaded, saved: layout.Layout
lays out one flat group per storage dtype). That is exact for a plain tensor, a DTensor's local shard, and
bitsandbytes' `Params4bit` (QLoRA's NF4/FP4 base): its `.data` is the packed 4-bit words, in whatever
`bnb_4bit_quant_storage` dtype, and its quantisation state (`quant_state`: absmax, the code, the shape)
is an attribute of the parameter object, which zerodp never replaces, so it stays beside the words on
every rank, whole (an fp32 absmax per 64-weight block: 1/8 of the words' bytes, about 1/32 with
bnb_4bit_use_double_quant; not sharded: memory_report counts it as `quant_state`), and bitsandbytes writes
it into each state_dict.

Refused by name at initialize, on every rank before any collective:
  * a trained Params4bit: 4-bit words have no gradient; train adapters on it (LoRA) instead;
  * a Params4bit not quantized yet (no quant_state: quantized on its first move to an accelerator), or
    repacked for CPU inference (`packing_format_for_cpu`: an eval-mode forward before initialize), or
    one to be read from files (`weights=`, a model on meta), which zerodp's readers do not unpack;
  * bitsandbytes' `Int8Params` (LLM.int8): its quantisation state (CB, SCB) is rebuilt from `.data` when
    the parameter moves, so a shard or a gathered copy would not carry it;
  * any other tensor subclass with a storage of its own (`__torch_dispatch__`: torchao's quantized and
    float8 tensors, NF4Tensor, ...), whose `.data` bytes are not its values.

`keep_packing` turns off bitsandbytes' CPU repacking, which an eval-mode forward does to a 4-bit weight on a
CPU with AVX512-BF16 (it replaces the weight's `.data` with another layout, which a stage-3 shard cannot
follow); the weights then compute through bitsandbytes' general CPU kernel, in training and evaluation alike.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor


def is_params4bit(p: torch.Tensor) -> bool:
    """bitsandbytes' Params4bit, known without importing bitsandbytes."""
    return any(c.__name__ == "Params4bit" and c.__module__.startswith("bitsandbytes") for c in type(p).__mro__)


def quant_state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors of the 4-bit weights' quantisation states (absmax, the code, a double quantisation's own
    state2 and offset), each storage once: what a rank holds beside the packed words (memory_report)."""
    found: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        state = getattr(p, "quant_state", None) if is_params4bit(p) else None
        while state is not None:
            for t in vars(state).values():
                if isinstance(t, torch.Tensor):
                    found.setdefault(t.untyped_storage().data_ptr(), t)
            state = getattr(state, "state2", None)
    return list(found.values())


def check(module: nn.Module, trained: set[int], from_source: bool) -> None:
    """Raise ValueError naming the first parameter zerodp cannot carry exactly (see the module docstring).
    trained: ids of the trained parameters; from_source: values are read from weights or initialisers."""
    for name, p in module.named_parameters():
        reason = _refusal(p, id(p) in trained, from_source)
        if reason is not None:
            raise ValueError(f"parameter '{name}' is a {type(p).__module__}.{type(p).__qualname__}, {reason}")


def _refusal(p: torch.Tensor, trained: bool, from_source: bool) -> str | None:
    if is_params4bit(p):
        state = getattr(p, "quant_state", None)
        if trained:
            return ("a packed 4-bit weight with requires_grad=True: its words have no gradient; freeze it "
                    "(requires_grad_(False)) and train adapters on it (LoRA)")
        if from_source:
            return ("a packed 4-bit weight to be read from weights= or built on meta: zerodp reads packed words "
                    "only from a loaded model; load the base with from_pretrained(..., quantization_config=...)")
        if state is None:
            return ("not quantized yet (no quant_state: bitsandbytes quantizes on the move to the device); "
                    "move the model to its device, or load it with from_pretrained(..., quantization_config=...)")
        if getattr(state, "packing_format_for_cpu", False):
            return ("repacked for CPU inference by an eval-mode forward before initialize; build the model "
                    "again and call initialize before any eval-mode forward (zerodp then keeps it packed)")
        return None
    kind = type(p)
    if kind.__module__.startswith("bitsandbytes"):
        return (f"a bitsandbytes format zerodp does not carry: its quantisation state is rebuilt from .data when "
                "it moves, so a shard or a gathered copy would lose it; load the base in 4-bit (Params4bit, "
                "load_in_4bit=True) or in bf16")
    custom = kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
    if custom and not isinstance(p, (DTensor, FakeTensor)):
        return ("a tensor subclass with a storage of its own (__torch_dispatch__): zerodp moves a parameter as "
                "the bytes of its .data, which are not this one's values; refused rather than sharded wrong")
    return None


def keep_packing(module: nn.Module) -> None:
    """Turn off bitsandbytes' CPU repacking of 4-bit weights (see the module docstring)."""
    for m in module.modules():
        if hasattr(m, "support_avx512bf16_for_cpu") and type(m).__module__.startswith("bitsandbytes"):
            m.support_avx512bf16_for_cpu = False
