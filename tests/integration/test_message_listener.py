"""A message listener that raises, against the bundled pair: in AUTO and DUPS_OK the
message is not acknowledged but given back, and the broker delivers it again, marked
redelivered with its delivery count raised (JMS); in CLIENT mode it stays the
application's until it acknowledges or recovers."""

from __future__ import annotations

import threading

import pytest

import hafailover
from hafailover import AckMode, Message
from reference_broker import BrokerPair

from .support import drain, url_for

pytestmark = pytest.mark.timeout(60)


def test_a_message_whose_listener_raises_comes_again(pair: BrokerPair, protocol: str) -> None:
    url = url_for(pair, protocol)
    for mode in (AckMode.AUTO, AckMode.DUPS_OK):  # one pair for both modes
        queue = f"queue://listener-raises-{mode.value}"
        seen: list[Message] = []
        done = threading.Event()

        def listener(
            message: Message, seen: list[Message] = seen, done: threading.Event = done
        ) -> None:
            seen.append(message)
            if str(message.properties.get("n")) == "1" and len(seen) < 3:
                raise RuntimeError("failed on its first try")
            if len(seen) == 4:
                done.set()

        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer(queue)
            for n in range(3):
                producer.send(f"m{n}", headers={"n": n})
            consumer = connection.create_session(mode).create_consumer(queue)
            consumer.set_message_listener(listener)
            connection.start()
            assert done.wait(20), f"{mode.value}: listener saw {[m.properties for m in seen]}"
            bodies = sorted(m.text for m in seen)
            assert bodies == ["m0", "m1", "m1", "m2"], mode
            again = [m for m in seen if str(m.properties.get("n")) == "1"][1]
            assert again.redelivered, mode
            assert again.delivery_count >= 1, mode
            consumer.close()
        assert drain(url, queue, idle=0.5) == []  # every message acknowledged once


def test_a_client_acknowledge_listener_that_raises_keeps_its_message(
    pair: BrokerPair, protocol: str
) -> None:
    url = url_for(pair, protocol)
    queue = "queue://listener-raises-client"
    seen: list[Message] = []
    done = threading.Event()

    def listener(message: Message) -> None:
        seen.append(message)
        done.set()
        raise RuntimeError("the application fails; it acknowledges nothing")

    with hafailover.connect(url) as connection:
        connection.create_session().create_producer(queue).send("kept")
        session = connection.create_session(AckMode.CLIENT)
        session.create_consumer(queue).set_message_listener(listener)
        connection.start()
        assert done.wait(20)
        connection.stop()
        assert len(seen) == 1  # not given back: no redelivery until recover or close
    left = drain(url, queue, idle=0.5)
    assert [m.redelivered for m in left] == [True]
