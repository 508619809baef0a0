"""The tree's structural rules: no import circles, no module reading another's private names.

The checks (paged_jax.testing.code_structure) are first run on a small tree written here
with one circle and one private read, so a check that could never fail is caught too.
"""

from __future__ import annotations

import pathlib

from paged_jax.testing.code_structure import (
    PROJECT_PACKAGES,
    collect_modules,
    import_cycles,
    import_graph,
    private_reads,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _project_modules():
    return collect_modules(ROOT, PROJECT_PACKAGES)


def test_checks_find_a_planted_circle_and_private_read(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.b import B\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._state = {}\n"
    )
    (pkg / "b.py").write_text(
        "from pkg.a import A\n"
        "from pkg import c\n"
        "class B:\n"
        "    def peek(self, a: A):\n"
        "        self._own = 1\n"
        "        return a._state, self._own, a._replace\n"
    )
    (pkg / "c.py").write_text("def f():\n    from . import a\n    return a\n")
    modules = collect_modules(tmp_path, {"pkg": "pkg"})
    graph = import_graph(modules)
    assert graph["pkg.b"] == {"pkg.a", "pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]  # a -> b -> c -> a
    reads = private_reads([pkg / "b.py"], list(modules.values()))
    assert [(r.line, r.text) for r in reads] == [(6, "a._state")]


def test_no_import_circles():
    cycles = import_cycles(import_graph(_project_modules()))
    assert cycles == [], f"import circles (type-only and lazy imports count): {cycles}"


def test_no_module_reads_another_modules_private_names():
    modules = _project_modules()
    files = [m.path for m in modules.values()]
    for folder in ("scripts", "examples"):
        files += sorted((ROOT / folder).glob("*.py"))
    reads = private_reads(files, list(modules.values()))
    assert reads == [], "cross-module private reads:\n" + "\n".join(map(str, reads))
