"""hafailover.aio keeps no thread pool of its own: read from the source with ast, it makes
no executor and no thread, and every ``run_in_executor`` it calls names the loop's default
executor (``None``), which the application owns and sizes. What waits for the broker waits
on the loop (driver/waits.py); the default executor makes only blocking socket I/O that has
no other form (docs/aio.md), so a pool of its own would only hold threads while calls wait.
"""

from __future__ import annotations

import ast
from pathlib import Path

AIO = Path(__file__).resolve().parents[2] / "src" / "hafailover" / "aio.py"
# What makes threads or pools of threads.
THREAD_MAKERS = frozenset(
    {"ThreadPoolExecutor", "ProcessPoolExecutor", "Executor", "Thread", "start_new_thread"}
)


def own_threads(source: str) -> list[str]:
    """Each place in ``source`` that makes (or imports what makes) a thread or an executor,
    or hands a call to an executor other than the loop's default one."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("concurrent.futures", "threading"):
            found += [
                f"line {node.lineno}: imports {alias.name} from {node.module}"
                for alias in node.names
                if alias.name in THREAD_MAKERS
            ]
        elif isinstance(node, ast.Name) and node.id in THREAD_MAKERS:
            found.append(f"line {node.lineno}: uses {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in THREAD_MAKERS:
            found.append(f"line {node.lineno}: uses .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "run_in_executor"
        ):
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Constant) and first.value is None):
                found.append(f"line {node.lineno}: run_in_executor on an executor of its own")
    return found


def test_aio_makes_no_executor_and_no_thread() -> None:
    assert own_threads(AIO.read_text()) == []


def test_the_check_sees_a_pool_of_its_own() -> None:
    made = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "workers = ThreadPoolExecutor(max_workers=32)\n"
        "async def run(loop, f):\n"
        "    return await loop.run_in_executor(workers, f)\n"
    )
    assert len(own_threads(made)) == 3
    assert own_threads("import threading\nthreading.Thread(target=print).start()\n") == [
        "line 2: uses .Thread"
    ]
    assert own_threads("async def run(loop, f):\n    await loop.run_in_executor(None, f)\n") == []
