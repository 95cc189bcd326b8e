"""The package layout shows the architecture: no import cycles, every module says what it is for, none too long.

Read from the source, not by importing: an import inside a function counts as much as
one at the top, since it ties the two modules together all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "meshtune"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package (packages by their __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert graph["meshtune.config.load"] >= {"meshtune.config.schema"}  # the reader sees real edges
    cycles = import_cycles(graph)
    assert not cycles, "import cycles inside meshtune/: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_module_opens_with_a_docstring() -> None:
    missing = [str(path.relative_to(PACKAGE.parent)) for path in _modules().values()
               if not (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").strip()]
    assert not missing, f"modules without a docstring saying what they are for: {missing}"


# A module docstring says what the module is for; measurements and history live in docs/performance.md,
# the reasons for a piece of code beside that code, a command's help text in a constant of its own.
MAX_DOCSTRING_LINES = 12


def test_every_module_docstring_is_short() -> None:
    long = {str(path.relative_to(PACKAGE.parent)): n for path in _modules().values()
            if (n := len((ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or "")
                         .strip().splitlines())) > MAX_DOCSTRING_LINES}
    assert not long, (f"module docstrings over {MAX_DOCSTRING_LINES} lines (say what the module is for; move "
                      f"figures to docs/performance.md, reasons to the code they explain): {long}")


def test_no_module_is_too_long() -> None:
    long = {str(path.relative_to(PACKAGE.parent)): n for path in _modules().values()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


MAX_FUNCTION_LINES = 80
# finetune's phases (meshtune/api.py) each read in one screen.
MAX_API_FUNCTION_LINES = 60
# Functions still over the limit, each with the work that splits it; a test below asks to drop an entry
# once its function fits.
OVER_THE_LIMIT: dict[str, str] = {}


def function_lengths(source: str) -> dict[str, int]:
    """Qualified name -> lines (decorators, signature and docstring included) of every function, nested
    ones and methods too."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    lengths[name] = child.end_lineno - first + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def _too_long() -> dict[str, int]:
    found = {}
    for path in _modules().values():
        where = path.relative_to(PACKAGE).as_posix()
        limit = MAX_API_FUNCTION_LINES if where == "api.py" else MAX_FUNCTION_LINES
        for name, n in function_lengths(path.read_text(encoding="utf-8")).items():
            if n > limit:
                found[f"{where}::{name}"] = n
    return found


def test_function_lengths_are_measured_from_the_first_decorator() -> None:
    source = "@wrap\ndef f():\n    def g():\n        pass\n    return g\n\nclass C:\n    def m(self):\n        pass\n"
    assert function_lengths(source) == {"f": 5, "f.g": 2, "C.m": 2}


def test_no_function_does_many_jobs() -> None:
    long = {name: n for name, n in _too_long().items() if name not in OVER_THE_LIMIT}
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines ({MAX_API_FUNCTION_LINES} in api.py), "
                      f"each doing more than one job: split them: {long}")


def test_every_function_allowed_over_the_limit_still_is() -> None:
    fitting = sorted(set(OVER_THE_LIMIT) - set(_too_long()))
    assert not fitting, f"these now fit: drop them from OVER_THE_LIMIT: {fitting}"


# Module variables that change after import, each with why it is kept or what removes it; a test below
# asks to drop an entry once its variable is gone.
MODULE_STATE: dict[str, str] = {}


def module_state(source: str) -> list[str]:
    """What of a module can change after import: `global` statements, and module-level names bound to an
    empty dict, list or set (a registry or a cache filled later)."""
    tree = ast.parse(source)
    found = [f"global {', '.join(node.names)}" for node in ast.walk(tree) if isinstance(node, ast.Global)]
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        empty = (isinstance(value, (ast.Dict, ast.List, ast.Set)) and not getattr(value, "keys", None)
                 and not getattr(value, "elts", None)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("dict", "list", "set") and not value.args and not value.keywords)
        found += [t.id for t in targets if empty and isinstance(t, ast.Name)]
    return found + _mutated_module_containers(tree)


MUTATORS = {"append", "add", "update", "setdefault", "pop", "clear", "extend", "insert", "remove", "discard"}


def _mutated_module_containers(tree: ast.Module) -> list[str]:
    """Module-level names bound to a dict, list or set that a function changes (`_x[0] = ...`,
    `_x.append(...)`): a container standing in for a `global`."""
    containers = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                  and isinstance(node.value, (ast.Dict, ast.List, ast.Set))
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    changed = []
    for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(func):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign) else [node.func] if isinstance(node, ast.Call) and isinstance(
                node.func, ast.Attribute) and node.func.attr in MUTATORS else []
            changed += [t.value.id for t in targets if isinstance(t, (ast.Subscript, ast.Attribute))
                        and isinstance(t.value, ast.Name) and t.value.id in containers]
    return sorted(set(changed), key=changed.index)


def test_module_state_is_found() -> None:
    source = "A = {'x': 1}\n_cache: dict = {}\nseen = []\nnames = set()\ndef f():\n    global seen\n"
    assert module_state(source) == ["global seen", "_cache", "seen", "names"]
    held = "_device = ['cpu']\nKEYS = ['a']\ndef use(d):\n    _device[0] = d\n    return KEYS[0]\n"
    assert module_state(held) == ["_device"]


def test_no_module_keeps_state_that_changes_after_import() -> None:
    found = {}
    for path in _modules().values():
        where = path.relative_to(PACKAGE).as_posix()
        if where not in MODULE_STATE and (names := module_state(path.read_text(encoding="utf-8"))):
            found[where] = names
    assert not found, f"module variables a run can change (hand an object down instead): {found}"


def test_every_module_allowed_state_still_has_it() -> None:
    gone = [where for where in sorted(MODULE_STATE)
            if not module_state((PACKAGE / where).read_text(encoding="utf-8"))]
    assert not gone, f"these keep no state now: drop them from MODULE_STATE: {gone}"
