"""Consumers of one shared subscription on one connection share their duplicate window: a
copy that reaches another of them than the first is dropped too (scripted broker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import hafailover
from hafailover import AckMode, Message

from .fake import FAST_URL, FakeBroker, link_factory

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    started = FakeBroker(duplicate_detection=False)  # it stores every copy, as RabbitMQ does
    started.start()
    yield started
    started.stop()


def put(broker: FakeBroker, message: Message) -> None:
    with broker.lock:
        broker.queues["prices"].append(message)


@pytest.mark.parametrize("shared", [True, False])
def test_a_copy_is_dropped_by_another_consumer_of_the_shared_subscription(
    broker: FakeBroker, shared: bool
) -> None:
    url = f"{FAST_URL}&consumer_dedup=100&client_id=app"
    with hafailover.connect(url, link_factory=link_factory(broker)) as connection:
        first_session = connection.create_session(AckMode.AUTO)
        other_session = connection.create_session(AckMode.AUTO)
        first = first_session.create_shared_durable_consumer("topic://prices", "pool")
        connection.start()
        put(broker, Message("tick", message_id="m-1"))
        got = first.receive(5)
        assert got is not None
        assert got.text == "tick"
        if shared:
            other = other_session.create_shared_durable_consumer("topic://prices", "pool")
        else:  # a subscription of its own: its own window
            other = other_session.create_shared_durable_consumer("topic://prices", "board")
        first.close()
        put(broker, Message("tick", message_id="m-1"))  # the copy a lost acknowledge brings
        copy = other.receive(0.5)
        if shared:
            assert copy is None
            assert other.duplicates_dropped == 1
        else:
            assert copy is not None


def test_a_shared_window_kept_in_a_file_is_written_on_by_the_consumer_left(
    broker: FakeBroker, tmp_path: object
) -> None:
    """consumer_dedup_file with a shared subscription: the second consumer shares the
    first one's window and file (no lock conflict); when the first closes, the second goes
    on writing the file, so a later consumer reads back what the second had."""
    from hafailover.core.dedup import replay

    path = f"{tmp_path}/window"
    url = f"{FAST_URL}&consumer_dedup=100&client_id=app&consumer_dedup_file={path}"
    with hafailover.connect(url, link_factory=link_factory(broker)) as connection:
        session = connection.create_session(AckMode.AUTO)
        first = session.create_shared_durable_consumer("topic://prices", "pool")
        second = session.create_shared_durable_consumer("topic://prices", "pool")
        connection.start()
        first.close()
        put(broker, Message("tick", message_id="m-2"))
        got = second.receive(5)
        assert got is not None and got.text == "tick"
    with open(path, "rb") as kept:
        assert replay(kept.read(), 100)[0] == ("m-2",)


def test_a_consumer_refused_by_the_subscription_rules_lets_go_of_its_dedup_file(
    broker: FakeBroker, tmp_path: pytest.TempPathFactory
) -> None:
    """A second consumer of a durable subscription is refused (JMS: one at a time); the
    duplicate-window file it opened first must not stay locked for the process's life."""
    url = f"{FAST_URL}&consumer_dedup=100&client_id=app&consumer_dedup_file={tmp_path}/window"
    with hafailover.connect(url, link_factory=link_factory(broker)) as connection:
        session = connection.create_session(AckMode.AUTO)
        first = session.create_durable_consumer("topic://prices", "audit", dedup=0)  # no file
        with pytest.raises(hafailover.HaFailoverError, match="audit"):
            session.create_durable_consumer("topic://prices", "audit")  # opens it, refused
        first.close()
        again = session.create_durable_consumer("topic://prices", "audit")
        again.close()
