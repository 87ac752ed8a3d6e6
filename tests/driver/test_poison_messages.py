"""max_redeliveries against the scripted broker, which counts no failed deliveries (as
RabbitMQ): the consumer counts them itself, the consumer's value overrides the URL's, and a
poison message is rejected once, never handed out again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import hafailover
from hafailover import AckMode, ConfigurationError, Message

from .fake import FAST_URL, FakeBroker, link_factory

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    started = FakeBroker()
    started.start()
    yield started
    started.stop()


@pytest.mark.parametrize(("per_consumer", "deliveries"), [(None, 4), (1, 2), (0, 1)])
def test_a_poison_message_is_rejected_after_max_redeliveries(
    broker: FakeBroker, per_consumer: int | None, deliveries: int
) -> None:
    url = f"{FAST_URL}&max_redeliveries=3"
    calls: list[int] = []
    lock = threading.Lock()

    def always_fails(message: Message) -> None:
        with lock:
            calls.append(message.delivery_count)
        raise RuntimeError("this message always fails")

    with hafailover.connect(url, link_factory=link_factory(broker)) as connection:
        session = connection.create_session(AckMode.AUTO)
        with broker.lock:
            broker.queues["orders"].append(Message("poison", message_id="m-1"))
        consumer = session.create_consumer("queue://orders", max_redeliveries=per_consumer)
        consumer.set_message_listener(always_fails)
        connection.start()
        deadline = time.monotonic() + 10
        while not broker.dead_letters and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert [m.text for m in broker.dead_letters] == ["poison"]
        assert len(calls) == deliveries
        assert consumer.rejected == 1


def test_without_a_limit_a_failing_message_keeps_coming(broker: FakeBroker) -> None:
    calls: list[int] = []
    with hafailover.connect(FAST_URL, link_factory=link_factory(broker)) as connection:
        session = connection.create_session(AckMode.AUTO)
        with broker.lock:
            broker.queues["orders"].append(Message("poison", message_id="m-1"))
        consumer = session.create_consumer("queue://orders")
        consumer.set_message_listener(lambda m: (calls.append(1), 1 / 0))
        connection.start()
        deadline = time.monotonic() + 10
        while len(calls) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) >= 20
        assert broker.dead_letters == []


@pytest.mark.parametrize("bad", [-2, 1.5, True])
def test_a_bad_max_redeliveries_is_refused_by_name(broker: FakeBroker, bad: object) -> None:
    with hafailover.connect(FAST_URL, link_factory=link_factory(broker)) as connection:
        session = connection.create_session(AckMode.AUTO)
        with pytest.raises(ConfigurationError, match="max_redeliveries"):
            session.create_consumer("queue://orders", max_redeliveries=bad)  # type: ignore[arg-type]
