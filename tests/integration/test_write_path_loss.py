"""A loss first noticed by a write on the application's thread still fails over.

Seen with a client-acknowledge consumer against a broker pair whose backup took seconds to
take over: when the first notice of the SIGKILLed live came from a failed write
("[Errno 9] Bad file descriptor") rather than from the reader, the connection could stall
without a single reconnection attempt. Here the transport's own notices (reader and
heartbeat) are held back for longer than a failover takes, so the write is always first;
the live is SIGKILLed under real traffic and everything confirmed must arrive from the
backup.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest

import hafailover
from hafailover import FailureDetected, HaFailoverError
from hafailover.protocols.amqp import link as amqp_link
from hafailover.protocols.stomp import link as stomp_link
from reference_broker import BrokerPair

from .support import drain, seqs, url_for, wait_until

pytestmark = pytest.mark.timeout(90)

# Longer than a failover takes here: the transport's own notice always comes after it.
READER_DELAY = 4.0


@pytest.fixture
def slow_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transports report a lost connection only READER_DELAY seconds late."""
    for events in (stomp_link._StompEvents, amqp_link._AmqpEvents):
        original = events.on_lost

        def late(self: Any, reason: str, original: Any = original) -> None:
            threading.Timer(READER_DELAY, original, args=(self, reason)).start()

        monkeypatch.setattr(events, "on_lost", late)


def test_a_loss_first_noticed_by_a_write_fails_over_and_loses_nothing(
    pair: BrokerPair, protocol: str, slow_reader: None
) -> None:
    detected: list[tuple[float, FailureDetected]] = []
    url = url_for(pair, protocol, reconnect_attempts=-1)
    with hafailover.connect(url) as connection:
        connection.add_event_listener(
            lambda event: (
                detected.append((time.monotonic(), event))
                if isinstance(event, FailureDetected)
                else None
            )
        )
        producer = connection.create_session().create_producer("queue://write-path")
        seq = iter(range(1_000_000))
        confirmed = []
        for _ in range(20):
            n = next(seq)
            producer.send("before", headers={"seq": n})
            confirmed.append(n)
        killed_at = time.monotonic()
        pair.kill(pair.live)
        # The application keeps writing; one of these writes is the first to fail.
        in_flight = []
        deadline = time.monotonic() + READER_DELAY - 1.0
        while not detected and time.monotonic() < deadline:
            n = next(seq)
            with contextlib.suppress(HaFailoverError):  # a failed write raises nothing
                in_flight.append((n, producer.send_async("during", headers={"seq": n})))
            time.sleep(0.01)
        wait_until(lambda: bool(detected), READER_DELAY - 0.5, "the loss noticed by a write")
        noticed_at, event = detected[0]
        assert noticed_at - killed_at < READER_DELAY
        assert "heart-beat" not in event.reason and "connection closed" not in event.reason
        wait_until(lambda: connection.statistics().failovers == 1, 30, "the failover")
        for n, completion in in_flight:
            try:
                completion.result(30)
                confirmed.append(n)
            except HaFailoverError:
                pass  # in doubt: reported, and may or may not be stored
        n = next(seq)
        producer.send("after", headers={"seq": n})
        confirmed.append(n)
        time.sleep(READER_DELAY)  # the transport's late notice changes nothing now
        assert connection.statistics().failovers == 1
        assert len(connection.reports) == 1
    received = seqs(drain(url, "queue://write-path"))
    assert set(confirmed) <= set(received)
