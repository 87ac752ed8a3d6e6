"""The driver's modules import one another without a cycle.

Read from the source with ast, not by importing: every import that runs (at module level
or inside a function) is an edge; an import under ``if TYPE_CHECKING:`` is not, since it
never runs. ``from hafailover.driver import tracing`` names the submodule; any other name
imported from the package is an edge to ``__init__``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

DRIVER = Path(__file__).resolve().parents[2] / "src" / "hafailover" / "driver"
PACKAGE = "hafailover.driver"


def _type_checking_block(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif _type_checking_block(child):
            assert isinstance(child, ast.If)
            for other in child.orelse:  # the else branch of TYPE_CHECKING does run
                yield from _runtime_imports(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _runtime_imports(child)


def import_graph(directory: Path, package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (``__init__`` for the package itself) and the modules of
    the same package it imports when it runs."""
    names = {path.stem for path in directory.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(directory.glob("*.py")):
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.module == package:
                targets = [
                    f"{package}.{alias.name}" if alias.name in names else package
                    for alias in node.names
                ]
            else:
                targets = [node.module or ""]
            for target in targets:
                if target == package:
                    edges.add("__init__")
                elif target.startswith(package + "."):
                    edges.add(target[len(package) + 1 :].split(".")[0])
        graph[path.stem] = edges - {path.stem}
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as the path that closes it (``[a, b, a]``), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle is not None:
            return cycle
    return None


def test_the_driver_modules_import_one_another_without_a_cycle() -> None:
    graph = import_graph(DRIVER, PACKAGE)
    assert {"connection", "session", "consumer", "producer"} <= set(graph)
    assert "calls" in graph["connection"]  # the graph sees the driver's own imports
    cycle = find_cycle(graph)
    assert cycle is None, "the driver's modules import in a cycle: " + " -> ".join(cycle or [])


def test_a_cycle_is_found_and_type_only_imports_are_not_edges(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from pkg.b import thing\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.a import other\n"
        "def later():\n"
        "    from pkg import c\n"
    )
    (tmp_path / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import pkg\n")  # the package's __init__, not a
    assert find_cycle(import_graph(tmp_path, "pkg")) is None
