"""The boundary between the pure core and the driver, enforced by a test, not a reviewer.

The core (state machines and rules) decides; the driver, the adapters and everything built
on them carry the decisions out. So:
- the core imports no I/O (threads, sockets, clocks, asyncio, stomp.py, proton) and none of
  the driver's modules, and it imports with neither client library installed;
- outside the core nothing names an acknowledge-rule class (a rule set is asked for its
  capabilities, never tested for its class) and nothing reads or writes a private member
  of the core's objects, or assigns to their state.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "hafailover"

# The core package, the ack-mode rules and the transaction state, and the value modules.
CORE = (
    "core",
    "ack_modes",
    "tx",
    "errors.py",
    "url.py",
    "destination.py",
    "message.py",
    "_units.py",
)
# What the core may never import: I/O, clocks, threads, the client libraries, the driver.
FORBIDDEN_IN_CORE = (
    "threading",
    "socket",
    "select",
    "selectors",
    "ssl",
    "time",
    "asyncio",
    "subprocess",
    "stomp",
    "proton",
    "cproton",
    "hafailover.driver",
    "hafailover.protocols",
    "hafailover.aio",
    "hafailover.spark",
)
# Names under which the driver holds the core's objects.
CORE_OBJECTS = frozenset(
    {"rules", "_rules", "_auto_rules", "_core", "core", "_machine", "machine", "transaction",
     "_window", "window", "_schedule", "schedule"}
)  # fmt: skip


def modules(names: tuple[str, ...]) -> Iterator[Path]:
    for name in names:
        path = PACKAGE / name
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def core_paths() -> list[Path]:
    return list(modules(CORE))


def outside_paths() -> list[Path]:
    core = set(core_paths())
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p not in core]


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported(tree: ast.Module) -> Iterator[tuple[str, list[str], int]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            yield node.module, [a.name for a in node.names], node.lineno


def holder(node: ast.expr) -> str | None:
    """The name an attribute is read from: ``x`` in ``x.y``, ``y`` in ``x.y.z``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def test_the_core_lists_only_modules_that_exist() -> None:
    assert all((PACKAGE / name).exists() for name in CORE)
    assert len(core_paths()) > len(CORE)


@pytest.mark.parametrize("path", core_paths(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_core_imports_no_io_and_no_driver(path: Path) -> None:
    for module, names, line in imported(parse(path)):
        # ``from hafailover import driver`` imports hafailover.driver too.
        for target in (module, *(f"{module}.{name}" for name in names)):
            for forbidden in FORBIDDEN_IN_CORE:
                assert target != forbidden and not target.startswith(forbidden + "."), (
                    f"{path.name}:{line} imports {target}: the core does no I/O"
                )


@pytest.mark.parametrize("path", outside_paths(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_outside_the_core_no_rule_class_is_named(path: Path) -> None:
    tree = parse(path)
    for module, names, line in imported(tree):
        if module.startswith("hafailover.ack_modes"):
            classes = [n for n in names if n.endswith("AckRules") and n != "AckRules"]
            assert not classes, f"{path.name}:{line} imports {classes}: ask a capability"
    for node in ast.walk(tree):
        # A bare name or an attribute (``ack_modes.ClientAckRules``): either way a class.
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if isinstance(name, str) and name.endswith("AckRules") and name != "AckRules":
            raise AssertionError(
                f"{path.name}:{node.lineno} names {name}: ask the rules a capability"
            )


@pytest.mark.parametrize("path", outside_paths(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_outside_the_core_no_private_member_of_the_core_is_touched(path: Path) -> None:
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Attribute) and holder(node.value) in CORE_OBJECTS:
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            assert not private, (
                f"{path.name}:{node.lineno} reads {holder(node.value)}.{node.attr}, "
                "a private member of the core"
            )
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute):
                    assert holder(target.value) not in CORE_OBJECTS, (
                        f"{path.name}:{node.lineno} assigns {holder(target.value)}."
                        f"{target.attr}: the core's state changes through its methods"
                    )


def test_the_core_imports_without_stomp_or_proton() -> None:
    names = sorted(
        "hafailover."
        + str(p.relative_to(PACKAGE).with_suffix("")).replace("/", ".").removesuffix(".__init__")
        for p in core_paths()
    )
    code = (
        "import sys\n"
        "sys.modules['stomp'] = None\n"  # an import of either now fails
        "sys.modules['proton'] = None\n"
        "sys.modules['cproton'] = None\n"
        f"for name in {names!r}:\n"
        "    __import__(name)\n"
        "assert 'hafailover.driver' not in sys.modules, 'the core pulled the driver in'\n"
        "assert 'hafailover.protocols' not in sys.modules, 'the core pulled a protocol in'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
