"""A cancelled aio call leaves the driver whole: cancelling the caller of a commit or of a
session's close cancels its wait, never the call, which ends as a threaded one would (the
transaction state does not stay half-committed, a closed session's transaction is rolled
back), on a STOMP-shaped and an AMQP-shaped link."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from hafailover import AckMode, IllegalStateError, aio
from hafailover.core.waits import CallBudget, Wait
from hafailover.driver.waits import Steps, blocking
from tests.aio.test_aio_driver import eventually, run
from tests.driver.fake import FakeBroker, link_factory

pytestmark = pytest.mark.timeout(30)

FAST = "heartbeat=250ms&retry_interval=5ms&max_retry_interval=20ms&call_timeout=5s"


@pytest.fixture(params=["stomp", "amqp"])
def shaped(request: pytest.FixtureRequest) -> Iterator[tuple[FakeBroker, str]]:
    protocol = request.param
    broker = FakeBroker(windowed=protocol == "stomp")
    broker.start()
    yield broker, f"failover:({protocol}://app:pw@live:5000,{protocol}://app:pw@backup:5000)?{FAST}"
    broker.stop()


def test_a_cancelled_commit_goes_on_and_the_session_commits_again(
    shaped: tuple[FakeBroker, str],
) -> None:
    broker, url = shaped

    async def test() -> None:
        async with await aio.connect(url, link_factory=link_factory(broker)) as connection:
            session = await connection.create_session(AckMode.SESSION_TRANSACTED)
            producer = session.create_producer("queue://orders")
            await producer.send("first")
            with broker.paused():
                committing = asyncio.ensure_future(session.commit())
                await eventually(
                    lambda: any(f.command == "COMMIT" for f in broker.current().wire),
                    "the commit written",
                )
                committing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await committing
            await eventually(lambda: len(broker.stored("orders")) == 1, "the first commit")
            await producer.send("second")
            await session.commit()
            assert [m.text for m in broker.stored("orders")] == ["first", "second"]

    run(test)


def test_a_cancelled_session_close_goes_on_and_rolls_its_transaction_back(
    shaped: tuple[FakeBroker, str],
) -> None:
    broker, url = shaped

    async def test() -> None:
        async with await aio.connect(url, link_factory=link_factory(broker)) as connection:
            session = await connection.create_session(AckMode.SESSION_TRANSACTED)
            await session.create_producer("queue://orders").send("dropped")
            with broker.paused():
                closing = asyncio.ensure_future(session.close())
                await eventually(
                    lambda: any(f.command == "ABORT" for f in broker.current().wire),
                    "the rollback of the close written",
                )
                closing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await closing
            await eventually(lambda: closed(session), "the session closed")
            assert not broker.current().session.transactions  # rolled back, not left open
            other = await connection.create_session(AckMode.SESSION_TRANSACTED)
            await other.create_producer("queue://orders").send("kept")
            await other.commit()
            assert [m.text for m in broker.stored("orders")] == ["kept"]

    run(test)


def closed(session: aio.AsyncSession) -> bool:
    try:
        session.create_producer("queue://orders")
    except IllegalStateError:
        return True
    return False


def test_what_a_cancelled_blocking_step_made_is_still_recorded(
    shaped: tuple[FakeBroker, str],
) -> None:
    """A call cancelled while its blocking step (an AMQP attach or declare) runs on the
    default executor: the step cannot be stopped, and what it made (a transaction begun, a
    temporary queue) reaches the steps, which record it, before they stop at their next
    wait."""
    broker, url = shaped
    recorded: list[str] = []
    stopped: list[str] = []
    release = threading.Event()

    def declare() -> str:
        release.wait(5)
        return "made on the broker"

    def steps() -> Steps[str]:
        try:
            made = yield from blocking(declare)
            recorded.append(made)
            yield Wait(lambda: False, CallBudget(5))  # the next wait: they stop here
            return made
        finally:
            stopped.append("cleaned up")

    async def test() -> None:
        connection = await aio.connect(url, link_factory=link_factory(broker))
        try:
            call = asyncio.ensure_future(connection._steps(steps()))
            await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert recorded == []  # the blocking call still runs
            release.set()
            await eventually(lambda: stopped == ["cleaned up"], "the steps to stop")
            assert recorded == ["made on the broker"]
        finally:
            connection.sync.close()

    run(test)
