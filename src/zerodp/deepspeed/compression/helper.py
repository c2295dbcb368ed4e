"""`deepspeed.compression.helper`: get and set a model's attribute by its dotted name ("h.0.attn.c_attn")."""

from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """`model.h.0.attn` for "h.0.attn": getattr along the dotted name (a ModuleList's index is an attribute)."""
    node = model
    for part in module_name.split("."):
        node = getattr(node, part)
    return node


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set the last attribute of the dotted name on its parent: the module (or anything) it names is replaced."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)
