"""Acknowledge rules through the whole driver, against the scripted broker: a dirty
CLIENT session across two reconnects (F8), and a message listener that raises (JMS
redelivers its message in the automatic modes)."""

from __future__ import annotations

import threading

import pytest

import hafailover
from hafailover import AckMode, Message, StaleAcknowledgeError

from .fake import FakeBroker, link_factory
from .test_failover_driver import Heard, failed_over, lose, url, wait_until

pytestmark = pytest.mark.timeout(30)


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


SCENARIOS = {
    # recover() right after a reattach: the server's resends of what the client held come
    # after the recover gave those deliveries back.
    "recover-after-reattach": [
        ("queue_work", 2),
        ("lose", ("writer",), ["refuse", "reattach, then reported lost", "reattach"]),
        ("recover",),
        ("receive",),
        ("receive",),
        ("receive",),
    ],
    # recover() before a loss: its give-backs never reached the server, which resends the
    # deliveries under their old tags, then reads the replayed give-backs.
    "recover-replayed-by-a-reattach": [
        ("queue_work", 3),
        ("recover",),
        ("lose", ("reader",), ["refuse", "reattach, then reported lost", "reattach"]),
        ("receive",),
        ("receive",),
        ("lose", ("writer", "reader"), ["fresh, then reported lost", "fresh"]),
        ("receive",),
    ],
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_f4_f8_a_delivery_given_back_never_comes_back_under_its_old_tag(scenario: str) -> None:
    """Found by the stateful test's check that an acknowledged message never comes again:
    a reattached server resends what the session held under the same tags, including
    deliveries the session had given back (recover) before the server read the give-back;
    handed out, acknowledged, they came again under their new tags."""
    from .test_driver_under_failover import DriverUnderFailover

    for _ in range(5):  # the resends race the application: five runs make it likely
        state = DriverUnderFailover()
        try:
            for step in SCENARIOS[scenario]:
                if step[0] == "queue_work":
                    state.queue_work(step[1])
                elif step[0] == "lose":
                    state.lose_the_connection(step[1], list(step[2]))
                elif step[0] == "recover":
                    state.recover()
                else:
                    state.receive_and_acknowledge()  # asserts: never one acknowledged
            state.teardown()
        finally:
            state.connection.close()
            state.broker.stop()


def test_f8_a_give_back_that_could_not_be_written_leaves_the_message_deliverable(
    broker: FakeBroker,
) -> None:
    """recover() on a link that died unnoticed: the give-back's write fails, which starts
    the failover; the reattached server sends the message again under its old tag, and
    that copy is delivered (it was never given back)."""
    with hafailover.connect(url(), link_factory=link_factory(broker)) as c:
        session = c.create_session(AckMode.CLIENT)
        consumer = session.create_consumer("queue://work")
        c.create_session().create_producer("queue://work").send("job")
        c.start()
        assert consumer.receive(5) is not None
        with broker.paused():
            broker.answers.append("reattach")
            lose(broker.current(), "writer")  # nobody noticed: the next write fails
            session.recover()
        wait_until(failed_over(c), "the failover the failed give-back started")
        again = consumer.receive(5)
        assert again is not None and again.body == "job"
        again.acknowledge()
        assert broker.violations == []
