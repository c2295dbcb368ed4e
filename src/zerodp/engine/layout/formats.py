"""Storage formats of parameters: which ones zerodp carries exactly, and the refusal of the others.

zerodp moves a parameter as the bytes of its `.data` (sharded, gathered, offloaded, saved: layout.Layout
lays out one flat group per storage dtype). That is exact for a plain tensor, a DTensor's local shard, and
bitsandbytes' `Params4bit` (QLoRA's NF4/FP4 base): its `.data` is the packed 4-bit words, in whatever
`bnb_4bit_quant_storage` dtype, and its quantisation state (`quant_state`: absmax, the code, the shape)
is an attribute of the parameter object, which zerodp never replaces, and bitsandbytes writes it into
each state_dict. Its per-block part (`block_state`: an fp32 absmax per 64-weight block, 1/8 of the words'
bytes; with bnb_4bit_use_double_quant a uint8 absmax and an fp32 nested absmax, about 1/32) is laid out at
stage 3 as frozen slots beside the words (`with_block_state`), in a flat group of its own dtype, and its
`.data` swapped like a parameter's: 1/N per rank, whole while its unit runs; the codes stay whole
(memory_report's `quant_state` counts both).

Refused by name at initialize, on every rank before any collective:
  * a trained Params4bit: 4-bit words have no gradient; train adapters on it (LoRA) instead;
  * a Params4bit not quantized yet (no quant_state: quantized on its first move to an accelerator), or
    repacked for CPU inference (`packing_format_for_cpu`: an eval-mode forward before initialize), or
    one to be read from files (`weights=`, a model on meta), which zerodp's readers do not unpack;
  * an `Int8Params` not quantized yet (not int8: quantized on the move to an accelerator), with
    has_fp16_weights=True (a float weight quantized anew on each forward), read from files, or outside a
    bitsandbytes Linear8bitLt (whose state zerodp points at the weight, below);
  * any other bitsandbytes parameter;
  * any other tensor subclass with a storage of its own (`__torch_dispatch__`: torchao's quantized and
    float8 tensors, NF4Tensor, ...), whose `.data` bytes are not its values.

bitsandbytes' `Int8Params` (LLM.int8, `load_in_8bit=True`; forward and LoRA backward run on a CPU): its
`.data` is the int8 matrix (CB) and its row scales (SCB, fp32: 4 bytes per row) sit beside it. A
Linear8bitLt computes from `module.state.CB`, a second reference it takes from the weight on its first
forward (and reads again in backward), and writes back into `weight.data` after each forward: held, it would
keep the whole matrix on every rank and read a released gather. `int8_follows_weight` makes that
reference the weight's own `.data`, whatever zerodp points it at (this rank's shard, a gathered bucket),
and keeps one SCB tensor on the weight and its state, which stage 3 shards like an absmax (`block_state`);
bitsandbytes writes it into each state_dict as before.

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


def is_int8params(p: torch.Tensor) -> bool:
    """bitsandbytes' Int8Params (LLM.int8), known without importing bitsandbytes."""
    return any(c.__name__ == "Int8Params" and c.__module__.startswith("bitsandbytes") for c in type(p).__mro__)


def quant_state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors of the quantised weights' states, each storage once: what a rank holds beside the packed
    words (memory_report): a 4-bit weight's absmax, code, a double quantisation's state2 and offset; an
    8-bit weight's row scales (SCB: one tensor on the weight and its layer's state, int8_follows_weight)."""
    found: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        state = getattr(p, "quant_state", None) if is_params4bit(p) else None
        while state is not None:
            for t in vars(state).values():
                if isinstance(t, torch.Tensor):
                    found.setdefault(t.untyped_storage().data_ptr(), t)
            state = getattr(state, "state2", None)
    for m in _int8_layers(module):
        for t in (m.state.SCB, m.weight.SCB):
            if t is not None:
                found.setdefault(t.untyped_storage().data_ptr(), t)
    return list(found.values())


def block_state(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(its key in m's state_dict, tensor) of the quantisation state of bitsandbytes layer m's weight that has one
    value per block of words: a 4-bit weight's absmax (and, with double quantisation, its nested state's absmax),
    an 8-bit weight's row scales (SCB). Sharded 1/N with the words at stage 3 and gathered with them. The tensors
    shared by all blocks (the code, a nested offset) are not listed: they stay whole. [] for any other module."""
    if _of_bitsandbytes(m, "Linear4bit") and is_params4bit(m.weight) and m.weight.quant_state is not None:
        state = m.weight.quant_state
        nested = [("weight.nested_absmax", state.state2.absmax)] if getattr(state, "nested", False) else []
        return [("weight.absmax", state.absmax), *nested]
    if _of_bitsandbytes(m, "Linear8bitLt") and is_int8params(m.weight) and hasattr(m, "state"):
        scales = m.weight.SCB if m.weight.SCB is not None else m.state.SCB  # the one int8_follows_weight keeps
        return [("SCB", scales)] if scales is not None else []
    return []


def named_block_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(state_dict name, tensor) of every bitsandbytes layer's block_state in `module`, each tensor once."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, m in module.named_modules():
        for key, t in block_state(m):
            found.setdefault(id(t), (f"{name}.{key}" if name else key, t))
    return list(found.values())


def with_block_state(module: nn.Module, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """`params`, each quantized weight followed by its block_state (so that a unit's tensors stay together in
    the layout's runs)."""
    beside = block_state_of(module)
    return [t for p in params for t in (p, *beside.get(id(p), ()))]


def block_state_of(module: nn.Module) -> dict[int, list[torch.Tensor]]:
    """id(quantized weight) -> its block_state tensors, for every bitsandbytes layer in `module` that has one."""
    out: dict[int, list[torch.Tensor]] = {}
    for m in module.modules():
        state = block_state(m)
        if state:
            out.setdefault(id(m.weight), [t for _, t in state])
    return out


def _of_bitsandbytes(m: nn.Module, name: str) -> bool:
    """Whether m is a bitsandbytes layer of class `name` (or a subclass), known without importing bitsandbytes."""
    return any(c.__name__ == name and c.__module__.startswith("bitsandbytes") for c in type(m).__mro__)


def _int8_layers(module: nn.Module) -> list[nn.Module]:
    """bitsandbytes' 8-bit layers (Linear8bitLt): an Int8Params weight and the state it computes from."""
    return [m for m in module.modules() if is_int8params(getattr(m, "weight", None)) and hasattr(m, "state")]


def int8_follows_weight(module: nn.Module) -> None:
    """Each 8-bit layer's `state.CB` made its weight's `.data`, read when bitsandbytes reads it; the weight's
    own reference to the whole matrix dropped (so that forward does not take it back into the state); the
    scales, one tensor, on both (bitsandbytes' load_state_dict copies into the weight's)."""
    for m in _int8_layers(module):
        state, weight = m.state, m.weight
        if weight.SCB is not None:  # no forward yet: the scales are on the weight
            state.SCB = weight.SCB
        weight.CB, weight.SCB = None, state.SCB
        if not isinstance(state, _Following):
            state.__dict__.pop("CB", None)
            state.__class__ = _following(type(state))
        state.weight = weight


class _Following:
    """A MatmulLtState whose CB is its weight's `.data` (int8_follows_weight); bitsandbytes' own writes of CB
    (a first forward's init_8bit_state, a reset) are the weight's already, or are dropped."""

    weight: nn.Parameter  # the Int8Params whose .data CB is

    @property
    def CB(self) -> torch.Tensor:  # noqa: N802 (bitsandbytes' name)
        return self.weight.data

    @CB.setter
    def CB(self, value: torch.Tensor | None) -> None:  # noqa: N802
        pass


_FOLLOWING: dict[type, type] = {}


def _following(kind: type) -> type:
    """The subclass of bitsandbytes' state class `kind` whose CB follows the weight, made once."""
    if kind not in _FOLLOWING:
        _FOLLOWING[kind] = type(f"Following{kind.__name__}", (_Following, kind), {})
    return _FOLLOWING[kind]


def check(module: nn.Module, trained: set[int], from_source: bool) -> None:
    """Raise ValueError naming the first parameter zerodp cannot carry exactly (see the module docstring).
    trained: ids of the trained parameters; from_source: values are read from weights or initialisers."""
    in_layers = {id(m.weight) for m in _int8_layers(module)}
    for name, p in module.named_parameters():
        reason = (_int8_refusal(p, from_source, id(p) in in_layers) if is_int8params(p)
                  else _refusal(p, id(p) in trained, from_source))
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
        return ("a bitsandbytes format zerodp does not carry (it knows Params4bit and Int8Params); load the "
                "base in 4-bit (load_in_4bit=True), 8-bit (load_in_8bit=True) or bf16")
    custom = kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
    if custom and not isinstance(p, (DTensor, FakeTensor)):
        return ("a tensor subclass with a storage of its own (__torch_dispatch__): zerodp moves a parameter as "
                "the bytes of its .data, which are not this one's values; refused rather than sharded wrong")
    return None


def _int8_refusal(p: torch.Tensor, from_source: bool, in_layer: bool) -> str | None:
    """(An int8 tensor cannot require grad: torch refuses it before zerodp sees it.)"""
    if from_source:
        return ("an 8-bit weight to be read from weights= or built on meta: zerodp reads int8 words only from "
                "a loaded model; load the base with from_pretrained(..., quantization_config=...)")
    if getattr(p, "has_fp16_weights", False):
        return ("an 8-bit layer's weight kept in floating point (has_fp16_weights=True), which bitsandbytes "
                "quantizes anew on each forward; load it with has_fp16_weights=False (BitsAndBytesConfig's default)")
    if p.dtype != torch.int8:
        return (f"not quantized yet ({p.dtype}: bitsandbytes quantizes on the move to the device); move the "
                "model to its device, or load it with from_pretrained(..., quantization_config=...)")
    if not in_layer:
        return ("an 8-bit weight outside a bitsandbytes Linear8bitLt, whose state zerodp points at the weight "
                "(formats.int8_follows_weight); use it through bitsandbytes' layer")
    return None


def keep_packing(module: nn.Module) -> None:
    """Turn off bitsandbytes' CPU repacking of 4-bit weights (see the module docstring)."""
    for m in module.modules():
        if hasattr(m, "support_avx512bf16_for_cpu") and type(m).__module__.startswith("bitsandbytes"):
            m.support_avx512bf16_for_cpu = False
