"""What is imported when. A package's public names are imported from their modules on first use
(PEP 562), so that importing the package imports no torch and every command's --help answers before
torch loads. The optional dependencies: `pip install -e .` in zerodp's clone is the library (torch, pydantic,
safetensors, numpy); the commands' tables, progress bars and plots come with `zerodp[train]`, Hugging
Face models with `zerodp[hf]`; a command checks for what it needs before it starts (`require`), and
says what to install."""

from __future__ import annotations

import importlib
import importlib.util
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


EXTRA_OF = {"rich": "train", "tqdm": "train", "matplotlib": "train", "transformers": "hf"}


def require(command: str, *modules: str) -> None:
    """SystemExit naming the pip extra when one of `modules` is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        extras = ",".join(sorted({EXTRA_OF.get(m, "train") for m in missing}))
        raise SystemExit(f"{command} needs {', '.join(missing)}, which zerodp's extra [{extras}] installs: "
                         f"pip install -e '.[{extras}]' in zerodp's clone (zerodp is not on PyPI)")
