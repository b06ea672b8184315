"""The package has no import cycles, not even through imports inside functions.

``lint-imports`` (in ``make test``) checks the layer order of pyproject.toml; this test adds what
a layers contract does not see: a cycle between modules of one layer or one subpackage. grimp
reads every import statement, top level or inside a function, without importing anything.
"""

from __future__ import annotations

import os
import sys

import grimp

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    sys.path.insert(0, SRC)
    try:
        graph = grimp.build_graph("zerostall", cache_dir=None)
    finally:
        sys.path.remove(SRC)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert len(edges) > 30  # the whole package was read
    assert _cycles(edges) == []


def test_no_import_cycles_in_the_benchmarks() -> None:
    root = os.path.dirname(SRC)
    sys.path.insert(0, root)
    try:
        graph = grimp.build_graph("benchmarks", cache_dir=None)
    finally:
        sys.path.remove(root)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert {"benchmarks.run", "benchmarks.floors", "benchmarks.measure"} <= set(edges)  # the suite was read
    assert _cycles(edges) == []


def _string_imports(path: str) -> list[str]:
    """The module names a file imports by a string: ``importlib.import_module("...")``,
    ``__import__("...")`` (the literal part of an f-string too)."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append(arg.value)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                out.append(str(arg.values[0].value))
    return out


def test_no_string_import_hides_an_edge_of_the_graph() -> None:
    """A module imported by a string is one the graph cannot see: none of zerostall's Python
    modules is (a C extension, which imports nothing, may be), but for the root package's lazy
    public names, which sit above everything. Integrations that load themselves are entry points."""
    sys.path.insert(0, SRC)
    try:
        graph = grimp.build_graph("zerostall", cache_dir=None)
    finally:
        sys.path.remove(SRC)
    named = []
    for root, _, files in os.walk(os.path.join(SRC, "zerostall")):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and path != os.path.join(SRC, "zerostall", "__init__.py"):
                named += [(path, m) for m in _string_imports(path) if m == "zerostall" or m.startswith("zerostall.")]
    assert named, "the scan found none at all: zerostall.memcopy imports its C extension by name"
    hidden = [(os.path.relpath(p, SRC), m) for p, m in named if m in graph.modules]
    assert hidden == []


def test_the_declared_integrations_are_top_layer_modules_triggered_by_a_framework() -> None:
    """Every entry point of the array-type group names a module of the integrations layer (so
    that loading it imports only downward) and a trigger outside zerostall."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    from zerostall.arraytypes import ENTRY_POINT_GROUP

    with open(os.path.join(os.path.dirname(SRC), "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    declared = project["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert declared == {"jax": "zerostall.integrations.jax"}
    for trigger, module in declared.items():
        assert not trigger.startswith("zerostall") and module.startswith("zerostall.integrations.")
        assert os.path.exists(os.path.join(SRC, *module.split(".")) + ".py")
