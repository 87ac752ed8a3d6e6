"""hafailover.aio reads no private member of the driver: it reaches the driver only through
its public objects and the seam made for it (driver/nonblocking.py, driver/waits.py), so the
driver may change inside without breaking the bridge, and the bridge holds no rule.

Read from the source with ast: every ``x._name`` in aio.py must be a name aio.py defines for
its own objects, and none of those may also be a private name of the driver, the protocols
or the core (a bridge attribute called ``_cond`` would hide a reach into the driver). No
private name is imported from them either.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "hafailover"
AIO = PACKAGE / "aio.py"
DRIVER_SIDE = ("driver", "protocols", "core", "ack_modes", "tx")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_privates(tree: ast.AST) -> set[str]:
    """The private names a module gives its own objects: methods, attributes assigned on
    ``self`` or in a class body, and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            for target in targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__slots__" and node.value is not None:
                        names.update(
                            element.value
                            for element in ast.walk(node.value)
                            if isinstance(element, ast.Constant) and isinstance(element.value, str)
                        )
    return {name for name in names if _private(name)}


def driver_privates(files: Iterable[Path]) -> set[str]:
    names: set[str] = set()
    for path in files:
        names |= defined_privates(ast.parse(path.read_text(), filename=str(path)))
    return names


def reaches(tree: ast.AST, own: set[str], forbidden: set[str]) -> Iterator[str]:
    """Each reach into another module's privates: an attribute aio.py does not define for
    itself (or that the driver side defines too), a private name imported from hafailover."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr not in own or node.attr in forbidden:
                yield f"line {node.lineno}: .{node.attr}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hafailover"):
            for alias in node.names:
                if _private(alias.name) or any(_private(p) for p in (node.module or "").split(".")):
                    yield f"line {node.lineno}: from {node.module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hafailover") and any(
                    _private(part) for part in alias.name.split(".")
                ):
                    yield f"line {node.lineno}: import {alias.name}"


def driver_side_files() -> list[Path]:
    return [path for part in DRIVER_SIDE for path in sorted((PACKAGE / part).rglob("*.py"))]


def test_aio_reads_no_private_member_of_the_driver() -> None:
    tree = ast.parse(AIO.read_text(), filename=str(AIO))
    forbidden = driver_privates(driver_side_files())
    assert {"_cond", "_machine", "_ask_for_receipt", "_send", "_outstanding"} <= forbidden
    found = list(reaches(tree, defined_privates(tree), forbidden))
    assert found == [], "hafailover.aio reaches into the driver: " + ", ".join(found)


def test_a_reach_into_the_driver_is_found() -> None:
    source = (
        "from hafailover.driver.calls import _Owner\n"
        "class Bridge:\n"
        "    __slots__ = ('_mine',)\n"
        "    def __init__(self, connection):\n"
        "        self._cond = connection._cond\n"
        "    def _own(self):\n"
        "        return self._mine, self._own\n"
        "    def use(self, connection):\n"
        "        connection._ask_for_receipt()\n"
    )
    tree = ast.parse(source)
    found = list(reaches(tree, defined_privates(tree), {"_cond", "_ask_for_receipt"}))
    assert found == [
        "line 1: from hafailover.driver.calls import _Owner",
        "line 5: ._cond",
        "line 5: ._cond",
        "line 9: ._ask_for_receipt",
    ]
