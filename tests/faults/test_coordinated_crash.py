"""Issue 18, scenario e: both nodes SIGKILLed together in the middle of traffic.

A rack losing power takes the live and the backup down at the same instant. Both are then
restarted, in either order. What must hold:

- every confirmed message is there exactly once (the total-queue check);
- the node with the newer journal becomes live: the one that was live at the crash (it may
  hold records the backup never acknowledged, and the witness names it); the other one,
  started first, waits as backup however long it takes, rather than serving older data;
- clients with reconnect_attempts=-1 ride through: their calls block while no node serves
  and go on once one does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reference_broker import BrokerPair
from tests.integration.support import AckingConsumer, url_for, wait_until

from .clients import ConfirmedProducer, base_url, check, stop_all

pytestmark = pytest.mark.timeout(120)

QUEUE = "queue://coordinated-crash"
DOWN_FOR = 1.0  # seconds with both nodes down before the first restart
# How long the node with the older journal is watched, alone, for serving: it would activate
# within one lease (the killed holder's lease has run out by then).
WATCH_LEASES = 2


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path / "pair", user="app", password="secret") as started:
        started.wait_synchronized(30)
        yield started


@pytest.fixture
def pair_without_failback(tmp_path: Path) -> Iterator[BrokerPair]:
    with BrokerPair(
        tmp_path / "pair", user="app", password="secret", allow_failback=False
    ) as started:
        started.wait_synchronized(30)
        yield started


def kill_both(pair: BrokerPair) -> None:
    """SIGKILL both nodes back to back (no reaping in between), then reap them."""
    pids = [node.pid for node in pair.nodes if node.running]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for node in pair.nodes:
        pair.kill(node)  # reaps


@pytest.mark.parametrize("order", ["backup-first", "live-first"])
def test_both_nodes_killed_together_lose_nothing(
    pair: BrokerPair, protocol: str, order: str
) -> None:
    # A kill is seen by a reset: a 250 ms heart-beat only adds false failovers under load.
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat="1s")
    producer = ConfirmedProducer(url, QUEUE)
    consumer = AckingConsumer(url, QUEUE)
    producer.start()
    consumer.start()
    try:
        wait_until(lambda: len(consumer.acknowledged) >= 50, 30, "the first traffic")
        live, backup = pair.live, pair.backup
        assert live.role == "live" and backup.role == "backup"
        kill_both(pair)
        crashed_at = time.monotonic()
        confirmed_at_crash = len(producer.confirmed)
        time.sleep(DOWN_FOR)
        if order == "backup-first":
            pair.restart(backup)
            # The backup holds older data than the live did: it must wait, not serve.
            time.sleep(WATCH_LEASES * pair.lease)
            assert backup.role == "backup", "the node with the older journal became live"
            assert len(producer.confirmed) == confirmed_at_crash, "confirmed with no live"
            pair.restart(live)
        else:
            pair.restart(live)
            wait_until(lambda: live.role == "live", 20, "the former live to serve")
            pair.restart(backup)
        assert pair.wait_active(20) is live, "the node with the newer journal is not live"
        pair.wait_synchronized(30)
        # Both clients rode through: they go on after the restart.
        confirmed, acknowledged = len(producer.confirmed), len(consumer.acknowledged)
        wait_until(
            lambda: (
                len(producer.confirmed) > confirmed + 20
                and len(consumer.acknowledged) > acknowledged + 20
            ),
            30,
            "progress after the restart",
        )
    finally:
        stop_all(producer, consumer)
    outcome = check(base_url(pair, protocol), QUEUE, [producer], [consumer])
    # From the crash to the first send confirmed after it: the outage the application saw.
    outage = min(at for at in producer.confirmed_at if at > crashed_at) - crashed_at
    print("\n" + outcome.line(f"both nodes killed ({order}, outage {outage:.1f}s)", protocol))
    outcome.assert_clean()
    # The producer blocked while no node served (it saw the outage), then went on.
    assert producer.longest_stall >= DOWN_FOR
    assert producer.failovers >= 1 and consumer.failovers >= 1


def test_after_a_failover_the_former_backup_holds_the_newer_journal(
    pair_without_failback: BrokerPair, protocol: str
) -> None:
    """The preferred live fails over to the backup, rejoins as its backup (no failback), and
    both are killed together: now the preferred backup holds the newer journal. Restarted
    first, the preferred live (started with --role live) must wait as backup."""
    pair = pair_without_failback
    first, second = pair.nodes
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat="1s")
    producer = ConfirmedProducer(url, QUEUE)
    producer.start()
    try:
        wait_until(lambda: len(producer.confirmed) >= 30, 30, "the first traffic")
        pair.kill(first)
        assert pair.wait_active(20) is second
        confirmed = len(producer.confirmed)
        wait_until(lambda: len(producer.confirmed) > confirmed + 30, 20, "sends on the backup")
        pair.restart(first)
        pair.wait_synchronized(30)
        assert second.role == "live", "failed back without allow_failback"
        confirmed = len(producer.confirmed)
        wait_until(lambda: len(producer.confirmed) > confirmed + 30, 20, "sends, replicated")
        kill_both(pair)
        time.sleep(DOWN_FOR)
        pair.restart(first)
        time.sleep(WATCH_LEASES * pair.lease)
        assert first.role == "backup", "the preferred live served the older journal"
        pair.restart(second)
        assert pair.wait_active(20) is second, "the node with the newer journal is not live"
        pair.wait_synchronized(30)
        confirmed = len(producer.confirmed)
        wait_until(lambda: len(producer.confirmed) > confirmed + 20, 30, "progress after restart")
    finally:
        stop_all(producer)
    outcome = check(base_url(pair, protocol), QUEUE, [producer])
    print("\n" + outcome.line("both nodes killed after a failover (older first)", protocol))
    outcome.assert_clean()
