"""Acknowledge rules through the whole driver, against the scripted broker: a dirty
CLIENT session across two reconnects (F8), and a message listener that raises (JMS
redelivers its message in the automatic modes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import hafailover
from hafailover import AckMode, Message, StaleAcknowledgeError

from .fake import FakeBroker, link_factory
from .test_failover_driver import Heard, failed_over, lose, url, wait_until

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    started = FakeBroker()
    started.start()
    yield started
    started.stop()


@pytest.mark.parametrize("mode", [AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL])
def test_f8_a_dirty_session_still_raises_after_a_second_reconnect(
    broker: FakeBroker, mode: AckMode
) -> None:
    with hafailover.connect(
        url(), exception_listener=Heard(), link_factory=link_factory(broker)
    ) as c:
        session = c.create_session(mode)
        consumer = session.create_consumer("queue://work")
        c.create_session().create_producer("queue://work").send("job")
        c.start()
        message = consumer.receive(5)
        assert message is not None
        for count in (1, 2):  # two reconnects, nothing acknowledged or recovered between
            with broker.paused():
                broker.answers.append("fresh")
                lose(broker.current(), "reader")
            wait_until(failed_over(c, count), f"failover {count}")
        with pytest.raises(StaleAcknowledgeError):
            message.acknowledge()
        again = consumer.receive(5)  # the session recovered: the message comes again
        assert again is not None and again.body == "job"
        again.acknowledge()  # clean now
        assert broker.violations == []


@pytest.mark.parametrize("mode", [AckMode.AUTO, AckMode.DUPS_OK])
def test_a_message_whose_listener_raises_is_delivered_again(
    broker: FakeBroker, mode: AckMode
) -> None:
    seen: list[Message] = []
    done = threading.Event()

    def listener(message: Message) -> None:
        seen.append(message)
        if len(seen) == 1:
            raise RuntimeError("the application failed on its first try")
        done.set()

    with hafailover.connect(url(), link_factory=link_factory(broker)) as c:
        consumer = c.create_session(mode).create_consumer("queue://work")
        consumer.set_message_listener(listener)
        c.create_session().create_producer("queue://work").send("job")
        c.start()
        assert done.wait(5), "the message was not delivered again"
        assert [m.body for m in seen] == ["job", "job"]
        wait_until(lambda: not broker.current().session.unacked, "the acknowledge")  # type: ignore[union-attr]
        assert broker.stored("work") == []
