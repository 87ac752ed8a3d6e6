"""What runs in a Python worker: one connection per worker, one partition written through it.

Spark reuses its Python worker processes across tasks and micro-batches, and a worker runs
one task at a time. So the worker keeps one connection (and one session and producer) per
URL and credentials in a module-level cache, and every task of every batch that writes with
the same options sends through it: no connect per task, and the producer's confirmation
window pipelines the sends. A task that fails closes and forgets its connection, so a retry
starts on a fresh one.

``write_partition`` derives each row's duplicate id, sends every row with ``send_async``,
then ``flush``es: the task returns only when the broker confirmed every row (or raises the
first failure, and Spark retries the task, whose rows carry the same ids).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark import TaskContext

import hafailover
from hafailover import AckMode, SendCompletion
from hafailover.errors import ConfigurationError
from hafailover.spark._options import SinkOptions
from hafailover.spark._rows import ColumnPlan, IdScheme, to_messages
from hafailover.url import parse_url

__all__ = [
    "BATCH_ID_PROPERTY",
    "QUERY_ID_PROPERTY",
    "PartitionResult",
    "close_connections",
    "local_property",
    "write_partition",
]

# Set by Spark's micro-batch execution on every task of a batch (checked on PySpark 4.3):
# the stream writer's write() is not told its batch id any other way.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
# The query's id, kept in the checkpoint: the same across restarts of the query.
QUERY_ID_PROPERTY = "sql.streaming.queryId"


@dataclass(frozen=True)
class PartitionResult:
    """What one task did: the figures a commit message carries to the driver."""

    sink_id: str
    batch_id: str
    partition: int
    attempt: int
    rows: int
    sent: int
    confirmed: int
    failovers: int
    replayed: int
    resent: int
    in_doubt: int
    seconds: float
    worker: int  # the Python worker's pid: tasks of one worker share its connection
    # The broker drops a copy by its duplicate id (the bundled pair, Artemis): without it a
    # retried task stores its rows twice.
    duplicate_detection: bool = True


class _Link:
    """One connection with the session and the producer the sink sends through."""

    def __init__(self, options: SinkOptions) -> None:
        # A worker may make its first connection after the live has failed over (F12).
        policy = parse_url(options.url).first_connection_fails_over()
        self.connection = hafailover.connect(policy, user=options.user, password=options.password)
        try:
            self.session = self.connection.create_session(AckMode.AUTO)
            self.producer = self.session.create_producer(None)
        except BaseException:
            self.connection.close()
            raise


_links: dict[tuple[str, str | None, str | None], _Link] = {}
_links_lock = threading.Lock()


def _link(options: SinkOptions) -> _Link:
    key = options.connection_key
    with _links_lock:
        link = _links.get(key)
        if link is None:
            link = _links[key] = _Link(options)
        return link


def _forget(options: SinkOptions) -> None:
    with _links_lock:
        link = _links.pop(options.connection_key, None)
    if link is not None:
        with contextlib.suppress(Exception):
            link.connection.close()


def close_connections() -> None:
    """Close every cached connection (the worker's, or a test's)."""
    with _links_lock:
        links = list(_links.values())
        _links.clear()
    for link in links:
        with contextlib.suppress(Exception):
            link.connection.close()


def local_property(name: str) -> str | None:
    """A Spark local property of the running task, or None outside a task."""
    context = TaskContext.get()
    if context is None:
        return None
    value = context.getLocalProperty(name)
    return None if value is None else str(value)


def _task() -> tuple[int, int]:
    context = TaskContext.get()
    if context is None:
        return 0, 0
    return context.partitionId(), context.attemptNumber()


def _raise_first_failure(completions: list[SendCompletion]) -> list[SendCompletion]:
    """Raise the first failed send; return the sends still waiting for the broker."""
    waiting = []
    for completion in completions:
        if not completion.done():
            waiting.append(completion)
            continue
        error = completion.exception()
        if error is not None:
            raise error
    return waiting


def write_partition(
    batches: Iterator[pa.RecordBatch],
    options: SinkOptions,
    plan: ColumnPlan,
    sink_id: str,
    batch_id: str,
) -> PartitionResult:
    """Send every row of one partition and wait until the broker confirmed them all."""
    started = time.monotonic()
    partition, attempt = _task()
    ids = IdScheme.for_batch(options, sink_id, batch_id, partition)
    link = _link(options)
    before = link.connection.statistics()
    position = 0
    unfinished: list[SendCompletion] = []
    try:
        for batch in batches:
            messages = to_messages(batch, plan, options, ids, position)
            send = link.producer.send_async
            unfinished.extend(send(message, destination=target) for message, target in messages)
            position += batch.num_rows
            unfinished = _raise_first_failure(unfinished)
        link.producer.flush()
        _raise_first_failure(unfinished)
    except ConfigurationError:
        # Bad data: the connection is fine, but what was sent must still be confirmed
        # before the task fails, so a retry finds the broker in a known state.
        with contextlib.suppress(Exception):
            link.producer.flush()
        raise
    except BaseException:
        _forget(options)
        raise
    after = link.connection.statistics()
    return PartitionResult(
        sink_id=sink_id,
        batch_id=batch_id,
        partition=partition,
        attempt=attempt,
        rows=position,
        sent=after.sent - before.sent,
        confirmed=after.confirmed - before.confirmed,
        failovers=after.failovers - before.failovers,
        replayed=after.replayed - before.replayed,
        resent=after.resent - before.resent,
        in_doubt=after.in_doubt - before.in_doubt,
        seconds=time.monotonic() - started,
        worker=os.getpid(),
        duplicate_detection=link.connection.broker_detects_duplicates,
    )
