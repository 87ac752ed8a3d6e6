"""A slow takeover: the live SIGKILLed, the backup held back for about ten seconds.

Issue 17: against a master/slave pair whose slave took about 12 s to take over, a
client-acknowledge consumer beside a transacted producer sometimes stopped for good
after a loss first noticed by a write and a refused first attempt: no further attempt,
no listener call, confirmed messages never received. Here the bundled pair's backup is
paused (SIGSTOP) when the live is killed, so it neither takes over nor listens and every
attempt is refused for HOLD seconds; the transports' own loss notices are held back so a
write notices first. Then the backup resumes and takes over: everything confirmed must
reach the consumer, nothing may stall, and both connections' listeners hear FAILOVER.

One run per protocol by default; HAFAILOVER_SLOW_TAKEOVER_RUNS=20 repeats each.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

import hafailover
from hafailover import AckMode, DisconnectedError, FailoverNotice, HaFailoverError
from reference_broker import BrokerPair

from .support import delay_loss_notices, url_for, wait_until

RUNS = int(os.environ.get("HAFAILOVER_SLOW_TAKEOVER_RUNS", "1"))
HOLD = 10.0  # seconds the backup is held back: every attempt meanwhile is refused
NOTICE_DELAY = 3.0  # the transports' own loss notices come this late: a write is first
CATCH_UP = 45.0  # after the takeover, the consumer has this long to get everything

pytestmark = pytest.mark.timeout(150)


@pytest.fixture
def writes_notice_first(monkeypatch: pytest.MonkeyPatch) -> None:
    delay_loss_notices(monkeypatch, NOTICE_DELAY)


class Listener:
    def __init__(self) -> None:
        self.heard: list[HaFailoverError] = []

    def __call__(self, error: HaFailoverError) -> None:
        self.heard.append(error)


@pytest.mark.parametrize("run", range(RUNS))
def test_a_slow_takeover_loses_nothing_and_stalls_nothing(
    pair: BrokerPair, protocol: str, writes_notice_first: None, run: int
) -> None:
    url = url_for(pair, protocol, reconnect_attempts=-1)
    queue = f"queue://slow-takeover-{run}"
    confirmed: set[int] = set()
    received: set[int] = set()
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    heard = {"producer": Listener(), "consumer": Listener()}
    connections: dict[str, hafailover.Connection] = {}

    def produce() -> None:
        try:
            with hafailover.connect(url, exception_listener=heard["producer"]) as connection:
                connections["producer"] = connection
                session = connection.create_session(AckMode.SESSION_TRANSACTED)
                producer = session.create_producer(queue)
                n = 0
                while not stop.is_set():
                    batch = range(n, n + 10)
                    for attempt in session.transaction(retries=1000):
                        with attempt:
                            for seq in batch:
                                producer.send("x", headers={"seq": seq})
                    with lock:
                        confirmed.update(batch)
                    n += 10
                    time.sleep(0.005)
        except Exception as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    def consume() -> None:
        try:
            with hafailover.connect(url, exception_listener=heard["consumer"]) as connection:
                connections["consumer"] = connection
                consumer = connection.create_session(AckMode.CLIENT).create_consumer(queue)
                connection.start()
                while not stop.is_set() or not done():
                    try:
                        message = consumer.receive(0.2)
                    except HaFailoverError:
                        continue  # F6-F8 reports; the message comes again
                    if message is None:
                        continue
                    # F8: an acknowledge caught by the failover raises; its message is
                    # redelivered, and counted once whichever copy arrives.
                    with contextlib.suppress(HaFailoverError):
                        message.acknowledge()
                    with lock:
                        received.add(int(str(message.properties["seq"])))
        except Exception as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    def done() -> bool:
        with lock:
            return confirmed <= received

    threads = [threading.Thread(target=f, daemon=True) for f in (consume, produce)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(received) >= 200, 30, "traffic before the kill")
    backup = pair.backup
    pair.kill(pair.live)
    pair.pause(backup)
    time.sleep(HOLD)
    with lock:
        during = len(confirmed)
    pair.resume(backup)
    # The producer goes on through the takeover, and the consumer must follow it.
    wait_until(lambda: len(confirmed) >= during + 200, 40, "sends confirmed after the takeover")
    stop.set()
    threads[1].join(30)
    assert not threads[1].is_alive(), "the producer stalled"
    try:
        wait_until(done, CATCH_UP, "the consumer to receive everything confirmed")
    finally:
        stop.set()
        threads[0].join(10)
    assert not threads[0].is_alive(), "the consumer stalled"
    assert errors == []
    with lock:
        lost = confirmed - received
    assert not lost, f"{len(lost)} confirmed messages never received"
    for name, listener in heard.items():
        assert any(isinstance(e, FailoverNotice) for e in listener.heard), name
        assert not any(isinstance(e, DisconnectedError) for e in listener.heard), name
    # The backup was held back: the consumer's failover took refused attempts first.
    report = connections["consumer"].reports[0]
    assert report.attempts > 1 and report.duration >= HOLD / 2
