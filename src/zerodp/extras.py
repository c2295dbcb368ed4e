"""The optional dependencies: `pip install zerodp` is the library (torch, pydantic, safetensors,
numpy); the commands' tables, progress bars and plots come with `zerodp[train]`, Hugging Face models
with `zerodp[hf]`. A command checks for what it needs before it starts, and says what to install."""

from __future__ import annotations

import importlib.util

EXTRA_OF = {"rich": "train", "tqdm": "train", "matplotlib": "train", "transformers": "hf"}


def require(command: str, *modules: str) -> None:
    """SystemExit naming the pip extra when one of `modules` is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        extras = ",".join(sorted({EXTRA_OF.get(m, "train") for m in missing}))
        raise SystemExit(f"{command} needs {', '.join(missing)}, which `pip install zerodp` leaves out: "
                         f"pip install 'zerodp[{extras}]' (or, in a clone, pip install -e '.[{extras}]')")
