"""Network faults between real namespaces, each on both protocols (issue 18, part 2).

Every scenario runs a confirmed producer (client namespace c0) and a CLIENT-acknowledge
consumer (c1) against the pair on the test network, breaks links with kernel rules, heals,
and then checks the whole queue (clients.check: lost 0, unexpected 0, duplicates 0) and what
the application saw: exception-listener events and how long a blocked call waited.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from reference_broker import BrokerPair

from .clients import (
    CALL_FAILOVER_TIMEOUT,
    HEARTBEAT,
    AckConsumer,
    ConfirmedProducer,
    check,
    stop_all,
    with_options,
)
from .conftest import HEARTBEAT_TIMEOUT
from .netns import NetnsThread, Network, cut_directory, restore_directory

pytestmark = pytest.mark.timeout(90)

HOLD = 4.0  # seconds a fault lasts
TRAFFIC = 50  # acknowledged messages before the fault


def url_for(pair: BrokerPair, protocol: str) -> str:
    base = pair.stomp_url if protocol == "stomp" else pair.amqp_url
    return with_options(base, call_failover_timeout=f"{int(CALL_FAILOVER_TIMEOUT * 1000)}ms")


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Run:
    """The two clients of one scenario, started and stopped together."""

    def __init__(self, pair: BrokerPair, network: Network, protocol: str, name: str) -> None:
        self.pair = pair
        self.network = network
        self.protocol = protocol
        self.name = name
        self.base_url = pair.stomp_url if protocol == "stomp" else pair.amqp_url
        self.url = url_for(pair, protocol)
        self.queue = f"queue://{name}"
        self.producer = ConfirmedProducer(
            self.url, self.queue, name="producer", netns=network["c0"].netns, pace=0.005
        )
        self.consumer = AckConsumer(self.url, self.queue, netns=network["c1"].netns)
        self.started = time.monotonic()

    def __enter__(self) -> Run:
        self.producer.start()
        self.consumer.start()
        wait_until(lambda: len(self.consumer.acknowledged) >= TRAFFIC, 30, "traffic")
        return self

    def __exit__(self, *exc: object) -> None:
        self.producer.stop.set()
        self.consumer.stop.set()
        self.producer.join(30)
        self.consumer.join(30)

    def progress_after(self, instant: float, timeout: float = 20.0) -> None:
        """Both clients confirm and acknowledge something after ``instant``."""
        acknowledged = len(self.consumer.acknowledged)
        wait_until(
            lambda: (
                self.producer.confirmed_between(instant, float("inf"))
                and len(self.consumer.acknowledged) > acknowledged + 10
            ),
            timeout,
            "progress after healing",
        )

    def finish(self) -> None:
        stop_all(self.producer, self.consumer)
        verdict = check(
            self.base_url,
            self.queue,
            [self.producer],
            [self.consumer],
            netns=self.network["c0"].netns,
        )
        print(
            f"\n{verdict.line(self.name, self.protocol)} "
            f"in {time.monotonic() - self.started:.1f}s; failovers "
            f"producer={self.producer.failovers} consumer={self.consumer.failovers} "
            f"listener producer={self.producer.codes()} consumer={self.consumer.codes()}"
        )
        if verdict.duplicates:
            for at, seq, broker, redelivered in self.consumer.log:
                if seq in verdict.duplicates:
                    print(
                        f"acknowledged seq {seq} at t+{at - self.started:.3f}s on {broker} "
                        f"redelivered={redelivered}"
                    )
            for event in self.consumer.lifecycle:
                print(f"consumer t+{event.at - self.started:.3f}s {event.text[:300]}")
        verdict.assert_clean()


def test_client_to_live_black_hole(fault_pair: BrokerPair, network: Network, protocol: str) -> None:
    """a. The clients' packets to and from the live vanish while live and backup still see
    each other: the clients notice within about two heart-beats, find the backup not active
    (it refuses them), keep trying, and after healing go on with the live; nothing lost."""
    with Run(fault_pair, network, protocol, "black-hole") as run:
        live = fault_pair.live
        fault_at = time.monotonic()
        for client in ("c0", "c1"):
            network.partition(client, "live")
        time.sleep(HOLD)
        # The pair did not move: the backup still follows the live.
        assert fault_pair.live is live and fault_pair.backup.role == "backup"
        heal_at = time.monotonic()
        network.heal()
        run.progress_after(heal_at)
        run.finish()
    producer, consumer = run.producer, run.consumer
    for client in (producer, consumer):
        noticed = client.detected(fault_at)
        assert noticed, f"{client.name} never noticed the loss: {client.lifecycle}"
        assert noticed[0] <= 2 * HEARTBEAT + 1.0, f"{client.name} noticed after {noticed[0]:.2f}s"
        # The application heard of it once, when the failover ended: FAILOVER.
        assert client.codes(fault_at)[:1] == ["FAILOVER"], client.events
    # Nothing was confirmed while the live was unreachable: the backup never served.
    assert producer.confirmed_between(fault_at + 0.5, heal_at) == []
    # The send waiting for its confirmation when the live went silent, and every send made
    # while failing over, was released after call_failover_timeout.
    assert any(e.code == "CONNECTION_TIMEDOUT" for e in producer.raised), producer.raised
    assert producer.longest_stall <= CALL_FAILOVER_TIMEOUT + 1.0, producer.longest_stall


@pytest.mark.parametrize("direction", ["to-live", "from-live"])
def test_one_way_loss(
    fault_pair: BrokerPair, network: Network, protocol: str, direction: str
) -> None:
    """d. Only one direction is lost: the clients' packets to the live (the live's replies
    still flow: the live drops the silent clients and tells them), or the live's packets to
    the clients (their heart-beats stop arriving). Either way the clients notice, keep
    trying, and after healing go on; nothing lost, nothing doubled."""
    with Run(fault_pair, network, protocol, f"one-way-{direction}") as run:
        fault_at = time.monotonic()
        for client in ("c0", "c1"):
            if direction == "to-live":
                network.block(client, "live")
            else:
                network.block("live", client)
        time.sleep(HOLD)
        assert fault_pair.backup.role == "backup"
        heal_at = time.monotonic()
        network.heal()
        run.progress_after(heal_at)
        run.finish()
    for client in (run.producer, run.consumer):
        noticed = client.detected(fault_at)
        assert noticed, f"{client.name} never noticed the loss: {client.lifecycle}"
        # The live gives a silent client up after its own heart-beat timeout and says so.
        assert noticed[0] <= HOLD, f"{client.name} noticed after {noticed[0]:.2f}s"
    assert run.producer.confirmed_between(fault_at + 0.5, heal_at) == []


class Prober:
    """Tries to open a TCP connection to ``address:port`` from ``netns`` every 50 ms and
    records when one was accepted: a node that accepts is a node that serves."""

    def __init__(self, netns: str, address: str, port: int) -> None:
        self.accepted: list[float] = []
        self.stop = threading.Event()
        self.thread = NetnsThread(netns, self._run, name=f"probe-{address}")
        self.address, self.port = address, port

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection((self.address, self.port), timeout=0.2):
                    self.accepted.append(time.monotonic())
            except OSError:
                pass
            time.sleep(0.05)

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def test_live_cut_off_from_everyone(
    fault_pair: BrokerPair, network: Network, protocol: str
) -> None:
    """c. The live loses the backup and every client at once, but not the pair directory
    (the witness is on the shared file system): it keeps its lease, so the backup, which
    lost the live, must not take over; the live declares the backup lost (its eligibility
    revoked) and the clients wait. After healing the clients go on with the live, the backup
    resynchronizes, and nothing is lost or doubled."""
    live, backup = fault_pair.live, fault_pair.backup
    with Run(fault_pair, network, protocol, "live-cut-off") as run:
        with Prober(network["c1"].netns, backup.host, backup.stomp_port) as probe:
            fault_at = time.monotonic()
            network.isolate("live")
            time.sleep(HOLD)
            heal_at = time.monotonic()
            assert backup.role == "backup" and live.role == "live"
            network.heal()
        assert probe.accepted == [], "the backup served while the live held the lease"
        fault_pair.wait_synchronized(30)
        run.progress_after(heal_at)
        run.finish()
    assert run.producer.confirmed_between(fault_at + 0.5, heal_at) == []
    assert fault_pair.live is live


def test_live_backup_partition(fault_pair: BrokerPair, network: Network, protocol: str) -> None:
    """b. Live and backup lose each other; the clients still see both. The live waits for
    the backup's acknowledgement of each persistent send until the replication heart-beat
    timeout, then declares the backup lost (revokes its eligibility in the pair directory)
    and goes on alone, as Artemis does; the backup, no longer eligible and facing a live
    lease, never serves. After healing the backup resynchronizes and the queue holds exactly
    what was confirmed."""
    live, backup = fault_pair.live, fault_pair.backup
    with Run(fault_pair, network, protocol, "replication-partition") as run:
        with Prober(network["c1"].netns, backup.host, backup.stomp_port) as probe:
            fault_at = time.monotonic()
            network.partition("live", "backup")
            wait_until(lambda: live.status().get("degraded"), 10, "the live to go on alone")
            alone_at = time.monotonic()
            time.sleep(HOLD)
            heal_at = time.monotonic()
            assert backup.role == "backup" and live.role == "live"
            network.heal()
        assert probe.accepted == [], "two nodes accepted clients at once"
        fault_pair.wait_synchronized(30)
        run.progress_after(heal_at)
        run.finish()
    producer = run.producer
    # Confirmations paused until the live declared the backup lost, then went on.
    assert producer.confirmed_between(alone_at, heal_at), "the live stopped confirming"
    declared = alone_at - fault_at
    print(f"the live went on alone {declared:.2f}s after the partition")
    assert declared <= 2 * HEARTBEAT_TIMEOUT + 1.0
    assert fault_pair.live is live


def test_live_cut_off_from_everyone_and_the_witness(
    fault_pair: BrokerPair, network: Network, protocol: str
) -> None:
    """c. The live loses the backup, every client and the pair directory (its writes there
    fail, as a shared disk that went away fails them): it cannot renew its lease and fences
    itself; the backup takes over once the lease ran out. The old live's last confirmation
    comes before the backup's first; the clients fail over; after healing the old live
    rejoins as backup and resynchronizes; nothing is lost or doubled."""
    live, backup = fault_pair.live, fault_pair.backup
    with Run(fault_pair, network, protocol, "live-cut-off-witness") as run:
        fault_at = time.monotonic()
        cut_directory(live.pid, str(fault_pair.pair_dir))
        network.isolate("live")
        try:
            wait_until(lambda: backup.role == "live", 15, "the backup to take over")
            took_over_at = time.monotonic()
            run.progress_after(took_over_at)
        finally:
            network.heal()
            restore_directory(live.pid, str(fault_pair.pair_dir))
        heal_at = time.monotonic()
        wait_until(lambda: live.role in ("backup", "live"), 30, "the old live to rejoin")
        fault_pair.wait_synchronized(30)
        run.progress_after(heal_at)
        run.finish()
    producer = run.producer
    from_old = [at for at in producer.confirmations_from(live.host) if at < heal_at]
    from_new = producer.confirmations_from(backup.host)
    assert from_new, "the backup confirmed nothing"
    assert max(from_old) < min(from_new), "the old live confirmed after the backup began"
    print(
        f"takeover {took_over_at - fault_at:.2f}s after the cut; last confirmation by the old "
        f"live {max(from_old) - fault_at:.2f}s, first by the backup {min(from_new) - fault_at:.2f}s"
    )
    for client in (producer, run.consumer):
        assert "FAILOVER" in client.codes(fault_at), client.events


def test_live_loses_backup_and_witness_but_not_clients(
    fault_pair: BrokerPair, network: Network, protocol: str
) -> None:
    """b with the witness lost too: the live loses the backup and the pair directory, the
    clients still reach it. It cannot record the backup's lost eligibility, so it must not go
    on alone: it confirms nothing more (sends wait for the backup's acknowledgement) until its
    lease, which it can no longer renew, runs out and it fences itself; the backup, still
    eligible, takes over with everything that was confirmed. Nothing lost or doubled."""
    live, backup = fault_pair.live, fault_pair.backup
    with Run(fault_pair, network, protocol, "live-loses-witness") as run:
        cut_directory(live.pid, str(fault_pair.pair_dir))
        network.block("backup", "live")  # the backup's acknowledgements no longer arrive
        fault_at = time.monotonic()
        network.block("live", "backup")
        try:
            wait_until(lambda: backup.role == "live", 15, "the backup to take over")
            run.progress_after(time.monotonic())
        finally:
            heal_at = time.monotonic()
            network.heal()
            restore_directory(live.pid, str(fault_pair.pair_dir))
        run.finish()
    # Until the heal: after it the old live rejoins and, with failback, may serve again.
    late = [
        at - fault_at
        for at in run.producer.confirmations_from(live.host)
        if fault_at < at < heal_at
    ]
    # A confirmation already on its way when the link broke may arrive a moment later.
    assert all(t < 0.1 for t in late), f"the old live confirmed alone: {late}"
