"""The engine's facts have one owner: every Engine attribute is declared in Engine.__init__'s own body (as
FSDP2's FSDPParamGroup.__init__ declares its own), and the derived facts are one frozen EngineSpec made by
one local check (world of one, in-process)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import zerodp
from zerodp.engine.engine import inside
from oracle import Toy, one_group
from zerodp.engine import engine as engine_module

CFG = {"train_micro_batch_size_per_gpu": 2}


def declared_in_init() -> set[str]:
    """The names X of every `self.X = ...` (plain, annotated, chained or unpacked) in Engine.__init__."""
    tree = ast.parse(Path(engine_module.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names = set()
    for stmt in ast.walk(init):
        targets = (stmt.targets if isinstance(stmt, ast.Assign)
                   else [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            names |= {t.attr for t in ast.walk(target) if isinstance(t, ast.Attribute)
                      and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_engine_attribute_is_declared_in_init(stage):
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), {**CFG, "gradient_accumulation_steps": 2,
                                                         "zero_optimization": {"stage": stage}})
    for _ in range(2):  # a whole accumulation window and its step: nothing appears later either
        engine.backward(engine(torch.randn(2, 13), torch.randn(2, 5)))
    engine.step()
    assert engine.global_steps == 1
    undeclared = set(vars(engine)) - declared_in_init()
    assert not undeclared, f"Engine attributes first set outside __init__: {sorted(undeclared)}"


def test_the_engine_reads_its_facts_from_one_frozen_spec():
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), {**CFG, "gradient_accumulation_steps": 2,
                                                         "zero_optimization": {"stage": 3}})
    spec = inside(engine).spec
    assert (inside(engine).spec.stage, inside(engine).spec.gas, inside(engine).spec.shard_size, inside(engine).spec.dtype, inside(engine).spec.device, inside(engine).spec.units) == (
        spec.stage, spec.gas, spec.shard_size, spec.dtype, spec.device, spec.units)
    assert (spec.stage, spec.gas, spec.shard_size, spec.dtype, spec.device.type) == (3, 2, 1, torch.float32, "cpu")
    assert spec.units is not None and not spec.offload_param and spec.batch.train_batch_size == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.stage = 2


def test_each_slot_carries_its_parameters_tensor_parallel_facts_read_once_at_layout():
    """layout/flat.py's TpPlacement: made by placement_of when a parameter is laid out, read after by the norm's
    row flags, the owned-elements count and the whole-matrix gather instead of asking the parameter again."""
    from zerodp.engine.engine import inside
    from zerodp.engine.layout.flat import TpPlacement, placement_of

    plain, column, unsaid = (torch.nn.Parameter(torch.zeros(4, 6)) for _ in range(3))
    column.tensor_model_parallel, column.partition_dim = True, 0  # Megatron's column-parallel shard
    unsaid.model_parallel = True                                  # DeepSpeed's marking, no partition_dim
    assert placement_of(plain) == TpPlacement(duplicate=True)
    assert placement_of(column) == TpPlacement(duplicate=False, parts=1, dim=0)
    assert placement_of(unsaid) == TpPlacement(duplicate=False, parts=1, dim=None)
    model = Toy()
    engine = zerodp.initialize(model, one_group(model), {**CFG, "zero_optimization": {"stage": 2}})
    slots = [s for _, s in inside(engine).layout.slots()]
    assert slots and all(s.tp == placement_of(s.param) == TpPlacement() for s in slots)
