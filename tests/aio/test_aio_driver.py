"""hafailover.aio against the scripted broker of the driver's tests: the loop never waits
for the broker, not even through a failover, a receive is woken by what it waits for, a
cancelled send is reported in doubt. Milliseconds, every interleaving chosen by the test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from hafailover import (
    AckMode,
    AcknowledgeFailedError,
    ConfigurationError,
    FailoverCompleted,
    FailoverNotice,
    FailureDetected,
    HaFailoverError,
    IllegalStateError,
    StaleAcknowledgeError,
    aio,
)
from hafailover.message import Message
from tests.driver.fake import FakeBroker, link_factory

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")

FAST = "heartbeat=250ms&retry_interval=5ms&max_retry_interval=20ms&call_timeout=5s"
URL = f"failover:(stomp://app:pw@live:61613,stomp://app:pw@backup:61613)?{FAST}"


def run(test: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(asyncio.wait_for(test(), 20))


async def connected(broker: FakeBroker, listener: Any = None) -> aio.AsyncConnection:
    return await aio.connect(URL, link_factory=link_factory(broker), exception_listener=listener)


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


class Ticker:
    """A task that wants the loop every 10 ms and remembers its longest wait."""

    def __init__(self) -> None:
        self.largest_gap = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.largest_gap = max(self.largest_gap, now - last)
            last = now


@pytest.fixture
def broker() -> Any:
    started = FakeBroker()
    started.start()
    yield started
    started.stop()


def slow_failover(broker: FakeBroker, attempts: int = 15) -> None:
    """The next failover is refused ``attempts`` times (about 10-20 ms each) first."""
    broker.answers.extend(["refuse"] * attempts + ["fresh"])


def test_a_send_during_a_failover_waits_off_the_loop(broker: FakeBroker) -> None:
    async def test() -> None:
        async with await connected(broker) as connection:
            producer = (await connection.create_session()).create_producer("queue://orders")
            await producer.send("before")
            async with Ticker() as ticker:
                slow_failover(broker)
                for thread in broker.current().lose(noticed_by=("reader",)):
                    thread.join(5)
                assert connection.state != "connected"
                sent = await producer.send("during")  # waits on a worker thread (F1)
                assert connection.statistics().failovers == 1
            assert sent.message_id is not None
            assert ticker.largest_gap < 0.1, ticker.largest_gap
            assert [m.text for m in broker.stored("orders")] == ["before", "during"]

    run(test)


def test_a_waiting_receive_is_woken_by_a_delivery_and_waits_through_a_failover(
    broker: FakeBroker,
) -> None:
    async def test() -> None:
        async with await connected(broker) as connection:
            session = await connection.create_session(AckMode.CLIENT_INDIVIDUAL)
            consumer = await session.create_consumer("queue://orders")
            connection.start()
            assert await consumer.receive(0.05) is None
            waiting = asyncio.ensure_future(consumer.receive(5))
            await asyncio.sleep(0.02)
            assert not waiting.done()
            slow_failover(broker, 5)
            for thread in broker.current().lose(noticed_by=("heartbeat",)):
                thread.join(5)
            await eventually(lambda: connection.statistics().failovers == 1, "the failover")
            assert not waiting.done()
            with broker.lock:
                broker.queues["orders"].append(Message("after"))
            message = await waiting
            assert message is not None and message.text == "after"
            await session.acknowledge(message)

    run(test)


async def auto_consumer(
    broker: FakeBroker, connection: aio.AsyncConnection, messages: list[Message]
) -> aio.AsyncConsumer:
    """A started AUTO consumer of queue://orders with ``messages`` prefetched."""
    session = await connection.create_session(AckMode.AUTO)
    consumer = await session.create_consumer("queue://orders")
    with broker.lock:
        broker.queues["orders"].extend(messages)
    connection.start()
    await eventually(lambda: len(consumer.sync._buffer) == len(messages), "the deliveries")
    return consumer


def test_auto_receives_wait_for_the_previous_acknowledge_without_blocking(
    broker: FakeBroker,
) -> None:
    """F6 on the loop: the second AUTO delivery waits for the first one's acknowledge to
    be confirmed, on a future, while other tasks run."""

    async def test() -> None:
        async with await connected(broker) as connection:
            consumer = await auto_consumer(broker, connection, [Message("1"), Message("2")])
            async with Ticker() as ticker:
                with broker.paused():
                    first = await consumer.receive(5)
                    assert first is not None and first.text == "1"
                    second = asyncio.ensure_future(consumer.receive(5))
                    await asyncio.sleep(0.1)  # the broker reads nothing: no confirmation
                    assert not second.done()
                message = await second
            assert message is not None and message.text == "2"
            assert ticker.largest_gap < 0.1, ticker.largest_gap

    run(test)


def test_auto_receives_do_not_wait_for_an_acknowledge_in_flight(broker: FakeBroker) -> None:
    """Messages stamped with their sender's id: the second is handed out while the first
    one's acknowledge is unconfirmed (docs/client.md, AUTO acknowledges in flight)."""

    async def test() -> None:
        async with await connected(broker) as connection:
            consumer = await auto_consumer(
                broker, connection, [Message("1", message_id="m1"), Message("2", message_id="m2")]
            )
            with broker.paused():
                first = await consumer.receive(1)
                second = await consumer.receive(1)
            assert [m.text for m in (first, second) if m is not None] == ["1", "2"]

    run(test)


def test_an_acknowledge_never_confirmed_ends_a_receive_without_timeout(
    broker: FakeBroker,
) -> None:
    """The broker answers nothing: a receive with no timeout, waiting for the previous
    acknowledge F6 needs confirmed first, raises after the call timeout as the threaded
    receive does, and the loop goes on meanwhile."""

    async def test() -> None:
        url = URL.replace("call_timeout=5s", "call_timeout=300ms")
        async with await aio.connect(url, link_factory=link_factory(broker)) as connection:
            consumer = await auto_consumer(broker, connection, [Message("1"), Message("2")])
            async with Ticker() as ticker:
                with broker.paused():
                    first = await consumer.receive(1)
                    assert first is not None and first.text == "1"
                    started = time.monotonic()
                    with pytest.raises(AcknowledgeFailedError):
                        await consumer.receive()
                    assert time.monotonic() - started < 3
            assert ticker.largest_gap < 0.1, ticker.largest_gap
            second = await consumer.receive(5)
            assert second is not None and second.text == "2"

    run(test)


def test_a_receive_with_a_timeout_waits_for_an_acknowledge_past_the_call_timeout(
    broker: FakeBroker,
) -> None:
    """The caller's own timeout, longer than the call timeout, bounds the wait for the
    acknowledge F6 needs confirmed first, as in the threaded API: the broker confirms it
    late and the next message is returned."""

    async def test() -> None:
        url = URL.replace("call_timeout=5s", "call_timeout=300ms")
        async with await aio.connect(url, link_factory=link_factory(broker)) as connection:
            consumer = await auto_consumer(broker, connection, [Message("1"), Message("2")])
            with broker.paused():
                first = await consumer.receive(1)
                assert first is not None and first.text == "1"
                second = asyncio.ensure_future(consumer.receive(5))
                await asyncio.sleep(0.6)  # twice the call timeout, nothing confirmed
                assert not second.done()
            message = await second
            assert message is not None and message.text == "2"

    run(test)


def test_a_cancelled_send_is_reported_in_doubt_and_its_retry_is_stored_once(
    broker: FakeBroker,
) -> None:
    async def test() -> None:
        async with await connected(broker) as connection:
            events = connection.events()
            producer = (await connection.create_session()).create_producer("queue://orders")
            message = Message("important")
            with broker.paused():
                sending = asyncio.ensure_future(producer.send(message))
                await asyncio.sleep(0.02)
                sending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await sending
            notice = await asyncio.wait_for(anext(events), 5)
            assert isinstance(notice, aio.SendCancelled)
            assert notice.destination == "queue://orders"
            assert connection.cancelled_in_doubt == [notice]
            again = await producer.send(message)  # the same object: the same duplicate id
            assert again.message_id == notice.message_id
            await eventually(lambda: len(broker.stored("orders")) == 1, "the store")
            assert broker.stored_ids[notice.message_id or ""] == 1

    run(test)


def test_the_listener_and_the_event_stream_hear_a_failover_once(broker: FakeBroker) -> None:
    async def test() -> None:
        heard: list[HaFailoverError] = []

        async def listener(error: HaFailoverError) -> None:
            await asyncio.sleep(0)
            heard.append(error)

        async with await connected(broker, listener) as connection:
            events = connection.events()
            broker.answers.append("reattach")
            for thread in broker.current().lose(noticed_by=("reader", "heartbeat")):
                thread.join(5)
            detected = await asyncio.wait_for(anext(events), 5)
            completed = await asyncio.wait_for(anext(events), 5)
            assert isinstance(detected, FailureDetected)
            assert isinstance(completed, FailoverCompleted)
            assert completed.report.reattached
            await eventually(lambda: len(heard) == 1, "the listener")
            assert isinstance(heard[0], FailoverNotice)
        assert [event async for event in events] == []  # the stream ends with the connection

    run(test)


def test_an_async_transaction_block_runs_again_after_a_failover_rolled_it_back(
    broker: FakeBroker,
) -> None:
    async def test() -> None:
        async with await connected(broker) as connection:
            session = await connection.create_session(AckMode.SESSION_TRANSACTED)
            producer = session.create_producer("queue://orders")
            batch = [Message("a"), Message("b")]
            attempts = 0
            async for attempt in session.transaction(retries=2):
                async with attempt:
                    attempts += 1
                    for message in batch:
                        await producer.send(message)
                    if attempts == 1:  # the connection dies before the commit: rollback-only
                        broker.answers.append("fresh")
                        for thread in broker.current().lose(noticed_by=("reader",)):
                            thread.join(5)
                        await eventually(
                            lambda: connection.statistics().failovers == 1, "the failover"
                        )
            assert attempts == 2
            assert [m.text for m in broker.stored("orders")] == ["a", "b"]

    run(test)


def test_calls_that_only_wait_take_no_executor_thread(broker: FakeBroker) -> None:
    """Sends, receives, acknowledges, recover, flush, subscribing, closing a consumer or a
    session, creating a session while the connection fails over, and in a transacted
    session sends, commits, rollbacks and the transaction block all wait on the loop: with
    the loop's default executor shut down, any of them that needed a thread would raise
    (the scripted link, like STOMP's, has no call that blocks)."""

    async def test() -> None:
        connection = await connected(broker)
        refusing = ThreadPoolExecutor(max_workers=1)
        asyncio.get_running_loop().set_default_executor(refusing)
        refusing.shutdown()  # from here, a call on the default executor raises
        try:
            session = await connection.create_session(AckMode.CLIENT)
            consumer = await session.create_consumer("queue://orders")
            producer = (await connection.create_session()).create_producer("queue://orders")
            connection.start()
            await producer.send("1")
            first = await consumer.receive(5)
            assert first is not None and first.text == "1"
            await session.acknowledge(first)
            slow_failover(broker, 5)
            for thread in broker.current().lose(noticed_by=("reader",)):
                thread.join(5)
            assert connection.state != "connected"
            await connection.create_session()  # waits for the failover on the loop (F1)
            assert connection.statistics().failovers == 1
            producer.send_nowait("2")
            await producer.flush()
            second = await consumer.receive(5)
            assert second is not None and second.text == "2"
            await session.recover()
            again = await consumer.receive(5)
            assert again is not None and again.text == "2"
            await session.acknowledge()
            await consumer.close()
            transacted = await connection.create_session(AckMode.SESSION_TRANSACTED)
            sender = transacted.create_producer("queue://moved")
            await sender.send("kept")
            await transacted.commit()
            await sender.send("dropped")
            await transacted.rollback()
            async for attempt in transacted.transaction(retries=0):
                async with attempt:
                    await sender.send("in a block")
            assert [m.text for m in broker.stored("moved")] == ["kept", "in a block"]
            await transacted.close()
            await session.close()
        finally:
            connection.sync.close()

    run(test)


def test_a_release_waits_out_a_failover_on_the_loop(broker: FakeBroker) -> None:
    """``await session.release(message)`` serves its failover wait on the loop (with the
    default executor shut down, a thread would raise), and keeps release()'s rules: the
    message delivered before the failover is stale, one delivered after goes back alone."""

    async def test() -> None:
        connection = await connected(broker)
        refusing = ThreadPoolExecutor(max_workers=1)
        asyncio.get_running_loop().set_default_executor(refusing)
        refusing.shutdown()
        try:
            session = await connection.create_session(AckMode.CLIENT_INDIVIDUAL)
            consumer = await session.create_consumer("queue://orders")
            producer = (await connection.create_session()).create_producer("queue://orders")
            connection.start()
            await producer.send("1")
            before = await consumer.receive(5)
            assert before is not None and before.text == "1"
            slow_failover(broker, 5)
            for thread in broker.current().lose(noticed_by=("reader",)):
                thread.join(5)
            with pytest.raises(StaleAcknowledgeError):
                await session.release(before)
            assert connection.statistics().failovers == 1
            again = await consumer.receive(5)
            assert again is not None and again.text == "1"
            await session.release(again)
            last = await consumer.receive(5)
            assert last is not None and last.text == "1"  # given back, delivered again
            await session.acknowledge(last)
            with pytest.raises(IllegalStateError, match="nothing to release"):
                await session.release(Message(body="built here"))
        finally:
            connection.sync.close()

    run(test)


def test_an_acknowledge_not_confirmed_does_not_wait_for_the_broker(broker: FakeBroker) -> None:
    async def test() -> None:
        async with await connected(broker) as connection:
            session = await connection.create_session(AckMode.CLIENT_INDIVIDUAL)
            consumer = await session.create_consumer("queue://orders")
            connection.start()
            with broker.lock:
                broker.queues["orders"].extend([Message("first"), Message("second")])
            first, second = await consumer.receive(5), await consumer.receive(5)
            assert first is not None and second is not None
            with pytest.raises(ConfigurationError, match="confirm=False acknowledges one message"):
                await session.acknowledge(confirm=False)
            with broker.paused():  # nothing is read or answered
                await asyncio.wait_for(session.acknowledge(first, confirm=False), 2)
                confirmed = asyncio.ensure_future(session.acknowledge(second))
                await asyncio.sleep(0.2)
                assert not confirmed.done()
            await asyncio.wait_for(confirmed, 5)
            with broker.lock:
                assert all(not s.unacked for s in broker.sessions.values())

    run(test)
