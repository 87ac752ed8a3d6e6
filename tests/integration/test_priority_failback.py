"""Priority failback on two bundled brokers, both protocols: a client whose preferred broker
(the first of its URL) went away works on the other one, probes the preferred one every
failback_interval and moves back once it answers, at a clean point only, reported as a
failover with ``failback`` set. The preferred broker sits behind a proxy that refuses
connections while it is "away", so the test decides when it answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hafailover
from hafailover import AckMode, FailoverNotice, HaFailoverError
from reference_broker import BrokerPair
from reference_broker.pair import free_ports

from .support import FAST, TcpProxy, drain, seqs, single_url, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[tuple[BrokerPair, BrokerPair]]:
    """Two independent brokers (a live without a backup each): the preferred and the other.
    Their ports are taken at once: ports picked for the first pair's unstarted backup are
    free, and the second pair could be given them (its live then hears the first live's
    replication)."""
    ports = free_ports(12)
    with (
        BrokerPair(
            tmp_path / "a", user="app", password="secret", start_backup=False, ports=ports[:6]
        ) as a,
        BrokerPair(
            tmp_path / "b", user="app", password="secret", start_backup=False, ports=ports[6:]
        ) as b,
    ):
        a.wait_active(30)
        b.wait_active(30)
        yield a, b


def port_of(pair: BrokerPair, protocol: str) -> int:
    return pair.live.stomp_port if protocol == "stomp" else pair.live.amqp_port


def priority_url(protocol: str, preferred_port: int, other_port: int, **overrides: str) -> str:
    options = {
        **FAST,
        "failover_method": "priority",
        "failback_interval": "200ms",
        "use_topology": "false",
        **overrides,
    }
    query = "&".join(f"{k}={v}" for k, v in options.items())
    brokers = ",".join(
        f"{protocol}://app:secret@127.0.0.1:{port}" for port in (preferred_port, other_port)
    )
    return f"failover:({brokers})?{query}"


class Notices:
    def __init__(self) -> None:
        self.received: list[HaFailoverError] = []
        self.lock = threading.Lock()

    def __call__(self, error: HaFailoverError) -> None:
        with self.lock:
            self.received.append(error)

    def failbacks(self) -> list[FailoverNotice]:
        with self.lock:
            return [e for e in self.received if isinstance(e, FailoverNotice) and e.report.failback]


def test_moves_back_to_the_preferred_broker_once_it_answers(
    brokers: tuple[BrokerPair, BrokerPair], protocol: str
) -> None:
    a, b = brokers
    preferred = TcpProxy(port_of(a, protocol))
    notices = Notices()
    try:
        url = priority_url(protocol, preferred.port, port_of(b, protocol))
        with hafailover.connect(url, exception_listener=notices) as connection:
            producer = connection.create_session().create_producer("queue://prio")
            for n in range(20):
                producer.send("on a", headers={"seq": n})
            preferred.refusing = True  # the preferred broker goes away
            preferred.cut()
            for n in range(20, 40):
                producer.send("on b", headers={"seq": n})  # waits for the failover (F1)
            assert str(port_of(b, protocol)) in (connection.broker or "")
            time.sleep(0.6)  # probes meanwhile are refused: no move
            assert notices.failbacks() == []
            preferred.refusing = False  # it answers again
            wait_until(lambda: notices.failbacks(), 20, "the failback")
            (notice,) = notices.failbacks()
            assert str(preferred.port) in (notice.report.to_broker or "")
            assert str(port_of(b, protocol)) in notice.report.from_broker
            assert "failback" in notice.report.summary()
            for n in range(40, 60):
                producer.send("on a again", headers={"seq": n})
            assert str(preferred.port) in (connection.broker or "")
    finally:
        preferred.close()
    on_a = single_url(protocol, "127.0.0.1", port_of(a, protocol), a)
    on_b = single_url(protocol, "127.0.0.1", port_of(b, protocol), b)
    got_a = sorted(seqs(drain(on_a, "queue://prio")))
    got_b = sorted(seqs(drain(on_b, "queue://prio")))
    # Each message once, on the broker it was sent to: nothing a receipt covered is sent
    # again, by the failover to the other broker or by the move back.
    assert (got_a, got_b) == (list(range(20)) + list(range(40, 60)), list(range(20, 40)))


def test_an_open_transaction_holds_the_move_until_it_commits(
    brokers: tuple[BrokerPair, BrokerPair], protocol: str
) -> None:
    a, b = brokers
    preferred = TcpProxy(port_of(a, protocol))
    notices = Notices()
    preferred.refusing = True  # away from the start: the client begins on the other broker
    try:
        # A heart-beat of 1 s, not FAST's 250 ms: this test needs no loss for 1.5 s, and on
        # a loaded machine the client once read no heart-beat within the 500 ms idle timeout
        # (the broker or the client's reader starved), failed over (not back) to the
        # preferred broker and rolled the transaction back before the commit could show
        # that it held the move.
        url = priority_url(protocol, preferred.port, port_of(b, protocol), heartbeat="1s")
        url += "&initial_connect_attempts=4"
        with hafailover.connect(url, exception_listener=notices) as connection:
            assert str(port_of(b, protocol)) in (connection.broker or "")
            session = connection.create_session(AckMode.SESSION_TRANSACTED)
            producer = session.create_producer("queue://prio-tx")
            producer.send("in the transaction", headers={"seq": 0})
            preferred.refusing = False
            time.sleep(1.5)  # several probes answer; the transaction has work in it
            assert notices.failbacks() == []
            assert str(port_of(b, protocol)) in (connection.broker or "")
            session.commit()  # nothing rolled back: the move waited for it
            wait_until(lambda: notices.failbacks(), 20, "the failback after the commit")
            assert notices.failbacks()[0].report.transactions_rolled_back == ()
    finally:
        preferred.close()
    on_b = single_url(protocol, "127.0.0.1", port_of(b, protocol), b)
    assert seqs(drain(on_b, "queue://prio-tx")) == [0]
