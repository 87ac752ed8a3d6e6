"""Functions the Spark tests run inside Python workers (imported there by name)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark import TaskContext

# A Python UDF's worker writes its results through a 64 KB buffer: results of a few bytes
# reach the JVM (and the sink) only when the task ends. Bodies this long go out every few
# hundred rows, so the sink is sending while the UDF is still midway.
PADDING = "." * 200


def body_of(row_id: int) -> str:
    return f"row-{row_id}|{PADDING}"


def row_of(body: bytes) -> str:
    return body.decode().partition("|")[0]


# Rows each task attempt has passed through fail_midway_first_attempt, by task attempt id.
_seen: dict[int, list[int]] = {}
FAIL_AFTER = 1_500
# The failing attempt fails only once the broker stores this many of the rows it produced.
STORED_BEFORE_FAILING = 1_000
# The local properties that tell fail_midway_first_attempt where the sink writes to, and
# the file it creates once the broker stores enough.
STORED_URL = "tests.stored.url"
STORED_QUEUE = "tests.stored.queue"
STORED_MARK = "tests.stored.mark"


@contextlib.contextmanager
def failing_after_stored(spark: Any, url: str, queue: str) -> Iterator[None]:
    """Within: fail_midway_first_attempt's failure waits for STORED_BEFORE_FAILING of the
    failing attempt's rows on ``queue`` (a browser through ``url``), Spark's local properties
    carrying both to the task. On leaving, fails unless that attempt saw them stored: a
    retry test whose first attempt stored nothing would test nothing."""
    context = spark.sparkContext
    with tempfile.TemporaryDirectory(prefix="stored-") as directory:
        mark = Path(directory) / "stored"
        for name, value in ((STORED_URL, url), (STORED_QUEUE, queue), (STORED_MARK, str(mark))):
            context.setLocalProperty(name, value)
        try:
            yield
        finally:
            for name in (STORED_URL, STORED_QUEUE, STORED_MARK):
                context.setLocalProperty(name, None)
        assert mark.exists(), (
            f"the failing attempt failed before the broker stored {STORED_BEFORE_FAILING} of "
            f"its rows on {queue}"
        )


def _wait_until_stored(context: TaskContext, produced: list[int], limit: float = 60.0) -> None:
    """Wait until the broker stores STORED_BEFORE_FAILING of the rows in ``produced`` on the
    queue the local properties name (the sink sent and the broker confirmed them: a fixed
    sleep was too short on a loaded machine, and the attempt then failed with nothing
    stored), then create the mark. After ``limit`` seconds, returns without it
    (``failing_after_stored`` then fails the test)."""
    url, queue = context.getLocalProperty(STORED_URL), context.getLocalProperty(STORED_QUEUE)
    mark = context.getLocalProperty(STORED_MARK)
    if not url or not queue or not mark:
        raise RuntimeError(
            f"fail_midway_first_attempt runs only within failing_after_stored (local "
            f"properties {STORED_URL}, {STORED_QUEUE} and {STORED_MARK} unset)"
        )
    import hafailover  # in the Python worker, as the sink does

    mine = {body_of(row_id).encode() for row_id in produced}
    deadline = time.monotonic() + limit
    with hafailover.connect(url) as connection:
        session = connection.create_session()
        while time.monotonic() < deadline:
            stored = sum(m.body_bytes in mine for m in session.create_browser(queue).messages())
            if stored >= STORED_BEFORE_FAILING:
                Path(mark).touch()
                return
            time.sleep(0.2)


def fail_midway_first_attempt(row_id):  # type: ignore[no-untyped-def] # as above
    """The body of row ``row_id``; the first attempt of partition 0 fails at its
    FAIL_AFTER-th row, whatever that row is (after a shuffle nobody knows which ids
    partition 0 holds), once the broker stores STORED_BEFORE_FAILING of the rows before it
    (``failing_after_stored``)."""
    context = TaskContext.get()
    if context is not None and context.partitionId() == 0 and context.attemptNumber() == 0:
        produced = _seen.setdefault(context.taskAttemptId(), [])
        produced.append(row_id)
        if len(produced) == FAIL_AFTER:
            _wait_until_stored(context, produced)
            raise RuntimeError("the first attempt of partition 0 fails on purpose, midway")
    return body_of(row_id)


def order_by_attempt(row_id):  # type: ignore[no-untyped-def] # as above
    """A sort key that puts a partition's rows in ascending order on a task's first attempt
    and descending on its retries: the same rows, another order, as after a shuffle whose
    blocks arrive in another order."""
    context = TaskContext.get()
    if context is not None and context.attemptNumber() > 0:
        return -row_id
    return row_id


# Rows each task attempt has passed through slow_and_marked, by task attempt id.
_marked: dict[int, int] = {}


def slow_and_marked(row_id: int, delay: float, mark_after: int, marks: str) -> str:
    """The body of row ``row_id``, after ``delay`` seconds; at a task attempt's
    ``mark_after``-th row, write marks/<batch>-<partition>-<attempt> holding this Python
    worker's pid: the cluster tests' sign that the task is sending (the bodies before it
    have left the UDF's buffer), and the way to the executor that runs it."""
    _slow_and_mark(delay, mark_after, marks)
    return body_of(row_id)


def slow_and_marked_json(row_id: int, name: str, delay: float, mark_after: int, marks: str) -> str:
    """As ``slow_and_marked``, with the row as a JSON body ({"id": ..., "name": ...})."""
    _slow_and_mark(delay, mark_after, marks)
    return json.dumps({"id": row_id, "name": name})


def _slow_and_mark(delay: float, mark_after: int, marks: str) -> None:
    if delay:
        time.sleep(delay)
    context = TaskContext.get()
    if context is not None:
        key = context.taskAttemptId()
        seen = _marked[key] = _marked.get(key, 0) + 1
        if seen == mark_after:
            batch = context.getLocalProperty("streaming.sql.batchId") or "write"
            name = f"{batch}-{context.partitionId()}-{context.attemptNumber()}"
            Path(marks, name).write_text(str(os.getpid()))
