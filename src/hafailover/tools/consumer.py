"""The consumer client: ``hafailover consumer`` and ``hafailover perf consumer``.

A message counts as consumed, and is recorded, only once its consumption is settled for the
acknowledge mode: at once for AUTO and DUPS_OK (the library acknowledges as it delivers),
after ``acknowledge()`` for CLIENT, after ``commit()`` for a transacted session. A batch
whose acknowledge turned stale (F8) or whose commit was rolled back (F9) is not recorded:
the broker delivers it again and it is recorded then.

A commit or acknowledge whose outcome is unknown (F3, UNBLOCKED) leaves its batch in doubt.
The consumer holds those messages back: a message of the batch that comes again proves its
acknowledge was lost, so the held copy is dropped and the new delivery counts instead; the
ones still held at the end were settled, and are recorded with ``"in_doubt": true``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from hafailover.ack_modes import AckMode
from hafailover.connection import Connection, Consumer, Session, connect
from hafailover.errors import (
    AcknowledgeFailedError,
    CallTimeoutError,
    DisconnectedError,
    HaFailoverError,
    LocalError,
    StaleAcknowledgeError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.tools._common import (
    Progress,
    Recorder,
    check_destination,
    check_url,
    connection_summary,
    rate,
)

__all__ = ["ConsumerOptions", "ConsumerResult", "run_consumer", "seq_of"]


@attrs.frozen
class ConsumerOptions:
    url: str
    destination: str = "queue://TEST"
    count: int | None = None  # stop after this many; None: until idle, stopped or Ctrl-C
    idle_timeout: float | None = None  # stop after this many seconds without a message
    duration: float | None = None  # perf: stop after this many seconds
    ack_mode: AckMode = AckMode.AUTO
    batch: int = 1  # CLIENT: acknowledge every K; transacted: commit every K
    prefetch: int = 100
    user: str | None = None
    password: str | None = None
    record: str | None = None


@attrs.define
class ConsumerResult:
    summary: dict[str, Any]
    ok: bool


ReceiveListener = Callable[[Message], None]


def seq_of(message: Message) -> int | str | None:
    """The producer's ``seq`` header as a number (headers arrive as text on STOMP)."""
    value = message.properties.get("seq")
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value
    if isinstance(value, bool | float):
        return str(value)
    return value


class _Run:
    def __init__(self, options: ConsumerOptions, recorder: Recorder) -> None:
        self.options = options
        self.recorder = recorder
        self.consumed = 0
        self.redelivered = 0
        self.settled = 0  # acknowledges or commits that succeeded
        self.discarded = 0  # messages received and then given back (rollback, stale ack)
        self.rolled_back = 0
        self.stale = 0
        self.ack_failed = 0
        self.outcome_unknown = 0
        self.resolved = 0
        self.idle_since = 0.0
        self.last_at = 0.0
        self.error: str | None = None
        # Settled in doubt, by identity: recorded at the end unless delivered again.
        self.held: dict[object, Message] = {}

    def record(self, batch: list[Message], *, in_doubt: bool = False) -> None:
        for message in batch:
            self.consumed += 1
            self.redelivered += bool(message.redelivered)
            entry: dict[str, Any] = {
                "seq": seq_of(message),
                "message_id": message.message_id,
                "redelivered": bool(message.redelivered),
            }
            if in_doubt:
                entry["in_doubt"] = True
            self.recorder.write(entry)


def run_consumer(
    options: ConsumerOptions,
    *,
    stop: threading.Event | None = None,
    on_consumed: ReceiveListener | None = None,
    progress: Progress | None = None,
    on_connected: Callable[[Connection], None] | None = None,
) -> ConsumerResult:
    """Receive until ``count`` messages are consumed, ``idle_timeout`` passes without a
    message, ``duration`` is over, or ``stop`` is set; summarize."""
    check_url(options.url)
    destination = check_destination(options.destination)
    stop = stop or threading.Event()
    progress = progress or Progress()
    recorder = Recorder(options.record)
    run = _Run(options, recorder)
    started = time.monotonic()
    run.last_at = started
    connection: Connection | None = None
    try:
        connection = connect(options.url, user=options.user, password=options.password)
        if on_connected is not None:
            on_connected(connection)
        session = connection.create_session(options.ack_mode)
        consumer = session.create_consumer(destination, prefetch=options.prefetch)
        connection.start()
        try:
            _consume(run, session, consumer, stop, progress, connection, on_consumed)
        except KeyboardInterrupt:
            run.error = "interrupted"
    except HaFailoverError as exc:
        if isinstance(exc, LocalError):
            raise
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        progress.close()
        # Time to the last message: an idle timeout's wait is not throughput.
        elapsed = max(0.0, (run.last_at if run.consumed else time.monotonic()) - started)
        summary = _summary(run, elapsed, connection)
        if connection is not None:
            connection.close()
        recorder.close()
    ok = run.error is None and (options.count is None or run.consumed >= options.count)
    return ConsumerResult(summary=summary, ok=ok)


def _consume(
    run: _Run,
    session: Session,
    consumer: Consumer,
    stop: threading.Event,
    progress: Progress,
    connection: Connection,
    on_consumed: ReceiveListener | None,
) -> None:
    options = run.options
    mode = options.ack_mode
    started = time.monotonic()
    deadline = None if options.duration is None else started + options.duration
    pending: list[Message] = []

    def settle() -> None:
        """Acknowledge or commit ``pending``; record it if that worked."""
        if not pending:
            return
        batch = list(pending)
        pending.clear()
        try:
            if mode is AckMode.SESSION_TRANSACTED:
                session.commit()
            elif mode in (AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL):
                if mode is AckMode.CLIENT:
                    session.acknowledge()
                else:
                    for message in batch:
                        message.acknowledge()
        except (TransactionRolledBackError, StaleAcknowledgeError) as exc:
            # The broker delivers the batch again: record it when it comes.
            if isinstance(exc, TransactionRolledBackError):
                run.rolled_back += 1
            else:
                run.stale += 1
            run.discarded += len(batch)
            run.idle_since = time.monotonic()
            return
        except (
            TransactionOutcomeUnknownError,
            UnblockedError,
            CallTimeoutError,
            DisconnectedError,
        ) as exc:
            # Settled or not, nobody can say yet: if not, the batch comes again. With the
            # connection lost for good it is recorded in doubt at the end, never dropped.
            run.outcome_unknown += 1
            for message in batch:
                run.held[_identity(message)] = message
            if isinstance(exc, DisconnectedError):
                raise
            return
        if mode is not AckMode.AUTO and mode is not AckMode.DUPS_OK:
            run.settled += 1
        run.record(batch)
        _tell(batch, on_consumed)

    try:
        _loop(run, session, consumer, stop, progress, connection, deadline, pending, settle)
    finally:
        held = list(run.held.values())
        run.held.clear()
        run.record(held, in_doubt=True)
        _tell(held, on_consumed)


def _loop(
    run: _Run,
    session: Session,
    consumer: Consumer,
    stop: threading.Event,
    progress: Progress,
    connection: Connection,
    deadline: float | None,
    pending: list[Message],
    settle: Callable[[], None],
) -> None:
    options = run.options
    mode = options.ack_mode
    batch_size = max(1, options.batch)
    run.idle_since = time.monotonic()
    while True:
        wanted = (
            None
            if options.count is None
            else options.count - run.consumed - len(pending) - len(run.held)
        )
        if wanted is not None and wanted <= 0:
            settle()
            if options.count is not None and run.consumed + len(run.held) >= options.count:
                return
            continue
        if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
            settle()
            return
        wait = 0.2
        if options.idle_timeout is not None:
            left = run.idle_since + options.idle_timeout - time.monotonic()
            if left <= 0:
                settle()
                if not pending and run.idle_since + options.idle_timeout <= time.monotonic():
                    return
                continue
            wait = min(wait, left)
        try:
            message = consumer.receive(timeout=wait)
        except AcknowledgeFailedError:
            run.ack_failed += 1  # AUTO (F6): that message comes again
            continue
        except StaleAcknowledgeError:
            run.stale += 1
            run.discarded += len(pending)
            pending.clear()
            continue
        if message is None:
            if pending and mode is not AckMode.AUTO:
                settle()  # nothing more is coming now: do not sit on a partial batch
            continue
        run.idle_since = run.last_at = time.monotonic()
        if run.held.pop(_identity(message), None) is not None:
            run.resolved += 1  # its earlier acknowledge was lost after all
        pending.append(message)
        if mode in (AckMode.AUTO, AckMode.DUPS_OK) or len(pending) >= batch_size:
            settle()
        count = f"/{options.count}" if options.count is not None else ""
        progress.update(
            f"consumer: {run.consumed}{count} received, {run.redelivered} redelivered, "
            f"{connection.statistics().failovers} failover(s)"
        )


def _identity(message: Message) -> object:
    """What identifies a message across a failover: its ``seq`` when it has one (a STOMP
    broker may give the copy on the backup another message-id), else its message id."""
    seq = seq_of(message)
    return ("seq", seq) if seq is not None else message.message_id


def _tell(batch: list[Message], listener: ReceiveListener | None) -> None:
    if listener is not None:
        for message in batch:
            listener(message)


def _summary(run: _Run, elapsed: float, connection: Connection | None) -> dict[str, Any]:
    options = run.options
    summary: dict[str, Any] = {
        "command": "consumer",
        "destination": str(check_destination(options.destination)),
        "ack_mode": options.ack_mode.value,
        "received": run.consumed,
        "redelivered": run.redelivered,
        "discarded_and_redelivered": run.discarded,
        "duration": round(elapsed, 3),
        "messages_per_second": rate(run.consumed, elapsed),
    }
    if options.ack_mode is AckMode.SESSION_TRANSACTED:
        summary.update(
            commits=run.settled,
            transactions_rolled_back=run.rolled_back,
            commit_outcome_unknown=run.outcome_unknown,
        )
    elif options.ack_mode in (AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL):
        summary.update(
            acknowledges=run.settled,
            stale_acknowledges=run.stale,
            acknowledge_outcome_unknown=run.outcome_unknown,
            acknowledge_lost_and_redelivered=run.resolved,
        )
    else:
        summary["acknowledges_failed"] = run.ack_failed
    if connection is not None:
        summary.update(connection_summary(connection))
    if run.error is not None:
        summary["error"] = run.error
    return summary
