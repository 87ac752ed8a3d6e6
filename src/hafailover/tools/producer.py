"""The producer client: ``hafailover producer`` and ``hafailover perf producer``.

Every message carries the application header ``seq`` (0, 1, 2, ...), so a consumer's record
can be checked against the producer's. Each message ends with one outcome:

- ``confirmed``: the broker confirmed it (a receipt or settlement; for a transacted
  producer, the commit of its batch);
- ``in-doubt``: the connection failed while it was unconfirmed and the library could not
  resend it (duplicate detection off, or a commit whose answer was lost and could not be
  retried): it may or may not be stored;
- ``failed``: it was not stored (the broker refused it, or the connection gave up first);
- ``sent``: a non-persistent message or an unconfirmed producer, written and not confirmed.

A transacted producer commits every ``tx_batch`` messages. When a failover makes the
transaction rollback-only (F9), or a commit's outcome is unknown (F3), it sends the same
``Message`` objects again, so with their same duplicate ids (F13), and commits again: the
batch is stored once and only once on a broker that detects duplicates.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import attrs

from hafailover.ack_modes import AckMode
from hafailover.connection import Connection, Producer, SendCompletion, Session, connect
from hafailover.errors import (
    CallTimeoutError,
    DisconnectedError,
    HaFailoverError,
    LocalError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from hafailover.message import Message, new_message_id
from hafailover.tools._common import (
    Progress,
    Recorder,
    check_destination,
    check_url,
    connection_summary,
    percentile,
    rate,
)

__all__ = ["ProducerOptions", "ProducerResult", "run_producer"]

CONFIRMED: Final = "confirmed"
IN_DOUBT: Final = "in-doubt"
FAILED: Final = "failed"
SENT: Final = "sent"

# How often one batch is sent again after a rollback before the producer gives up on it.
MAX_BATCH_ATTEMPTS: Final = 20


@attrs.frozen
class ProducerOptions:
    url: str
    destination: str = "queue://TEST"
    count: int | None = 1000
    duration: float | None = None  # perf: run this many seconds instead of a count
    message_size: int | None = None  # body bytes; None: "test message: SEQ"
    tx_batch: int = 0  # commit every K messages; 0: not transacted
    ack_mode: AckMode = AckMode.AUTO
    persistent: bool = True
    confirm: bool = True
    pipeline: int = 1  # sends in flight before waiting for the oldest confirmation
    sleep: float = 0.0  # seconds between messages
    user: str | None = None
    password: str | None = None
    record: str | None = None
    first_seq: int = 0


@attrs.define
class ProducerResult:
    summary: dict[str, Any]
    ok: bool  # every message confirmed (or sent, when not confirmed)


OutcomeListener = Callable[[int, str], None]


class _Run:
    """One producer run: its connection, counters and record."""

    def __init__(
        self,
        options: ProducerOptions,
        recorder: Recorder,
        progress: Progress,
        on_outcome: OutcomeListener | None,
    ) -> None:
        self.options = options
        self.recorder = recorder
        self.progress = progress
        self.on_outcome = on_outcome
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []
        self.attempted = 0
        self.commits = 0
        self.rolled_back = 0
        self.outcome_unknown = 0
        self.batches_retried = 0
        self.error: str | None = None

    def outcome(self, seq: int, message: Message, outcome: str, error: str | None = None) -> None:
        self.outcomes[outcome] += 1
        entry: dict[str, Any] = {"seq": seq, "message_id": message.message_id, "outcome": outcome}
        if error is not None:
            entry["error"] = error
        self.recorder.write(entry)
        if self.on_outcome is not None:
            self.on_outcome(seq, outcome)

    def body(self, seq: int) -> bytes | str:
        size = self.options.message_size
        if size is None:
            return f"test message: {seq}"
        stamp = f"{seq}:".encode()
        return (stamp + b"x" * size)[:size] if size >= len(stamp) else b"x" * size

    def message(self, seq: int) -> Message:
        # The id is chosen here, so the record names it before the send; a send never
        # changes the message, and a retried batch sends these objects with these ids.
        return Message(
            body=self.body(seq),
            properties={"seq": seq},
            persistent=self.options.persistent,
            message_id=new_message_id(),
        )


def _classify(error: HaFailoverError) -> str:
    """The outcome of a send that ended with ``error``."""
    if isinstance(error, UnblockedError | CallTimeoutError | TransactionOutcomeUnknownError):
        return IN_DOUBT
    if isinstance(error, DisconnectedError):
        return IN_DOUBT  # it was written and the connection died unconfirmed
    return FAILED


def run_producer(
    options: ProducerOptions,
    *,
    stop: threading.Event | None = None,
    on_outcome: OutcomeListener | None = None,
    progress: Progress | None = None,
    on_connected: Callable[[Connection], None] | None = None,
) -> ProducerResult:
    """Send ``options.count`` messages (or for ``options.duration`` seconds); summarize.

    ``stop`` ends the run early (the messages in flight still get their outcome);
    ``on_outcome(seq, outcome)`` is called for each message as its outcome is known."""
    check_url(options.url)
    destination = check_destination(options.destination)
    stop = stop or threading.Event()
    progress = progress or Progress()
    recorder = Recorder(options.record)
    run = _Run(options, recorder, progress, on_outcome)
    started = time.monotonic()
    connection: Connection | None = None
    try:
        connection = connect(options.url, user=options.user, password=options.password)
        if on_connected is not None:
            on_connected(connection)
        session = connection.create_session(options.ack_mode)
        producer = session.create_producer(destination, confirm=options.confirm)
        deadline = None if options.duration is None else started + options.duration
        try:
            if session.transacted:
                _transacted(run, session, producer, stop, deadline, connection)
            else:
                _pipelined(run, producer, stop, deadline, connection)
        except KeyboardInterrupt:
            run.error = "interrupted"
    except HaFailoverError as exc:
        if isinstance(exc, LocalError):
            raise
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        progress.close()
        elapsed = time.monotonic() - started
        summary = _summary(run, elapsed, connection)
        if connection is not None:
            connection.close()
        recorder.close()
    wanted = SENT if not (options.confirm and options.persistent) else CONFIRMED
    ok = run.error is None and run.outcomes[wanted] == run.attempted
    return ProducerResult(summary=summary, ok=ok)


def _more(run: _Run, seq: int, stop: threading.Event, deadline: float | None) -> bool:
    if stop.is_set():
        return False
    if deadline is not None:
        return time.monotonic() < deadline
    count = run.options.count
    return count is None or seq < run.options.first_seq + count


def _show(run: _Run, connection: Connection) -> None:
    count = run.options.count
    total = f"/{count}" if count is not None and run.options.duration is None else ""
    run.progress.update(
        f"producer: {run.outcomes[CONFIRMED] + run.outcomes[SENT]}{total} sent, "
        f"{run.outcomes[IN_DOUBT]} in doubt, {connection.statistics().failovers} failover(s)"
    )


def _pipelined(
    run: _Run,
    producer: Producer,
    stop: threading.Event,
    deadline: float | None,
    connection: Connection,
) -> None:
    """Sends with up to ``pipeline`` confirmations outstanding; outcomes in send order."""
    in_flight: collections.deque[tuple[int, Message, SendCompletion, float]] = collections.deque()
    confirmed = run.options.confirm and run.options.persistent

    def settle_oldest() -> None:
        seq, message, completion, sent_at = in_flight.popleft()
        try:
            completion.result()
        except HaFailoverError as exc:
            run.outcome(seq, message, _classify(exc), f"{type(exc).__name__}: {exc}")
            if isinstance(exc, DisconnectedError):
                raise
            return
        run.latencies.append(time.monotonic() - sent_at)
        run.outcome(seq, message, CONFIRMED if confirmed else SENT)

    seq = run.options.first_seq
    try:
        while _more(run, seq, stop, deadline):
            message = run.message(seq)
            sent_at = time.monotonic()
            run.attempted += 1
            try:
                completion = producer.send_async(message)
            except HaFailoverError as exc:
                run.outcome(seq, message, FAILED, f"{type(exc).__name__}: {exc}")
                raise
            in_flight.append((seq, message, completion, sent_at))
            seq += 1
            while len(in_flight) >= run.options.pipeline:
                settle_oldest()
            _show(run, connection)
            if run.options.sleep:
                stop.wait(run.options.sleep)
    finally:
        while in_flight:
            try:
                settle_oldest()
            except HaFailoverError:
                continue


def _transacted(
    run: _Run,
    session: Session,
    producer: Producer,
    stop: threading.Event,
    deadline: float | None,
    connection: Connection,
) -> None:
    """Batches of ``tx_batch`` sends, each committed; a rolled-back batch is sent again with
    the same messages (so the same duplicate ids) and committed again."""
    batch_size = max(1, run.options.tx_batch)
    seq = run.options.first_seq
    while _more(run, seq, stop, deadline):
        batch: list[tuple[int, Message]] = []
        while len(batch) < batch_size and _more(run, seq, stop, deadline):
            batch.append((seq, run.message(seq)))
            seq += 1
            if run.options.sleep and len(batch) < batch_size:
                stop.wait(run.options.sleep)
        run.attempted += len(batch)
        batch_started = time.monotonic()
        outcome, error = _commit_batch(run, session, producer, batch)
        if outcome == CONFIRMED:
            run.latencies.append(time.monotonic() - batch_started)
        for number, message in batch:
            run.outcome(number, message, outcome, error)
        _show(run, connection)
        if outcome != CONFIRMED:
            run.error = error
            return
        if run.options.sleep:
            stop.wait(run.options.sleep)


def _commit_batch(
    run: _Run, session: Session, producer: Producer, batch: list[tuple[int, Message]]
) -> tuple[str, str | None]:
    """Send and commit one batch until it commits; its outcome for every message in it."""
    unknown = False
    last_error = ""
    for attempt in range(MAX_BATCH_ATTEMPTS):
        if attempt:
            run.batches_retried += 1
        try:
            for _, message in batch:
                producer.send(message)
            session.commit()
        except TransactionRolledBackError as exc:
            run.rolled_back += 1
            last_error = f"{type(exc).__name__}: {exc}"
            continue
        except TransactionOutcomeUnknownError as exc:
            # Committed or not: sending the same ids again and committing makes it certain.
            run.outcome_unknown += 1
            unknown = True
            last_error = f"{type(exc).__name__}: {exc}"
            continue
        except (UnblockedError, CallTimeoutError) as exc:
            unknown = True
            last_error = f"{type(exc).__name__}: {exc}"
            _rollback_quietly(session)
            continue
        except DisconnectedError as exc:
            return (IN_DOUBT if unknown else FAILED), f"{type(exc).__name__}: {exc}"
        run.commits += 1
        return CONFIRMED, None
    return (IN_DOUBT if unknown else FAILED), last_error


def _rollback_quietly(session: Session) -> None:
    with contextlib.suppress(HaFailoverError):
        session.rollback()


def _summary(run: _Run, elapsed: float, connection: Connection | None) -> dict[str, Any]:
    options = run.options
    done = run.outcomes[CONFIRMED] + run.outcomes[SENT]
    latencies = sorted(run.latencies)
    summary: dict[str, Any] = {
        "command": "producer",
        "destination": str(check_destination(options.destination)),
        "transacted": options.ack_mode is AckMode.SESSION_TRANSACTED,
        "attempted": run.attempted,
        "confirmed": run.outcomes[CONFIRMED],
        "sent_unconfirmed": run.outcomes[SENT],
        "in_doubt": run.outcomes[IN_DOUBT],
        "failed": run.outcomes[FAILED],
        "duration": round(elapsed, 3),
        "messages_per_second": rate(done, elapsed),
    }
    if summary["transacted"]:
        summary.update(
            commits=run.commits,
            transactions_rolled_back=run.rolled_back,
            commit_outcome_unknown=run.outcome_unknown,
            batches_retried=run.batches_retried,
        )
    if latencies:
        summary["latency_ms"] = {
            "p50": round(percentile(latencies, 0.50) * 1000, 2),
            "p99": round(percentile(latencies, 0.99) * 1000, 2),
            "max": round(latencies[-1] * 1000, 2),
        }
    if connection is not None:
        summary.update(connection_summary(connection))
    if run.error is not None:
        summary["error"] = run.error
    return summary
