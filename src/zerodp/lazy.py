"""A package's public names imported from their modules on first use (PEP 562), so that importing the
package imports no torch and every command's --help answers before torch loads."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, names: dict[str, str], submodules: bool = False) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: `names[name]` is the submodule defining `name`, imported
    on first access and kept in the package's namespace. With `submodules`, any other name that is a
    submodule (e.g. `zerodp.activations` after a bare `import zerodp`) is imported too."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(f".{names[name]}", package), name)
        elif submodules:
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
