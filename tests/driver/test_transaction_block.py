"""``session.transaction(retries=N)``: run, commit, and run again what a failover rolled back;
never retry an unknown outcome on a broker that would store the messages twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import hafailover
from hafailover import (
    AckMode,
    ConfigurationError,
    IllegalStateError,
    Message,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
)

from .fake import FakeBroker, link_factory
from .test_failover_driver import url, wait_until

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=[True, False], ids=["dedup", "no-dedup"])
def broker(request: pytest.FixtureRequest) -> Iterator[FakeBroker]:
    started = FakeBroker(duplicate_detection=request.param)
    started.start()
    yield started
    started.stop()


@pytest.fixture
def connection(broker: FakeBroker) -> Iterator[hafailover.Connection]:
    with hafailover.connect(url(), link_factory=link_factory(broker)) as opened:
        yield opened


def bodies(broker: FakeBroker) -> list[str]:
    return [m.text for m in broker.stored("orders")]


def test_a_block_that_commits_runs_once(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    session = connection.create_session(AckMode.SESSION_TRANSACTED)
    producer = session.create_producer("queue://orders")
    runs = []
    for attempt in session.transaction(retries=2):
        with attempt:
            runs.append(attempt.number)
            producer.send("a")
            producer.send("b")
    assert runs == [1]
    assert bodies(broker) == ["a", "b"]


def test_a_block_a_failover_rolled_back_runs_again_with_the_same_messages(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    session = connection.create_session(AckMode.SESSION_TRANSACTED)
    producer = session.create_producer("queue://orders")
    batch = [Message(body="a"), Message(body="b")]
    ids = []
    for attempt in session.transaction(retries=2):
        with attempt:
            ids.extend(producer.send(message).message_id for message in batch)
            if attempt.number == 1:
                broker.answers.append("fresh")  # the transaction dies with its session
                for thread in broker.current().lose(noticed_by=("reader",)):
                    thread.join(5)
                wait_until(lambda: connection.statistics().failovers == 1, "the failover")
    assert attempt.number == 2
    assert ids[:2] == ids[2:]  # F13: the same objects went out with the same ids
    assert bodies(broker) == ["a", "b"]


def test_an_unknown_outcome_is_retried_only_where_duplicates_are_detected(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    session = connection.create_session(AckMode.SESSION_TRANSACTED)
    producer = session.create_producer("queue://orders")
    batch = [Message(body="a"), Message(body="b")]
    outcome: list[BaseException] = []
    attempts: list[int] = []

    def run() -> None:
        try:
            for attempt in session.transaction(retries=2):
                with attempt:
                    attempts.append(attempt.number)
                    for message in batch:
                        producer.send(message)
                    if attempt.number == 1:
                        broker._hold.acquire()  # the broker stops answering by itself
        except TransactionOutcomeUnknownError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    # The first commit reaches the broker, which commits it; the answer is lost.
    wait_until(lambda: broker._hold.locked(), "the block's first run")
    link = broker.current()
    wait_until(lambda: any(f.command == "COMMIT" for f in link.wire), "the COMMIT")
    link.deliver()
    broker.answers.append("fresh")
    for thread in link.lose(noticed_by=("reader",)):
        thread.join(5)
    broker._hold.release()
    worker.join(10)
    assert not worker.is_alive()
    assert bodies(broker) == ["a", "b"]  # committed once, whatever the client heard
    if broker.duplicate_detection:
        assert attempts == [1, 2] and not outcome  # the retry's copies were dropped
    else:
        assert attempts == [1]
        assert len(outcome) == 1 and "not retried" in str(outcome[0])


def test_a_block_that_raises_is_rolled_back_and_not_retried(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    session = connection.create_session(AckMode.SESSION_TRANSACTED)
    producer = session.create_producer("queue://orders")
    runs = []

    def block() -> None:
        for attempt in session.transaction(retries=3):
            with attempt:
                runs.append(attempt.number)
                producer.send("half")
                raise ValueError("bad order")

    with pytest.raises(ValueError, match="bad order"):
        block()
    assert runs == [1]
    producer.send("after")
    session.commit()
    assert bodies(broker) == ["after"]


def test_retries_run_out(broker: FakeBroker, connection: hafailover.Connection) -> None:
    session = connection.create_session(AckMode.SESSION_TRANSACTED)
    producer = session.create_producer("queue://orders")

    def block() -> None:
        for attempt in session.transaction(retries=1):
            with attempt:
                producer.send("never")
                broker.answers.append("fresh")
                for thread in broker.current().lose(noticed_by=("reader",)):
                    thread.join(5)
                count = attempt.number
                wait_until(lambda c=count: connection.statistics().failovers == c, "failover")

    with pytest.raises(TransactionRolledBackError, match="rolled back 2 time"):
        block()
    assert bodies(broker) == []


def test_the_decorator_form(broker: FakeBroker, connection: hafailover.Connection) -> None:
    session = connection.create_session(AckMode.SESSION_TRANSACTED)
    producer = session.create_producer("queue://orders")
    calls = []

    @session.transaction(retries=1)
    def move(body: str) -> str:
        calls.append(body)
        producer.send(body)
        if len(calls) == 1:
            broker.answers.append("fresh")
            for thread in broker.current().lose(noticed_by=("reader",)):
                thread.join(5)
            wait_until(lambda: connection.statistics().failovers == 1, "the failover")
        return body.upper()

    assert move("x") == "X"
    assert calls == ["x", "x"]
    assert bodies(broker) == ["x"]


def test_misuse_is_refused(connection: hafailover.Connection) -> None:
    with pytest.raises(IllegalStateError, match="transacted"):
        connection.create_session(AckMode.AUTO).transaction()
    session = connection.create_session(AckMode.SESSION_TRANSACTED)
    with pytest.raises(ConfigurationError, match="retries"):
        session.transaction(retries=-1)
    with pytest.raises(IllegalStateError, match="not used"):
        for _attempt in session.transaction(retries=1):
            pass


def test_a_commit_the_link_refuses_to_write_fails_with_that_error_at_once(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An END the link refuses without losing the connection (here: the transaction is
    unknown to it) ends the commit with that error, instead of leaving it registered until
    its call_timeout."""
    with hafailover.connect(
        url().replace("call_timeout=5s", "call_timeout=30s"), link_factory=link_factory(broker)
    ) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        session.create_producer("queue://orders").send(Message(body="1"))

        def refuse(self: object, tx: object, *, commit: bool, token: int) -> None:
            raise IllegalStateError(f"no transaction {tx} on this link")

        monkeypatch.setattr(type(connection._link), "end", refuse)
        started = time.monotonic()
        with pytest.raises(IllegalStateError, match="no transaction"):
            session.commit()
        assert time.monotonic() - started < 10  # not its call_timeout (30 s)
