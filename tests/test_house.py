"""The house rules of src/zerodp, read from the source with `ast` (no zerodp module is imported):
no import circle between files or between the top-level packages, no function over 60 lines, no private
name taken through a package's __init__.py (its face) from outside the package, nor re-exported by one;
no folder with more than 15 modules directly, no module over 500 lines, the engine's rooms layered
(layout < tensor_parallel < setup < sharding < stepping < the engine's root, each importing only rooms
below it), every package's docstring naming its modules and sub-packages, and each adapter role (the engine as a
framework's model, optimizer or scheduler) defined once, in engine/faces.py.
(`--help` importing no torch is test_first_hour.py's first test.)

Every import counts: at module level, inside functions (a late import that dodges a circle at run time
is still one), and under `if TYPE_CHECKING:` (a module that names another's class in its types depends
on it: engine/sharding/weights.py typed its argument `Engine` while engine.py imported weights.py, issue 34). A
lazy PEP 562 name map is not an import by itself, but `from package import name` counts as an import of
the module the package's `_LAZY` map names for it. The package of a file is its top-level entry in
src/zerodp (`engine`, `cli`, ...), and zerodp/__init__.py is the package "zerodp".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FUNCTION_LINES = 60


# ---- reading the tree ---------------------------------------------------------------------------
def module_files(src: Path, root: str = "zerodp") -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under src/root (a package is its __init__)."""
    out = {}
    for path in sorted((src / root).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(node: ast.AST):
    """Every Import / ImportFrom under node: in functions and under `if TYPE_CHECKING:` too."""
    for child in ast.walk(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` loads, or its nearest enclosing package that exists; None outside the tree."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def lazy_maps(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """package -> {name: module} from a literal `_LAZY = {name: submodule}` in its __init__ (PEP 562):
    `from package import name` loads that module when it runs."""
    out = {}
    for name, path in modules.items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                    and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)):
                try:
                    out[name] = {k: f"{name}.{v}" for k, v in ast.literal_eval(node.value).items()}
                except ValueError:  # not a literal: its names are not followed
                    pass
    return out


def _targets(node: ast.Import | ast.ImportFrom, here: str, is_package: bool, modules: dict[str, Path],
             lazy: dict[str, dict[str, str]]):
    if isinstance(node, ast.Import):
        return [_resolve(a.name, modules) for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the package of `here`
        package = here if is_package else here.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    # `from pkg import mod` loads pkg.mod when it is a module, else takes a name from pkg (from the
    # module its lazy map names, when it has one: that module is what the import runs).
    return [_resolve(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else lazy.get(base, {}).get(a.name, base),
                     modules) for a in node.names]


def import_graph(src: Path, root: str = "zerodp") -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (itself excluded)."""
    modules = module_files(src, root)
    lazy = lazy_maps(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        found = {t for node in _imports(tree) for t in _targets(node, name, is_package, modules, lazy)}
        graph[name] = {t for t in found if t is not None and t != name}
    return graph


def package_graph(graph: dict[str, set[str]], root: str = "zerodp") -> dict[str, set[str]]:
    """The same graph between top-level entries: `zerodp.engine.layout.flat` -> `engine`, `zerodp` -> `zerodp`."""
    def top(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else root
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(top(module), set()).update(top(t) for t in targets if top(t) != top(module))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one node (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_in(c, graph) for c in components]


def _path_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A closed path a -> ... -> a through the component, found by breadth-first search from its first node."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def long_functions(src: Path, root: str = "zerodp", limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:line name (n lines)' for every function or method longer than limit lines."""
    out = []
    for path in sorted((src / root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - first + 1
                if n > limit:
                    out.append(f"{path.relative_to(src)}:{node.lineno} {node.name} ({n} lines)")
    return out


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _is_face(module: str, modules: dict[str, Path]) -> bool:
    """Whether `module` is a package of the tree: its __init__.py is the package's face."""
    return module in modules and modules[module].name == "__init__.py"


def _private_from_faces(tree: ast.AST, here: str | None, is_package: bool, modules: dict[str, Path]):
    """(line, face, name) for each underscore name this file takes from a package face it is outside of:
    `from pkg import _x` (relative too) and `pkg._x` written out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and here is not None:
                package = here if is_package else here.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            found = [(node.lineno, base, a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and (dotted := _dotted(node)):
            found = [(node.lineno, dotted.rpartition(".")[0], node.attr)]
        else:
            continue
        for line, face, name in found:
            outside = here is None or (here != face and not here.startswith(face + "."))
            if (_is_face(face, modules) and name.startswith("_") and not name.startswith("__")
                    and f"{face}.{name}" not in modules and outside):
                yield line, face, name


def private_names_through_faces(src: Path, others: list[Path], root: str = "zerodp") -> list[str]:
    """'file:line _name from package' for every underscore name a module outside a package of src/root
    imports from that package's __init__.py (its face), in src/root and in the files `others`: a private
    helper is imported from the module that defines it, or made public."""
    modules = module_files(src, root)
    files = [(name, path) for name, path in modules.items()] + [(None, path) for path in others]
    out = []
    for here, path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, face, name in _private_from_faces(tree, here, path.name == "__init__.py", modules):
            shown = path.relative_to(src) if path.is_relative_to(src) else path.relative_to(src.parent)
            out.append(f"{shown}:{line} {name} from {face}")
    return out


def private_reexports(src: Path, root: str = "zerodp") -> list[str]:
    """'file:line _name' for every underscore name an __init__.py imports with `# noqa: F401` (a re-export
    the linter was told to keep) or lists in __all__: a face names public things only."""
    out = []
    for path in sorted((src / root).rglob("__init__.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                noqa = any("noqa: F401" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1))
                names = [a.asname or a.name for a in node.names] if noqa else []
            elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                       for t in node.targets)):
                names = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
            else:
                continue
            out += [f"{path.relative_to(src)}:{node.lineno} {n}" for n in names
                    if isinstance(n, str) and n.startswith("_") and not n.startswith("__")]
    return out


# The engine's parts, and their owners: the sharded module builds its gatherer, state-dict hooks and buffer sync,
# the training part its optimizer, reducer and trackers and drives the sharded part's gatherer through backward and
# step, and engine.py ties the two. Everything else reads them through `inside(engine)` (engine.py): the layout, the
# spec and the two parts' own methods, so that the parts can change without their readers.
ENGINE_PARTS = {"partitioned_optimizer", "reducer", "gatherer", "used_only", "gathered_state", "forward_order",
                "buffer_sync"}
ENGINE_OWNERS = {"engine/engine.py", "engine/sharding/module.py", "engine/stepping/training.py"}


def engine_part_chains(src: Path, root: str = "zerodp", owners: set[str] = ENGINE_OWNERS) -> list[str]:
    """'file:line x.part' for every reach into one of the engine's parts outside its owners: an attribute
    `.partitioned_optimizer` / `.reducer` / `.gatherer` of anything but `self` (an object's own part of
    that name is its business), or getattr(x, "part")."""
    out = []
    for path in sorted((src / root).rglob("*.py")):
        if path.relative_to(src / root).as_posix() in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                out.append(f"{path.relative_to(src)}:{node.lineno} {_dotted(node) or '(...).' + node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value in ENGINE_PARTS):
                out.append(f"{path.relative_to(src)}:{node.lineno} getattr(..., {node.args[1].value!r})")
    return out


# The engine's internals, by module: the names a package above the engine may import from each.
ENGINE_INTERNALS = {"engine.stepping.reducer": set(), "engine.stepping.optimizer": {"OptimizerLike"}}


def internals_imported_from_above(src: Path, root: str = "zerodp", above: set[str] | None = None) -> list[str]:
    """'file:line module.name' for every import of an engine internal (ENGINE_INTERNALS) by a module of a
    package above the engine (every top-level entry but engine and what it stands on, by default)."""
    above = ABOVE_THE_ENGINE if above is None else above
    internals = {f"{root}.{m}": names for m, names in ENGINE_INTERNALS.items()}
    out = []
    for name, path in module_files(src, root).items():
        parts = name.split(".")
        if (parts[1] if len(parts) > 1 else root) not in above:
            continue
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found = [(a.name, "*") for a in node.names if a.name in internals]
            elif node.module in internals:
                found = [(node.module, a.name) for a in node.names if a.name not in internals[node.module]]
            else:
                found = [(f"{node.module}.{a.name}", "*") for a in node.names if f"{node.module}.{a.name}" in internals]
            out += [f"{path.relative_to(src)}:{node.lineno} {m}.{n}" for m, n in found]
    return out


# ---- sizes, rooms and package docstrings ---------------------------------------------------------
MAX_FOLDER_MODULES = 15
MAX_MODULE_LINES = 500
# Modules allowed over MAX_MODULE_LINES: none (engine/engine.py was, until issue 40 split it).
LONG_MODULES_ALLOWED: set[str] = set()
# The engine's rooms, bottom to top; a module of the engine's root (engine.py, decide.py, ...) is above them all.
ENGINE_ROOMS = ("layout", "tensor_parallel", "setup", "sharding", "stepping")


def crowded_folders(src: Path, root: str = "zerodp", limit: int = MAX_FOLDER_MODULES) -> list[str]:
    """'folder (n modules)' for every folder under src/root with more than `limit` .py files directly in it
    (__init__.py and __main__.py count)."""
    folders = sorted({p.parent for p in (src / root).rglob("*.py")})
    return [f"{d.relative_to(src).as_posix()} ({n} modules)" for d in folders
            if (n := len(list(d.glob("*.py")))) > limit]


def long_modules(src: Path, root: str = "zerodp", limit: int = MAX_MODULE_LINES,
                 allowed: set[str] = LONG_MODULES_ALLOWED) -> list[str]:
    """'file (n lines)' for every module over `limit` lines but the `allowed` ones (paths under src/root)."""
    out = []
    for path in sorted((src / root).rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit and path.relative_to(src / root).as_posix() not in allowed:
            out.append(f"{path.relative_to(src).as_posix()} ({n} lines)")
    return out


def _room(module: str, root: str) -> int | None:
    """The engine room of a module, by ENGINE_ROOMS' order (the root's modules above them); None outside."""
    parts = module.split(".")
    if parts[:2] != [root, "engine"]:
        return None
    return ENGINE_ROOMS.index(parts[2]) if len(parts) > 2 and parts[2] in ENGINE_ROOMS else len(ENGINE_ROOMS)


def upward_room_imports(src: Path, root: str = "zerodp") -> list[str]:
    """'file:line module -> module' for every import by a module of one engine room of a module of a room
    above it (every import counts, as in import_graph). The engine's package face is the root's."""
    modules = module_files(src, root)
    lazy = lazy_maps(modules)
    out = []
    for name, path in modules.items():
        here = _room(name, root)
        if here is None:
            continue
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            for target in _targets(node, name, is_package, modules, lazy):
                there = None if target is None else _room(target, root)
                if there is not None and there > here:
                    out.append(f"{path.relative_to(src).as_posix()}:{node.lineno} {name} -> {target}")
    return out


def undocumented_modules(src: Path, root: str = "zerodp") -> list[str]:
    """'package: name' for every module (`x.py`) and sub-package (`x/`) directly in a package that its
    __init__.py's docstring does not name."""
    out = []
    for init in sorted((src / root).rglob("__init__.py")):
        folder = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text(), filename=str(init)), clean=False) or ""
        names = [p.name for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
        names += [p.name + "/" for p in sorted(folder.iterdir()) if (p / "__init__.py").is_file()]
        out += [f"{folder.relative_to(src).as_posix()}: {n}" for n in names if n not in doc]
    return out


def _describe(found: list[list[str]]) -> str:
    return "; ".join(" -> ".join(c) for c in found)


# ---- the rules ----------------------------------------------------------------------------------
def test_no_import_circle_between_files():
    found = cycles(import_graph(SRC))
    assert not found, f"import circle(s) between files: {_describe(found)}"


def test_no_import_circle_between_packages():
    found = cycles(package_graph(import_graph(SRC)))
    assert not found, f"import circle(s) between the top-level packages of src/zerodp: {_describe(found)}"


# DESIGN.md's layers: commands -> compatibility layers -> checkpoint / plan / models -> engine -> config,
# distributed. The engine reaches what sits above it only through what it is handed (checkpoint_io).
ABOVE_THE_ENGINE = {"zerodp", "checkpoint", "plan", "models", "train", "bench", "deepspeed", "integrations", "cli"}


def test_the_engine_imports_nothing_above_it():
    above = package_graph(import_graph(SRC))["engine"] & ABOVE_THE_ENGINE
    assert not above, f"the engine package imports {sorted(above)}, which sit above it (DESIGN.md's layers)"


def test_no_function_over_60_lines():
    found = long_functions(SRC)
    assert not found, "functions over 60 lines: " + ", ".join(found)


def test_nothing_reaches_into_the_engines_parts():
    found = engine_part_chains(SRC)
    assert not found, ("the engine's parts reached into outside engine.py (use engine.layout or a public method of "
                       "the engine, adding one if it is missing): " + ", ".join(found))


def test_nothing_above_the_engine_imports_its_internals():
    found = internals_imported_from_above(SRC)
    assert not found, "engine internals imported from above the engine: " + ", ".join(found)


def _outside_files() -> list[Path]:
    """tests/ and benchmarks/: they use the package as a user would, through its faces."""
    repo = SRC.parent
    return sorted(p for d in ("tests", "benchmarks") for p in (repo / d).rglob("*.py"))


def test_no_private_name_through_a_package_face():
    found = private_names_through_faces(SRC, _outside_files())
    assert not found, ("private names imported through a package's __init__.py from outside the package (import "
                       "them from their module, or make them public): " + ", ".join(found))


def test_no_package_face_reexports_a_private_name():
    found = private_reexports(SRC)
    assert not found, "__init__.py re-exports private names (noqa: F401 or __all__): " + ", ".join(found)


def test_no_folder_holds_more_than_15_modules():
    found = crowded_folders(SRC)
    assert not found, (f"folders with more than {MAX_FOLDER_MODULES} modules directly (merge, or give a concern its "
                       "own subfolder): " + ", ".join(found))


def test_no_module_over_500_lines():
    found = long_modules(SRC)
    assert not found, f"modules over {MAX_MODULE_LINES} lines (split by concern): " + ", ".join(found)


def test_the_engines_rooms_import_only_rooms_below_them():
    found = upward_room_imports(SRC)
    assert not found, (f"an engine room imports a room above it ({' < '.join(ENGINE_ROOMS)} < the root; move "
                       "the type or helper down to the lowest room that needs it): " + ", ".join(found))


def test_every_package_docstring_names_its_modules():
    found = undocumented_modules(SRC)
    assert not found, ("package __init__.py docstrings that do not name a module or sub-package of theirs (one "
                       "line each on what it owns): " + ", ".join(found))


# ---- the checker finds what it is there to find --------------------------------------------------
def _write(src: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_reports_a_circle_added_back(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "",
        "pkg/a/x.py": "from pkg.b.y import f\n",
        "pkg/b/__init__.py": "",
        # inside a function, as a late import that dodges a circle would be
        "pkg/b/y.py": "def f():\n    from pkg.a import x\n    return x\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert cycles(graph) == [["pkg.a.x", "pkg.b.y", "pkg.a.x"]]
    assert cycles(package_graph(graph, "pkg")) == [["a", "b", "a"]]


def test_checker_reports_a_circle_through_a_type_checking_import(tmp_path):
    """The form engine.py <-> weights.py took (issue 34): a module the engine imports names the engine's
    class in its types only, under `if TYPE_CHECKING:`, and calls its methods."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/engine/__init__.py": "",
        "pkg/engine/engine.py": "from pkg.engine.weights import engine_weights\nclass Engine: ...\n",
        "pkg/engine/weights.py": ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from pkg.engine.engine import Engine\n"
                                  "def engine_weights(engine: Engine):\n    return engine.full_master(0)\n"),
    })
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.engine.engine", "pkg.engine.weights",
                                                       "pkg.engine.engine"]]


def test_checker_reports_a_package_circle_through_the_root(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "def initialize():\n    from pkg.engine.core import Engine\n",
        "pkg/engine/__init__.py": "",
        "pkg/engine/core.py": "from pkg.hf.trainer import T\n",
        "pkg/hf/__init__.py": "",
        "pkg/hf/trainer.py": "from pkg import initialize\nT = 1\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert cycles(package_graph(graph, "pkg")) == [["engine", "hf", "pkg", "engine"]]


def test_checker_follows_a_name_through_a_lazy_map(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": '_LAZY = {"Engine": "engine.core"}\n',
        "pkg/engine/__init__.py": "",
        "pkg/engine/core.py": "from pkg.ckpt.save import save\n",
        "pkg/ckpt/__init__.py": "",
        "pkg/ckpt/save.py": "from pkg import Engine\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.ckpt.save"] == {"pkg.engine.core"}
    assert cycles(graph) == [["pkg.ckpt.save", "pkg.engine.core", "pkg.ckpt.save"]]


def test_checker_reports_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/m.py": f"def short():\n    pass\n\n\ndef long():\n{body}"})
    assert long_functions(tmp_path, "pkg") == [f"pkg/m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_checker_reports_a_private_name_through_a_face(tmp_path):
    _write(tmp_path, {
        "src/pkg/__init__.py": "",
        "src/pkg/config/__init__.py": ("from pkg.config.base import _Section  # noqa: F401\n"
                                       "from pkg.config.base import Public\n"),
        "src/pkg/config/base.py": "class _Section: ...\nclass Public: ...\n",
        "src/pkg/config/schema.py": "from pkg.config import _Section\n",  # inside the package: its own business
        "src/pkg/engine/__init__.py": "__all__ = ['run', '_hidden']\n",
        "src/pkg/engine/core.py": ("from pkg.config import Public, _Section\n"
                                   "from pkg.config.base import _Section as S\n"),  # from its module: fine
        "src/pkg/engine/late.py": "def f():\n    from ..config import _Section\n",
        "src/pkg/engine/dotted.py": "import pkg.config\nX = pkg.config._Section\n",
        "tests/test_x.py": "from pkg.config import _Section\n",
    })
    src = tmp_path / "src"
    found = private_names_through_faces(src, [tmp_path / "tests/test_x.py"], "pkg")
    assert sorted(found) == [
        "pkg/engine/core.py:1 _Section from pkg.config", "pkg/engine/dotted.py:2 _Section from pkg.config",
        "pkg/engine/late.py:2 _Section from pkg.config", "tests/test_x.py:1 _Section from pkg.config"]
    assert private_reexports(src, "pkg") == ["pkg/config/__init__.py:1 _Section", "pkg/engine/__init__.py:1 _hidden"]


def test_checker_reports_a_chain_into_the_engines_parts(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/engine/__init__.py": "",
        "pkg/engine/engine.py": "class Engine:\n    def f(self, engine):\n        return engine.reducer.on_new_buffer\n",
        "pkg/engine/order.py": "class Order:\n    def f(self):\n        return self.partitioned_optimizer.buckets\n",
        "pkg/checkpoint/save.py": ("def save(engine):\n    part = engine.partitioned_optimizer\n"
                                   "    return part.masters, engine.engine.gatherer, getattr(engine, 'reducer', None)\n"),
        "pkg/plan/peak.py": "def label(engine):\n    return engine.layout.buckets, engine.master_shards()\n",
    })
    assert engine_part_chains(tmp_path, "pkg") == [
        "pkg/checkpoint/save.py:2 engine.partitioned_optimizer", "pkg/checkpoint/save.py:3 engine.engine.gatherer",
        "pkg/checkpoint/save.py:3 getattr(..., 'reducer')"]


def test_checker_reports_an_engine_internal_imported_from_above(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.engine.stepping.optimizer import OptimizerLike\n",
        "pkg/engine/__init__.py": "",
        "pkg/engine/stepping/__init__.py": "",
        "pkg/engine/memory.py": "from pkg.engine.stepping.reducer import POOL_BUFFERS\n",  # inside the engine: its own
        "pkg/engine/stepping/optimizer.py": "OptimizerLike = object\nclass PartitionedOptimizer: ...\n",
        "pkg/engine/stepping/reducer.py": "POOL_BUFFERS = 3\n",
        "pkg/plan/__init__.py": "",
        "pkg/plan/peak.py": "from pkg.engine.stepping.reducer import POOL_BUFFERS\nfrom pkg.engine.stepping import optimizer\n",
        "pkg/checkpoint/__init__.py": "",
        "pkg/checkpoint/apply.py": "def f():\n    from pkg.engine.stepping.optimizer import OptimizerLike, PartitionedOptimizer\n",
    })
    found = internals_imported_from_above(tmp_path, "pkg", {"pkg", "plan", "checkpoint"})
    assert sorted(found) == ["pkg/checkpoint/apply.py:2 pkg.engine.stepping.optimizer.PartitionedOptimizer",
                             "pkg/plan/peak.py:1 pkg.engine.stepping.reducer.POOL_BUFFERS",
                             "pkg/plan/peak.py:2 pkg.engine.stepping.optimizer.*"]


def test_checker_reports_a_crowded_folder(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", **{f"pkg/full/m{i}.py": "" for i in range(MAX_FOLDER_MODULES)},
                      "pkg/full/__init__.py": "", **{f"pkg/ok/m{i}.py": "" for i in range(MAX_FOLDER_MODULES)}})
    assert crowded_folders(tmp_path, "pkg") == [f"pkg/full ({MAX_FOLDER_MODULES + 1} modules)"]


def test_checker_reports_a_long_module(tmp_path):
    body = "x = 1\n" * (MAX_MODULE_LINES + 1)
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/long.py": body, "pkg/engine/engine.py": body,
                      "pkg/fits.py": "x = 1\n" * MAX_MODULE_LINES})
    assert long_modules(tmp_path, "pkg") == [f"pkg/engine/engine.py ({MAX_MODULE_LINES + 1} lines)",
                                             f"pkg/long.py ({MAX_MODULE_LINES + 1} lines)"]
    assert long_modules(tmp_path, "pkg", allowed={"engine/engine.py"}) == [f"pkg/long.py ({MAX_MODULE_LINES + 1} lines)"]


def test_checker_reports_an_import_up_the_engines_rooms(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/engine/__init__.py": "", "pkg/engine/layout/__init__.py": "",
        "pkg/engine/setup/__init__.py": "", "pkg/engine/stepping/__init__.py": "",
        # the form EngineSpec would take typing a field with set-up's class, under TYPE_CHECKING
        "pkg/engine/layout/spec.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from pkg.engine.setup.fill import Filling\n"),
        "pkg/engine/setup/fill.py": "from pkg.engine.layout.spec import X\nclass Filling: ...\n",  # down: fine
        "pkg/engine/stepping/reducer.py": "def f():\n    from pkg.engine import decide\n",  # to the root: up
        "pkg/engine/decide.py": "from pkg.engine.stepping import reducer\n",  # the root imports any room
    })
    assert sorted(upward_room_imports(tmp_path, "pkg")) == [
        "pkg/engine/layout/spec.py:3 pkg.engine.layout.spec -> pkg.engine.setup.fill",
        "pkg/engine/stepping/reducer.py:2 pkg.engine.stepping.reducer -> pkg.engine.decide"]


def test_checker_reports_a_module_its_package_docstring_leaves_out(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": '"""The package.\n\n  a.py  what a owns.\n  sub/  what sub owns.\n"""\n',
        "pkg/a.py": "", "pkg/b.py": "", "pkg/sub/__init__.py": "", "pkg/sub/c.py": "", "pkg/data/d.py": "",
    })
    assert undocumented_modules(tmp_path, "pkg") == ["pkg: b.py", "pkg/sub: c.py"]


@pytest.mark.parametrize("rule", ["circle", "long", "face"])
def test_the_rules_hold_on_a_clean_tree(tmp_path, rule):
    _write(tmp_path, {"pkg/__init__.py": "from pkg.b import f\n__all__ = ['f']\n", "pkg/a.py": "import pkg.b\n",
                      "pkg/b.py": "def f():\n    return 1\n"})
    if rule == "circle":
        assert cycles(import_graph(tmp_path, "pkg")) == []
    elif rule == "long":
        assert long_functions(tmp_path, "pkg") == []
    else:
        assert private_names_through_faces(tmp_path, [], "pkg") == [] and private_reexports(tmp_path, "pkg") == []


# ---- decisions named once ------------------------------------------------------------------------
# The ZeRO stage is compared with a number only where the named facts are derived from it (EngineSpec's
# properties and the local check that builds the spec); config/ (the keys as written) and plan/ (the paper's
# table, by stage) read the number itself. Everything else asks a named fact: spec.gathers_per_unit,
# spec.keeps_gradient_shard, spec.shards_optimizer, ... (a DeepSpeed getter may return the number, unread).
STAGE_DECIDERS = {"engine/layout/spec.py", "engine/decide.py"}
STAGE_READERS = ("config/", "plan/")


def _is_stage(node: ast.expr) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name == "stage" or name.endswith("_stage")


def _is_number(node: ast.expr) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_number(e) for e in node.elts)
    return isinstance(node, ast.Constant) and type(node.value) is int


def stage_comparisons(src: Path, root: str = "zerodp") -> list[str]:
    """'file:line comparison' for every ZeRO stage compared with a number outside the deciding modules."""
    out = []
    for path in sorted((src / root).rglob("*.py")):
        rel = path.relative_to(src / root).as_posix()
        if rel in STAGE_DECIDERS or rel.startswith(STAGE_READERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_is_stage(a) for a in sides) and any(_is_number(a) for a in sides):
                    out.append(f"{path.relative_to(src)}:{node.lineno} {ast.unparse(node)}")
    return out


def test_the_stage_number_is_compared_only_where_the_facts_are_decided():
    found = stage_comparisons(SRC)
    assert not found, ("a ZeRO stage compared with a number outside the modules that decide the named facts (ask "
                       "EngineSpec's facts, adding one if it is missing): " + ", ".join(found))


def test_checker_reports_a_stage_comparison_planted_outside_the_deciders(tmp_path):
    _write(tmp_path, {
        "pkg/engine/decide.py": "def f(stage):\n    return stage == 3\n",  # the decider may
        "pkg/plan/tables.py": "def f(stage):\n    return stage > 0\n",        # the planner reads the number
        "pkg/integrations/trl.py": "def f(engine):\n    if engine.spec.stage >= 2:\n        return 1\n",
        "pkg/checkpoint/ds.py": "def f(zero_stage):\n    return zero_stage in (1, 2)\n",
        "pkg/checkpoint/ok.py": "def f(spec):\n    return spec.gathers_per_unit\n",
    })
    assert stage_comparisons(tmp_path, "pkg") == ["pkg/checkpoint/ds.py:2 zero_stage in (1, 2)",
                                                  "pkg/integrations/trl.py:2 engine.spec.stage >= 2"]


# ---- one adapter ---------------------------------------------------------------------------------
# "The engine as a framework's model, optimizer and scheduler" is defined once, in engine/faces.py; the HF Trainer,
# Lightning and the DeepSpeed shim use it and keep only what their framework needs beyond it. A role is found by
# its shape: a module face is an nn.Module subclass that stores an engine (a `self.*engine* =` attribute); an
# optimizer face a class defining `param_groups` and `step`, a scheduler face one defining `get_last_lr` and `step`
# (methods or `self.` attributes), unless it subclasses torch's Optimizer / LRScheduler (a real one, as
# engine/stepping/optimizer_view.py's Optimizers, several optimizers stepped as one).
ADAPTER_MODULE = "engine/faces.py"
_REAL = ("Optimizer", "LRScheduler", "_LRScheduler")


def _members(cls: ast.ClassDef) -> set[str]:
    """The names a class defines: its methods and what its methods assign on self."""
    out = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        out |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    return out


def adapter_roles(src: Path, root: str = "zerodp", home: str = ADAPTER_MODULE) -> list[str]:
    """'file:line Class (role)' for every class outside `home` that plays one of the adapter's roles."""
    out = []
    for path in sorted((src / root).rglob("*.py")):
        if path.relative_to(src / root).as_posix() == home:
            continue
        for cls in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(cls, ast.ClassDef):
                continue
            bases, members = {ast.unparse(b).rpartition(".")[2] for b in cls.bases}, _members(cls)
            roles = []
            if "Module" in bases and any("engine" in m for m in members):
                roles.append("module face")
            if not bases & set(_REAL) and "step" in members:
                roles += [role for name, role in (("param_groups", "optimizer face"), ("get_last_lr", "scheduler face"))
                          if name in members]
            out += [f"{path.relative_to(src).as_posix()}:{cls.lineno} {cls.name} ({r})" for r in roles]
    return out


def test_each_adapter_role_is_defined_once():
    found = adapter_roles(SRC)
    assert not found, (f"the engine as a framework's model / optimizer / scheduler defined again outside "
                       f"{ADAPTER_MODULE} (use its EngineModule, EngineOptimizer, EngineScheduler): " + ", ".join(found))


def test_checker_reports_an_adapter_role_defined_again(tmp_path):
    _write(tmp_path, {
        "pkg/engine/faces.py": ("class EngineModule(nn.Module):\n    def __init__(self, engine):\n"
                                "        self.engine = engine\n"
                                "class EngineOptimizer:\n    param_groups = property(lambda self: [])\n"
                                "    def param_groups(self): ...\n    def step(self): ...\n"),
        # the forms the three copies took before issue 40
        "pkg/integrations/lightning.py": ("class EngineModule(torch.nn.Module):\n    def __init__(self, engine):\n"
                                          "        self.engine = engine\n"
                                          "class ZeroOptimizer:\n    @property\n    def param_groups(self): ...\n"
                                          "    def step(self, closure=None): ...\n"),
        "pkg/integrations/hf/trainer.py": ("class EngineScheduler:\n    def step(self): ...\n"
                                           "    def get_last_lr(self): ...\n"
                                           "class Wrapped(nn.Module):\n    def __init__(self, e):\n"
                                           "        self._engine = e\n"),
        # a real optimizer, and a module that holds no engine: not faces
        "pkg/engine/stepping/view.py": ("class Optimizers(torch.optim.Optimizer):\n    def __init__(self):\n"
                                        "        self.param_groups = []\n    def step(self): ...\n"),
        "pkg/models/gpt.py": "class GPT(nn.Module):\n    def forward(self, x):\n        return x\n",
    })
    assert adapter_roles(tmp_path, "pkg") == [
        "pkg/integrations/hf/trainer.py:1 EngineScheduler (scheduler face)",
        "pkg/integrations/hf/trainer.py:4 Wrapped (module face)",
        "pkg/integrations/lightning.py:1 EngineModule (module face)",
        "pkg/integrations/lightning.py:4 ZeroOptimizer (optimizer face)"]
