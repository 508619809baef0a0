"""Static checks of the source tree: the import graph's circles and cross-module private reads.

Pure Python (``ast`` only): nothing is imported or run. Used by tests/test_code_structure.py
to keep the tree's rules (no import circles; no module reads another's ``_private``
names) and by scripts/code_health.py, which reports the same figures.

An import edge is any ``import`` / ``from ... import`` of a project module, wherever it
stands (module level, inside a function, or under ``if TYPE_CHECKING``): a lazy or
type-only import still couples the two modules both ways. The implicit import of a
parent package's ``__init__`` is not an edge.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from collections.abc import Iterable, Sequence

# NamedTuple's public API happens to start with an underscore.
# The project's packages: folder -> import name (models/ installs as paged_jax.models).
PROJECT_PACKAGES = {
    "paged_jax": "paged_jax",
    "models": "paged_jax.models",
    "pallas_kernels": "pallas_kernels",
}
NAMEDTUPLE_METHODS = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


@dataclasses.dataclass(frozen=True)
class SourceModule:
    """One project module: its dotted name, file and parsed tree."""

    name: str
    path: pathlib.Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def collect_modules(root: pathlib.Path, packages: dict[str, str]) -> dict[str, SourceModule]:
    """Parses every ``.py`` file of the given packages.

    Args:
        root: the repository root.
        packages: folder (relative to root) -> the dotted package name it installs as,
            e.g. {"paged_jax": "paged_jax", "models": "paged_jax.models"}.

    Returns:
        dotted module name -> SourceModule.
    """
    modules: dict[str, SourceModule] = {}
    for folder, dotted in packages.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([dotted, *parts])
            modules[name] = SourceModule(name, path, ast.parse(path.read_text(), str(path)))
    return modules


def _resolve(module: SourceModule, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    drop = node.level - (1 if module.is_package else 0)
    base = base[: len(base) - drop] if drop else base
    return ".".join([*base, node.module] if node.module else base)


def import_graph(modules: dict[str, SourceModule]) -> dict[str, set[str]]:
    """module -> the project modules it imports (see the module docstring for what counts)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, module in modules.items():
        for node in ast.walk(module.tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                # `from pkg import mod` imports the submodule; `from mod import name` the module.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]  # `import a.b.c` -> the deepest module
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: strongly connected components of more than one module (sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative Tarjan: deep graphs must not hit recursion limits
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(cycles)


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, assignments, ``self._x = ...``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


@dataclasses.dataclass(frozen=True)
class PrivateRead:
    """``obj._name`` in ``path:line`` where ``_name`` belongs to another project module."""

    path: pathlib.Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def private_reads(
    files: Iterable[pathlib.Path], owners: Sequence[SourceModule]
) -> list[PrivateRead]:
    """Reads of another module's private names in ``files``.

    A read or write of ``x._name`` (x not ``self``/``cls``/``super()``) or ``from m import _name``
    counts when ``_name`` is not defined in the reading file but is defined in one of
    ``owners`` (so private names of third-party libraries are not this check's business).
    """
    owned: set[str] = set()
    for module in owners:
        owned |= _defined_private_names(module.tree)
    found: list[PrivateRead] = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        local = _defined_private_names(tree)
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                value = node.value
                if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                    continue
                if (
                    isinstance(value, ast.Call)
                    and isinstance(value.func, ast.Name)
                    and value.func.id == "super"
                ):
                    continue
                name = node.attr
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name in owned - local:
                        found.append(PrivateRead(path, node.lineno, f"import {alias.name}"))
                continue
            if (
                name is None
                or name.startswith("__")
                or name in NAMEDTUPLE_METHODS
                or name in local
                or name not in owned
            ):
                continue
            found.append(PrivateRead(path, node.lineno, ast.unparse(node)))
    return sorted(found, key=lambda r: (str(r.path), r.line))
