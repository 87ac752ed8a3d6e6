"""Functions the Spark tests run inside Python workers (imported there by name)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

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
_seen: dict[int, int] = {}
FAIL_AFTER = 1_500


def fail_midway_first_attempt(row_id):  # type: ignore[no-untyped-def] # as above
    """The body of row ``row_id``; the first attempt of partition 0 fails at its
    FAIL_AFTER-th row, whatever that row is (after a shuffle nobody knows which ids
    partition 0 holds), after the sink has had time to send and confirm the record batches
    before it."""
    context = TaskContext.get()
    if context is not None and context.partitionId() == 0 and context.attemptNumber() == 0:
        count = _seen[context.taskAttemptId()] = _seen.get(context.taskAttemptId(), 0) + 1
        if count == FAIL_AFTER:
            time.sleep(2.0)
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
