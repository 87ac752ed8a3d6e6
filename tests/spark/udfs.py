"""Functions the Spark tests run inside Python workers (imported there by name)."""

from __future__ import annotations

import time

from pyspark import TaskContext

FAIL_AT = 1_500


def fail_first_attempt(row_id):  # type: ignore[no-untyped-def] # hints would ask for an Arrow UDF
    """Pass row ids through; partition 0's first attempt fails at row FAIL_AT, after the
    sink has had time to send and confirm the record batch of rows before it."""
    context = TaskContext.get()
    if (
        row_id == FAIL_AT
        and context is not None
        and context.partitionId() == 0
        and context.attemptNumber() == 0
    ):
        time.sleep(2.0)
        raise RuntimeError("the first attempt of partition 0 fails on purpose")
    return row_id
