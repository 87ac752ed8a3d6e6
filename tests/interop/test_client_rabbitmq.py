"""The public client against RabbitMQ 3.10, with the broker restarted in the middle of traffic.

One application (``run_application``, ``run_transacted_application``) takes a URL and is run
unchanged over STOMP and AMQP 1.0. RabbitMQ has no reattach extension and no duplicate
detection, so a failover there is a plain reconnect: the report says ``reattached`` False and
names "reattach" among what the broker lacks; consumers are recreated under the same objects;
a send whose confirmation was outstanding when the connection died is released with
UnblockedError (in doubt: it may or may not be stored) and never resent, since with
``duplicate_detection=false`` a resend could store it twice.

What survives a restart on RabbitMQ 3.10 (checked with ``rabbitmqctl list_queues`` across
``stop_app``/``start_app``):

- STOMP: a SEND or SUBSCRIBE to ``/queue/x`` (the adapter's form of ``queue://x``) declares a
  durable queue, and the adapter marks persistent messages ``persistent:true``, so confirmed
  messages survive. No ``/amq/queue/`` or ``durable`` header is needed.
- AMQP 1.0: the plugin declares ``/queue/x`` with the durability of the link's terminus (the
  target of a sender, the source of a receiver), and the adapter asks for a durable one on
  RabbitMQ, for senders and receivers alike, so the queue and its persistent messages survive
  as over STOMP. An attach whose durability differs from an existing queue's is refused
  ("inequivalent arg 'durable'") by ending the AMQP session: the send gets that refusal as a
  ProtocolError (it was never transferred), not UnblockedError, and the connection fails over.
- AMQP 1.0 acknowledges: RabbitMQ 3.10 ends the session on an outcome sent unsettled, so the
  adapter sends outcomes settled and cannot wait for the broker to have taken them: after a
  restart more than the one message being delivered may come again (no loss, duplicates).
- AMQP 1.0 transactions: RabbitMQ 3.10 refuses the coordinator link (amqp:not-implemented),
  so the transacted application runs on STOMP only, and
  ``test_amqp_transacted_session_is_refused_clearly`` pins the refusal.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

import hafailover
from hafailover import (
    AckMode,
    AcknowledgeFailedError,
    Connection,
    ConnectionEvent,
    FailoverCompleted,
    FailoverNotice,
    FailoverReport,
    HaFailoverError,
    Message,
    ProtocolError,
    SendCompletion,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from tests.interop.conftest import RabbitMQ, RabbitMQControl, declare_nondurable_queue

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]

OPTIONS = (
    "reconnect_attempts=-1&retry_interval=200ms&max_retry_interval=1s&heartbeat=1s"
    "&duplicate_detection=false"
)
PIPELINE = 10  # sends in flight at once, so a restart is likely to catch some unconfirmed
BEFORE = 200  # confirmed sends before the disruption
AFTER = 200  # confirmed sends after it
DRAIN_S = 10.0  # how long the consumer waits for what is missing once the producer is done


def failover_url(rabbitmq: RabbitMQ, protocol: str) -> str:
    port = rabbitmq.stomp_port if protocol == "stomp" else rabbitmq.amqp_port
    return (
        f"failover:({protocol}://{rabbitmq.user}:{rabbitmq.password}@{rabbitmq.host}:{port})"
        f"?{OPTIONS}"
    )


def unique_queue(what: str) -> str:
    return f"queue://hafailover-client-{what}-{uuid.uuid4().hex[:10]}"


# --- the application ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the application saw: the record the loss checks are made on."""

    confirmed: list[int] = field(default_factory=list)  # seq of every send that completed
    in_doubt: dict[int, str] = field(default_factory=dict)  # seq -> message id, UnblockedError
    received: list[int] = field(default_factory=list)  # seq of every message received
    ack_failures: int = 0  # AcknowledgeFailedError from receive (F6)
    first_after: int | None = None  # first seq sent once the disruption had ended
    notices: list[HaFailoverError] = field(default_factory=list)  # the exception listener
    events: list[ConnectionEvent] = field(default_factory=list)
    reports: tuple[FailoverReport, ...] = ()
    errors: list[BaseException] = field(default_factory=list)  # anything unexpected

    @property
    def lost(self) -> set[int]:
        return set(self.confirmed) - set(self.received)

    @property
    def unexpected(self) -> set[int]:
        return set(self.received) - set(self.confirmed) - set(self.in_doubt)

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in Counter(self.received).values())


class _Consumer(threading.Thread):
    """Receives on its own session and records each message until told to stop."""

    def __init__(
        self,
        connection: Connection,
        queue: str,
        outcome: Outcome,
        record: Callable[[Message], None],
    ) -> None:
        super().__init__(name="app-consumer", daemon=True)
        session = connection.create_session(AckMode.AUTO)
        self.consumer = session.create_consumer(queue)
        self.outcome = outcome
        self.record = record
        self.stop_when: Callable[[], bool] = lambda: False

    def run(self) -> None:
        try:
            while not self.stop_when():
                try:
                    message = self.consumer.receive(timeout=0.2)
                except AcknowledgeFailedError:
                    # F6: the message's acknowledge was lost with the connection; the broker
                    # delivers it again, so nothing is lost and at most one comes twice.
                    self.outcome.ack_failures += 1
                    continue
                if message is not None:
                    self.record(message)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self.outcome.errors.append(exc)


def _connect(url: str, outcome: Outcome) -> Connection:
    connection = hafailover.connect(url, exception_listener=outcome.notices.append)
    connection.add_event_listener(outcome.events.append)
    return connection


def _drain(consumer: _Consumer, outcome: Outcome, expected: Callable[[], set[int]]) -> None:
    """Let the consumer run until it has every expected seq or DRAIN_S pass in silence."""
    last_count, last_change = -1, time.monotonic()

    def done() -> bool:
        nonlocal last_count, last_change
        if expected() <= set(outcome.received):
            return True
        if len(outcome.received) != last_count:
            last_count, last_change = len(outcome.received), time.monotonic()
        return time.monotonic() - last_change > DRAIN_S

    consumer.stop_when = done
    consumer.join(DRAIN_S * 3)


def run_application(url: str, queue: str, disruption: Callable[[], object]) -> Outcome:
    """Produce and consume ``seq``-numbered messages on ``queue`` through ``url``.

    A producer session pipelines persistent sends (send_async, PIPELINE in flight, then
    ``result()``: the same confirmation ``send()`` waits for) while a consumer session on
    another thread receives. After BEFORE confirmed sends ``disruption`` runs on a third
    thread and traffic goes on; the producer stops AFTER confirmed sends after it ended.
    A send released with UnblockedError is in doubt and is not sent again.
    """
    outcome = Outcome()
    with _connect(url, outcome) as connection:
        consumer = _Consumer(
            connection,
            queue,
            outcome,
            lambda message: outcome.received.append(int(message.properties["seq"])),
        )
        connection.start()
        consumer.start()
        producer = connection.create_session(AckMode.AUTO).create_producer(queue)
        disrupted = threading.Event()

        def disrupt() -> None:
            try:
                disruption()
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                outcome.errors.append(exc)
            finally:
                disrupted.set()

        disrupter = threading.Thread(target=disrupt, name="disruption", daemon=True)
        in_flight: deque[tuple[int, SendCompletion]] = deque()

        def settle_one() -> None:
            seq, completion = in_flight.popleft()
            try:
                completion.result(timeout=30)
            except UnblockedError:
                assert completion.message is not None
                assert completion.message.message_id is not None
                outcome.in_doubt[seq] = completion.message.message_id
            else:
                outcome.confirmed.append(seq)

        deadline = time.monotonic() + 40
        seq = 0
        while time.monotonic() < deadline:
            if len(outcome.confirmed) >= BEFORE and not disrupter.is_alive():
                if not disrupted.is_set():
                    disrupter.start()
                elif outcome.first_after is None:
                    outcome.first_after = seq
                elif len([s for s in outcome.confirmed if s >= outcome.first_after]) >= AFTER:
                    break
            in_flight.append((seq, producer.send_async(Message(b"x", properties={"seq": seq}))))
            seq += 1
            if len(in_flight) >= PIPELINE:
                settle_one()
            time.sleep(0.002)  # steady traffic rather than a flood
        while in_flight:
            settle_one()
        disrupter.join(60)
        _drain(consumer, outcome, lambda: set(outcome.confirmed))
        outcome.reports = connection.reports
    return outcome


@dataclass
class TxOutcome(Outcome):
    committed: list[tuple[int, int]] = field(default_factory=list)  # (batch, attempt)
    rolled_back: list[tuple[int, int]] = field(default_factory=list)
    unknown: list[tuple[int, int]] = field(default_factory=list)  # TransactionOutcomeUnknown
    received_attempts: list[tuple[int, int]] = field(default_factory=list)  # (batch, attempt)


def run_transacted_application(
    url: str,
    queue: str,
    *,
    batches: int,
    size: int,
    disruption: Callable[[], object],
    disrupt_in: int,
) -> TxOutcome:
    """Send ``batches`` transactions of ``size`` messages, each replayed until it commits.

    Each message carries ``seq``, ``batch`` and ``attempt``. In batch ``disrupt_in``, half-way
    through its first attempt, ``disruption`` runs (the broker goes away with the transaction
    open). A commit that raises TransactionRolledBackError is replayed on the same session (F9);
    one that raises TransactionOutcomeUnknownError is replayed too and recorded (without
    duplicate detection its first attempt may have been stored as well).
    """
    outcome = TxOutcome()
    with _connect(url, outcome) as connection:

        def record(message: Message) -> None:
            props = message.properties
            outcome.received_attempts.append((int(props["batch"]), int(props["attempt"])))
            outcome.received.append(int(props["seq"]))

        consumer = _Consumer(connection, queue, outcome, record)
        connection.start()
        consumer.start()
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer(queue)
        for batch in range(batches):
            attempt = 0
            while True:
                attempt += 1
                for i in range(size):
                    if batch == disrupt_in and attempt == 1 and i == size // 2:
                        disruption()
                    seq = batch * size + i
                    producer.send(
                        Message(b"t", properties={"seq": seq, "batch": batch, "attempt": attempt})
                    )
                try:
                    session.commit()
                except TransactionRolledBackError:
                    outcome.rolled_back.append((batch, attempt))
                    session.rollback()  # F9: succeeds; the batch is replayed below
                    continue
                except TransactionOutcomeUnknownError:
                    outcome.unknown.append((batch, attempt))
                    outcome.in_doubt.update({batch * size + i: "" for i in range(size)})
                    continue
                outcome.committed.append((batch, attempt))
                outcome.confirmed.extend(batch * size + i for i in range(size))
                break
        _drain(consumer, outcome, lambda: set(outcome.confirmed))
        outcome.reports = connection.reports
    return outcome


# --- checks ---------------------------------------------------------------------------------------


def check_reconnected(outcome: Outcome) -> FailoverReport:
    """One failover, by reconnect, said so to the exception and event listeners."""
    assert not outcome.errors, outcome.errors
    assert len(outcome.reports) == 1, [r.summary() for r in outcome.reports]
    report = outcome.reports[0]
    assert report.reattached is False
    assert "reattach" in report.degraded
    assert report.to_broker is not None
    assert report.resent == ()  # duplicate_detection=false: nothing is ever sent twice
    notices = [n for n in outcome.notices if isinstance(n, FailoverNotice)]
    assert len(notices) == 1, outcome.notices
    assert notices[0].reattached is False
    assert notices[0].report == report
    assert [e.report for e in outcome.events if isinstance(e, FailoverCompleted)] == [report]
    return report


def check_consumer_recreated(outcome: Outcome) -> None:
    """The consumer made before the restart receives what was sent after it."""
    assert outcome.first_after is not None
    after = {s for s in outcome.received if s >= outcome.first_after}
    confirmed_after = {s for s in outcome.confirmed if s >= outcome.first_after}
    assert len(confirmed_after) >= AFTER
    assert confirmed_after <= after, sorted(confirmed_after - after)[:20]


def check_in_doubt(outcome: Outcome, report: FailoverReport) -> None:
    """Every UnblockedError send is in the report's in-doubt list, and only those."""
    assert set(outcome.in_doubt.values()) == set(report.in_doubt)


# --- tests -------------------------------------------------------------------------------------


def test_stomp_restart_mid_traffic_loses_no_confirmed_send(
    rabbitmq: RabbitMQ, rabbitmq_control: RabbitMQControl
) -> None:
    outcome = run_application(
        failover_url(rabbitmq, "stomp"), unique_queue("stomp"), rabbitmq_control.restart
    )
    report = check_reconnected(outcome)
    check_consumer_recreated(outcome)
    check_in_doubt(outcome, report)
    assert not outcome.lost, sorted(outcome.lost)[:20]
    assert not outcome.unexpected, sorted(outcome.unexpected)[:20]
    # F6: per failover at most the one message being delivered comes again
    assert outcome.duplicates <= len(outcome.reports), Counter(outcome.received).most_common(3)


def test_amqp_restart_mid_traffic_loses_no_confirmed_send(
    rabbitmq: RabbitMQ, rabbitmq_control: RabbitMQControl
) -> None:
    outcome = run_application(
        failover_url(rabbitmq, "amqp"), unique_queue("amqp"), rabbitmq_control.restart
    )
    report = check_reconnected(outcome)
    check_consumer_recreated(outcome)
    check_in_doubt(outcome, report)
    # Confirmed before the restart as well as after: the queue is durable, so what it held
    # when the broker went away is still there when it comes back.
    assert not outcome.lost, sorted(outcome.lost)[:20]
    assert not outcome.unexpected, sorted(outcome.unexpected)[:20]
    # No bound on duplicates here, unlike STOMP: RabbitMQ 3.10's AMQP 1.0 plugin cannot
    # confirm an acknowledge (an unsettled outcome ends its session), so the adapter sends it
    # settled and the acknowledges still unprocessed when the broker stops come back.


def test_amqp_send_to_a_queue_of_another_durability_is_refused_clearly(
    rabbitmq: RabbitMQ,
) -> None:
    # A queue declared non-durable by another client: RabbitMQ refuses the adapter's durable
    # attach by ending the AMQP session. The send raises the refusal, not UnblockedError
    # ("outcome unknown"), so an application that retries in-doubt sends does not retry it
    # for ever; each attempt is refused the same way, and other queues go on working.
    name = f"hafailover-client-nondurable-{uuid.uuid4().hex[:10]}"
    declare_nondurable_queue(rabbitmq, name)
    outcome = Outcome()
    with _connect(failover_url(rabbitmq, "amqp"), outcome) as connection:
        session = connection.create_session(AckMode.AUTO)
        refused = session.create_producer(f"queue://{name}")
        for attempt in range(1, 3):
            with pytest.raises(ProtocolError, match="amqp:precondition-failed") as raised:
                refused.send(Message(b"never", properties={"seq": 1}))
            assert not isinstance(raised.value, UnblockedError)
            assert "inequivalent arg 'durable'" in str(raised.value)
            # The refusal ended the AMQP session, so the connection fails over. A send made
            # while it does would be in doubt, as any send cut by a loss: wait for it.
            deadline = time.monotonic() + 10
            while len(connection.reports) < attempt:
                assert time.monotonic() < deadline, "no failover after the refusal"
                time.sleep(0.05)
        queue = unique_queue("after-refusal")
        session.create_producer(queue).send(Message(b"fine", properties={"seq": 2}))
        consumer = session.create_consumer(queue)
        connection.start()
        message = consumer.receive(timeout=10)
        assert message is not None
        assert message.properties["seq"] in (2, "2")
        statistics = connection.statistics()
    assert statistics.in_doubt == 0
    assert not outcome.errors


def test_stomp_send_in_flight_when_the_broker_stops_answering_is_in_doubt(
    rabbitmq: RabbitMQ, rabbitmq_control: RabbitMQControl
) -> None:
    # Deterministic in-doubt: the node is frozen, a send goes out and its receipt cannot
    # come; the heart-beat declares the broker dead and the send is released, not resent.
    queue = unique_queue("in-doubt")
    outcome = Outcome()
    with _connect(failover_url(rabbitmq, "stomp"), outcome) as connection:
        producer = connection.create_session(AckMode.AUTO).create_producer(queue)
        producer.send(Message(b"before", properties={"seq": 0}))
        outcome.confirmed.append(0)
        with rabbitmq_control.paused():
            completion = producer.send_async(Message(b"frozen", properties={"seq": 1}))
            # the heart-beat (1 s) declares the silent broker dead after about 2 s; the send
            # may be released then or when the reconnect finds no session to reattach
            time.sleep(4)
        with pytest.raises(UnblockedError):
            completion.result(timeout=30)
        assert completion.message is not None
        outcome.in_doubt[1] = str(completion.message.message_id)
        producer.send(Message(b"after", properties={"seq": 2}))
        outcome.confirmed.append(2)
        consumer = connection.create_session(AckMode.AUTO).create_consumer(queue)
        connection.start()
        while (message := consumer.receive(timeout=3)) is not None:
            outcome.received.append(int(message.properties["seq"]))
        outcome.reports = connection.reports
        statistics = connection.statistics()
    report = check_reconnected(outcome)
    check_in_doubt(outcome, report)
    assert statistics.in_doubt == 1
    assert statistics.resent == 0
    assert not outcome.lost
    assert not outcome.unexpected
    assert outcome.received.count(1) <= 1  # in doubt: stored once or not at all, never twice


def test_stomp_transaction_open_at_restart_is_rolled_back_and_retried(
    rabbitmq: RabbitMQ, rabbitmq_control: RabbitMQControl
) -> None:
    outcome = run_transacted_application(
        failover_url(rabbitmq, "stomp"),
        unique_queue("tx"),
        batches=6,
        size=20,
        disruption=rabbitmq_control.restart,
        disrupt_in=2,
    )
    report = check_reconnected(outcome)
    assert report.transactions_rolled_back  # the producer's session had uncommitted sends
    # F9: the commit after the failover rolled back and raised; the replay committed
    assert outcome.rolled_back == [(2, 1)]
    assert outcome.unknown == []
    assert [b for b, _ in outcome.committed] == list(range(6))
    assert (2, 2) in outcome.committed
    assert not outcome.lost, sorted(outcome.lost)[:20]
    assert not outcome.unexpected
    # nothing of the rolled-back attempt is ever delivered
    assert (2, 1) not in set(outcome.received_attempts)
    assert outcome.duplicates <= len(outcome.reports)


def test_amqp_transacted_session_is_refused_clearly(rabbitmq: RabbitMQ) -> None:
    # RabbitMQ 3.10's AMQP 1.0 plugin has no transactions: it refuses the coordinator with
    # amqp:not-implemented and ends the AMQP session, which the adapter reports as a loss.
    # The application gets the refusal, not a hang; the connection fails over and the
    # application's other sessions go on working.
    outcome = Outcome()
    queue = unique_queue("amqp-tx")
    with _connect(failover_url(rabbitmq, "amqp"), outcome) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        with pytest.raises(ProtocolError, match="amqp:not-implemented"):
            session.create_producer(queue).send(b"never")
        other = connection.create_session(AckMode.AUTO)
        other.create_producer(queue).send(Message(b"plain", properties={"seq": 7}))
        consumer = other.create_consumer(queue)
        connection.start()
        message = consumer.receive(timeout=10)
        assert message is not None
        assert message.properties["seq"] in (7, "7")
