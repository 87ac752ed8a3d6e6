"""Zero prefetch on the bundled pair: on AMQP a consumer with prefetch=0 holds no message it
did not ask for (fair dispatch beside a consumer that does not receive; a receive that timed
out left no credit behind), and a failover during a waiting receive loses nothing and hands
out nothing twice. On STOMP prefetch=0 is refused, saying why."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import hafailover
from hafailover import ConfigurationError, Message, aio
from reference_broker import BrokerPair

from .support import drain, seqs, url_for, wait_until

pytestmark = pytest.mark.timeout(120)


def test_stomp_refuses_zero_prefetch_and_says_why(pair: BrokerPair) -> None:
    with hafailover.connect(url_for(pair, "stomp")) as connection:
        with pytest.raises(ConfigurationError, match="STOMP") as refused:
            connection.create_session().create_consumer("queue://z", prefetch=0)
        assert "prefetch=1" in str(refused.value)


def test_an_idle_pull_consumer_holds_nothing(pair: BrokerPair) -> None:
    """A pull consumer that is not receiving, or whose receive timed out, holds no message:
    its neighbour gets them all. (With prefetch=1 it would hold one.)"""
    with hafailover.connect(url_for(pair, "amqp")) as connection:
        session = connection.create_session()
        idle = session.create_consumer("queue://pull", prefetch=0)
        busy = session.create_consumer("queue://pull", prefetch=0)
        connection.start()
        assert idle.receive(0.3) is None  # gave credit, then drained it
        producer = session.create_producer("queue://pull")
        for n in range(10):
            producer.send("m", headers={"seq": n})
        got = []
        while (message := busy.receive(2.0)) is not None:
            got.append(int(str(message.properties["seq"])))
        assert got == list(range(10))
        with pytest.raises(ConfigurationError, match="listener"):
            idle.set_message_listener(lambda message: None)


def test_a_receive_that_times_out_returns_what_its_drain_brought(pair: BrokerPair) -> None:
    """receive_no_wait on a pull consumer asks and drains at once: a waiting message comes
    back with the drain and is returned, not left in a buffer."""
    with hafailover.connect(url_for(pair, "amqp")) as connection:
        session = connection.create_session()
        session.create_producer("queue://nowait").send("waiting", headers={"seq": 1})
        consumer = session.create_consumer("queue://nowait", prefetch=0)
        connection.start()
        deadline = time.monotonic() + 10
        message: Message | None = None
        while message is None and time.monotonic() < deadline:
            message = consumer.receive(0.05)
        assert message is not None and message.text == "waiting"


def test_a_failover_during_a_waiting_receive_loses_nothing_and_repeats_nothing(
    pair: BrokerPair,
) -> None:
    """The consumer waits in receive() with its one credit on the live (every earlier
    acknowledge confirmed: block_on_acknowledge) when the live is killed; what is sent
    after the failover reaches that receive through the new link, each message once."""
    received: list[int] = []
    errors: list[BaseException] = []
    url = url_for(pair, "amqp")

    def consume() -> None:
        try:
            with hafailover.connect(f"{url}&block_on_acknowledge=true") as connection:
                consumer = connection.create_session().create_consumer("queue://pf", prefetch=0)
                connection.start()
                while len(received) < 40:
                    message = consumer.receive(60)  # one receive waits through the failover
                    if message is not None:
                        received.append(int(str(message.properties["seq"])))
                again = consumer.receive(1.0)  # anything handed out twice would come now
                if again is not None:
                    received.append(int(str(again.properties["seq"])))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://pf")
        for n in range(20):
            producer.send("before", headers={"seq": n})
        wait_until(lambda: len(received) >= 20, 30, "the first messages")
        time.sleep(0.5)  # the consumer confirms the last acknowledge and waits, with credit
        pair.kill(pair.live)
        for n in range(20, 40):
            producer.send("after", headers={"seq": n})  # waits for the failover (F1)
        # Well before the waiting receive's own timeout: it asked again on the new link.
        wait_until(lambda: len(received) >= 40, 20, "every message")
    consumer.join(60)
    assert not consumer.is_alive(), f"received {sorted(received)}"
    assert not errors, errors
    assert sorted(received) == list(range(40)), "lost or repeated"
    assert seqs(drain(url, "queue://pf", idle=0.5)) == []


def test_an_asyncio_pull_consumer_gets_what_is_sent_while_it_waits(pair: BrokerPair) -> None:
    async def run() -> list[str]:
        async with await aio.connect(url_for(pair, "amqp")) as connection:
            session = await connection.create_session()
            consumer = await session.create_consumer("queue://aio-pull", prefetch=0)
            connection.start()
            assert await consumer.receive(0.2) is None
            waiting = asyncio.ensure_future(consumer.receive(20))
            await asyncio.sleep(0.3)
            await session.create_producer("queue://aio-pull").send("late", headers={"seq": 7})
            message = await waiting
            return [] if message is None else [message.text]

    assert asyncio.run(run()) == ["late"]


def test_an_asyncio_pull_whose_caller_gave_up_keeps_what_its_credit_brought(
    pair: BrokerPair,
) -> None:
    """A cancelled receive (asyncio.wait_for's timeout) leaves its credit with the broker:
    what the broker sends with it afterwards goes to the next receive, never lost."""

    async def run() -> list[str]:
        async with await aio.connect(url_for(pair, "amqp")) as connection:
            session = await connection.create_session()
            consumer = await session.create_consumer("queue://aio-gave-up", prefetch=0)
            connection.start()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(consumer.receive(10), 0.3)  # its credit stays
            await session.create_producer("queue://aio-gave-up").send("taken", headers={"seq": 1})
            message = await consumer.receive(10)
            return [] if message is None else [message.text]

    assert asyncio.run(run()) == ["taken"]
