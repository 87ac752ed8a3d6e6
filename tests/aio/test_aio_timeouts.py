"""call_timeout and call_failover_timeout mean the same in hafailover.aio as in the threaded
driver (one waiter serves both): a send already written, and a commit already written,
wait no longer than call_failover_timeout while the broker is gone, on a STOMP-shaped link
(cumulative receipts through the confirmation window) and an AMQP-shaped one (an answer per
call)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from hafailover import AckMode, CallTimeoutError, TransactionOutcomeUnknownError, aio
from tests.aio.test_aio_driver import eventually, run
from tests.driver.fake import FakeBroker, link_factory

pytestmark = pytest.mark.timeout(30)

FAST = "heartbeat=250ms&retry_interval=5ms&max_retry_interval=20ms&reconnect_attempts=-1"
# How long a call waits for the connection to come back, and the longest it may take to
# give up (the waiter looks at least every half second; a loaded machine adds some).
FAILOVER_TIMEOUT = 0.3
GIVES_UP_WITHIN = 2.5


@pytest.fixture(params=["stomp", "amqp"])
def shaped(request: pytest.FixtureRequest) -> Iterator[tuple[FakeBroker, str]]:
    protocol = request.param
    broker = FakeBroker(windowed=protocol == "stomp")
    broker.start()
    url = (
        f"failover:({protocol}://app:pw@live:5000,{protocol}://app:pw@backup:5000)?{FAST}"
        f"&call_timeout=5s&call_failover_timeout={int(FAILOVER_TIMEOUT * 1000)}ms"
    )
    yield broker, url
    broker.stop()


def broker_gone(broker: FakeBroker) -> None:
    """The connection dies and every attempt to reconnect is refused for a minute."""
    broker.refuse_until = time.monotonic() + 60
    for thread in broker.current().lose(noticed_by=("reader",)):
        thread.join(5)


def test_a_written_send_waits_no_longer_than_call_failover_timeout(
    shaped: tuple[FakeBroker, str],
) -> None:
    broker, url = shaped

    async def test() -> None:
        async with await aio.connect(url, link_factory=link_factory(broker)) as connection:
            producer = (await connection.create_session()).create_producer("queue://orders")
            with broker.paused():
                sending = asyncio.ensure_future(producer.send("order"))
                await eventually(lambda: bool(broker.current().wire), "the send written")
                broker_gone(broker)
            started = time.monotonic()
            with pytest.raises(CallTimeoutError, match="call_failover_timeout"):
                await sending
            assert time.monotonic() - started < GIVES_UP_WITHIN
            assert connection.state != "connected"
            # The broker comes back: the send kept in the window is resent, stored once.
            broker.refuse_until = 0.0
            await eventually(lambda: len(broker.stored("orders")) == 1, "the resend")

    run(test)


def test_a_written_commit_waits_no_longer_than_call_failover_timeout(
    shaped: tuple[FakeBroker, str],
) -> None:
    broker, url = shaped

    async def test() -> None:
        async with await aio.connect(url, link_factory=link_factory(broker)) as connection:
            session = await connection.create_session(AckMode.SESSION_TRANSACTED)
            await session.create_producer("queue://orders").send("order")
            with broker.paused():
                committing = asyncio.ensure_future(session.commit())
                await eventually(
                    lambda: any(f.command == "COMMIT" for f in broker.current().wire),
                    "the commit written",
                )
                broker_gone(broker)
            started = time.monotonic()
            # Written, then cut by a timeout: whether the broker committed is unknown (F9).
            with pytest.raises(TransactionOutcomeUnknownError, match="timed out"):
                await committing
            assert time.monotonic() - started < GIVES_UP_WITHIN
            assert connection.state != "connected"
            broker.refuse_until = 0.0
            await eventually(lambda: connection.statistics().failovers == 1, "the failover")

    run(test)
