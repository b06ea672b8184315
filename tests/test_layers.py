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
