"""F4: session reattach after a dropped connection to a live that is still running.

A TCP proxy between the client and the live drops every connection at once, as a network
failure would; the live keeps the session for connection_ttl and the client reattaches and
replays what the live never received. Duplicate detection is off in these tests, so an exact
result proves the replay itself is exact (nothing missing, nothing twice).
"""

from __future__ import annotations

import threading
import time

import pytest

import hafailover
from hafailover import (
    AckMode,
    AcknowledgeFailedError,
    ErrorCode,
    FailoverNotice,
    HaFailoverError,
    Message,
    TransactionRolledBackError,
)
from reference_broker import BrokerPair

from .support import drain, proxy, seqs, single_url, url_for, wait_until

pytestmark = pytest.mark.timeout(90)

OPTIONS = {
    "confirmation_window_size": "64KiB",
    "duplicate_detection": "false",
    "use_topology": "false",
    "connection_ttl": "30s",
}


def test_f4_reattach_replays_exactly_what_the_live_missed(pair: BrokerPair) -> None:
    """F4 (STOMP): sends pipelined through a dropped connection arrive exactly once, and
    the application sees nothing but the exception listener's notice."""
    with proxy(pair.live.stomp_port) as cut:
        url = single_url("stomp", "127.0.0.1", cut.port, pair, **OPTIONS)
        heard: list[HaFailoverError] = []
        with hafailover.connect(url, exception_listener=heard.append) as connection:
            producer = connection.create_session().create_producer("queue://f4", confirm=False)
            body = "x" * 400
            for seq in range(3000):
                producer.send(body, headers={"seq": seq})
                if seq in (1000, 2000):
                    cut.cut()
            confirmed = connection.create_session().create_producer("queue://f4-end")
            confirmed.send("end")  # a confirmed send after the replay: all before it arrived
            wait_until(lambda: len(heard) == 2, 10, "two notices")
            assert all(isinstance(h, FailoverNotice) and h.reattached for h in heard)
            reports = connection.reports
            assert [r.reattached for r in reports] == [True, True]
            assert all(r.code is ErrorCode.FAILOVER for r in reports)
            assert connection.statistics().reattached == 2
    got = seqs(drain(url_for(pair, "stomp"), "queue://f4", idle=2.0))
    assert sorted(got) == list(range(3000))


def test_f4_reattach_keeps_consumers_and_unacknowledged_messages(pair: BrokerPair) -> None:
    """F4 (STOMP): a client-acknowledge consumer keeps its subscription and its
    unacknowledged messages across a reattach: no stale acknowledge, nothing delivered twice."""
    with proxy(pair.live.stomp_port) as cut:
        url = single_url("stomp", "127.0.0.1", cut.port, pair, **OPTIONS)
        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer("queue://f4c")
            for seq in range(20):
                producer.send("m", headers={"seq": seq})
            session = connection.create_session(AckMode.CLIENT)
            consumer = session.create_consumer("queue://f4c", prefetch=50)
            connection.start()
            first = [consumer.receive(5) for _ in range(10)]
            assert all(m is not None for m in first)
            cut.cut()
            wait_until(lambda: connection.statistics().reattached == 1, 10, "the reattach")
            rest = [consumer.receive(5) for _ in range(10)]
            assert all(m is not None for m in rest)
            session.acknowledge()  # clean after a reattach: no StaleAcknowledgeError
            assert consumer.receive(1.0) is None
            received = seqs([m for m in first + rest if m is not None])
            assert sorted(received) == list(range(20))
    assert drain(url_for(pair, "stomp"), "queue://f4c") == []


def test_f4_f6_an_acknowledge_given_up_during_a_reattach_comes_again(pair: BrokerPair) -> None:
    """F4 + F6 (STOMP): the connection drops while a listener runs, so its automatic
    acknowledge cannot be sent (the exception listener hears that the message may come
    again). The reattached live sends it again: it is delivered again, and the consumer
    (one message of prefetch) does not stall."""
    with proxy(pair.live.stomp_port) as cut:
        url = single_url("stomp", "127.0.0.1", cut.port, pair, **OPTIONS)
        heard: list[HaFailoverError] = []
        got: list[int] = []
        with hafailover.connect(url, exception_listener=heard.append) as connection:
            producer = connection.create_session().create_producer("queue://f4auto")
            producer.send("m", headers={"seq": 0})
            session = connection.create_session(AckMode.AUTO)
            consumer = session.create_consumer("queue://f4auto", prefetch=1)

            def listener(message: Message) -> None:
                got.extend(seqs([message]))
                if len(got) == 1:
                    cut.refusing = True
                    cut.cut()
                    wait_until(lambda: connection.state == "failing over", 10, "the drop")

            consumer.set_message_listener(listener)
            connection.start()
            wait_until(
                lambda: any(isinstance(h, AcknowledgeFailedError) for h in heard),
                10,
                "the acknowledge to be given up",
            )
            cut.refusing = False
            wait_until(lambda: connection.statistics().reattached == 1, 10, "the reattach")
            for seq in range(1, 4):
                producer.send("m", headers={"seq": seq})
            wait_until(lambda: set(got) == {0, 1, 2, 3}, 10, "every message")
            assert got[:2] == [0, 0]  # delivered again, as the exception listener said
    assert drain(url_for(pair, "stomp"), "queue://f4auto") == []


def test_f4_a_subscription_whose_receipt_was_lost_is_completed_by_the_reattach(
    pair: BrokerPair,
) -> None:
    """F4 (STOMP): the live gets a SUBSCRIBE, its RECEIPT is lost with the connection. The
    reattach says the live had it: create_consumer() returns (no timeout) and the consumer
    gets its messages."""
    with proxy(pair.live.stomp_port) as cut:
        url = single_url("stomp", "127.0.0.1", cut.port, pair, **OPTIONS, call_timeout="30s")
        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer("queue://f4sub")
            for seq in range(5):
                producer.send("m", headers={"seq": seq})
            session = connection.create_session(AckMode.CLIENT)
            connection.start()
            created: list[object] = []
            cut.mute()
            creator = threading.Thread(
                target=lambda: created.append(session.create_consumer("queue://f4sub"))
            )
            creator.start()
            time.sleep(0.3)  # the SUBSCRIBE reaches the live; its RECEIPT is dropped
            cut.unmute()
            cut.cut()
            creator.join(15)
            assert created, "create_consumer() still waits for a receipt the reattach settled"
            assert connection.statistics().reattached == 1
            consumer = created[0]
            assert isinstance(consumer, hafailover.Consumer)
            received = [consumer.receive(5) for _ in range(5)]
            assert sorted(seqs([m for m in received if m is not None])) == list(range(5))
            session.acknowledge()
    assert drain(url_for(pair, "stomp"), "queue://f4sub") == []


def test_f4_f9_a_commit_called_while_reattaching_rolls_back_and_the_batch_comes_again(
    pair: BrokerPair,
) -> None:
    """F4 + F9 (STOMP): commit() called while failing over waits; the reattach keeps the
    transaction but the commit was never written, so it is rolled back, on the live too,
    and the batch is delivered again for the replay, on the same connection."""
    with proxy(pair.live.stomp_port) as cut:
        url = single_url("stomp", "127.0.0.1", cut.port, pair, **OPTIONS)
        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer("queue://f4txw")
            for seq in range(5):
                producer.send("m", headers={"seq": seq})
            session = connection.create_session(AckMode.SESSION_TRANSACTED)
            consumer = session.create_consumer("queue://f4txw")
            connection.start()
            assert all(consumer.receive(5) is not None for _ in range(5))
            cut.refusing = True
            cut.cut()
            wait_until(lambda: connection.state == "failing over", 10, "the drop")
            outcome: list[BaseException | None] = []

            def commit() -> None:
                try:
                    session.commit()
                    outcome.append(None)
                except HaFailoverError as exc:
                    outcome.append(exc)

            committer = threading.Thread(target=commit)
            committer.start()
            time.sleep(0.3)
            cut.refusing = False
            committer.join(20)
            assert len(outcome) == 1 and isinstance(outcome[0], TransactionRolledBackError)
            assert connection.statistics().reattached == 1
            again = []
            while len(again) < 5 and (message := consumer.receive(10)) is not None:
                again.append(message)
            assert sorted(seqs(again)) == list(range(5))
            session.commit()
    assert drain(url_for(pair, "stomp"), "queue://f4txw") == []


def test_f4_deliveries_the_live_resends_at_once_after_a_reattach_arrive(
    pair: BrokerPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F4 (STOMP): deliveries lost with the old socket are resent by the live right after
    CONNECTED, possibly before the client has made the new link its own (widened here: the
    client pauses before taking it). They reach the consumer all the same."""
    real_prepare = hafailover.Connection._prepare

    def slow_prepare(self: hafailover.Connection, *args: object, **kwargs: object) -> object:
        if not kwargs.get("initial"):
            time.sleep(0.3)  # the resends arrive meanwhile
        return real_prepare(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hafailover.Connection, "_prepare", slow_prepare)
    with proxy(pair.live.stomp_port) as cut:
        url = single_url("stomp", "127.0.0.1", cut.port, pair, **OPTIONS)
        with hafailover.connect(url) as connection:
            session = connection.create_session(AckMode.CLIENT)
            consumer = session.create_consumer("queue://f4early", prefetch=10)
            connection.start()
            cut.mute()  # what the live delivers from now on is lost with this socket
            with hafailover.connect(url_for(pair, "stomp")) as other:
                producer = other.create_session().create_producer("queue://f4early")
                for seq in range(3):
                    producer.send("m", headers={"seq": seq})
            time.sleep(0.3)
            cut.unmute()
            cut.cut()
            received = [consumer.receive(10) for _ in range(3)]
            assert sorted(seqs([m for m in received if m is not None])) == [0, 1, 2]
            assert connection.statistics().reattached == 1
            session.acknowledge()
    assert drain(url_for(pair, "stomp"), "queue://f4early") == []


def test_f4_transaction_survives_a_reattach(pair: BrokerPair) -> None:
    """F4 with F9: a transaction whose commands all reached the live stays valid after a
    reattach and commits (the table in tx/state.py: DIRTY, reattached, nothing lost)."""
    with proxy(pair.live.stomp_port) as cut:
        url = single_url("stomp", "127.0.0.1", cut.port, pair, **OPTIONS)
        with hafailover.connect(url) as connection:
            session = connection.create_session(AckMode.SESSION_TRANSACTED)
            producer = session.create_producer("queue://f4tx")
            for seq in range(5):
                producer.send("m", headers={"seq": seq})
            # A confirmed send on another session: the live has everything written before it.
            connection.create_session().create_producer("queue://f4-mark").send("mark")
            cut.cut()
            wait_until(lambda: connection.statistics().reattached == 1, 10, "the reattach")
            session.commit()
    assert sorted(seqs(drain(url_for(pair, "stomp"), "queue://f4tx"))) == list(range(5))


def test_f4_amqp_reconnects_and_says_so(pair: BrokerPair) -> None:
    """F4 on AMQP: no reattach extension, so a dropped connection means a reconnect, and
    the report names what the broker lacked."""
    with proxy(pair.live.amqp_port) as cut:
        url = single_url("amqp", "127.0.0.1", cut.port, pair, use_topology="false")
        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer("queue://f4a")
            producer.send("before")
            cut.cut()
            wait_until(lambda: connection.statistics().failovers == 1, 10, "the failover")
            producer.send("after")
            report = connection.reports[-1]
            assert not report.reattached
            assert "reattach" in report.degraded


def test_f4_window_bounds_unconfirmed_sends(pair: BrokerPair) -> None:
    """F4 flow control: with the live paused, unconfirmed sends stop once the confirmation
    window is full instead of growing the buffer."""
    url = url_for(pair, "stomp", **OPTIONS)
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://f4w", confirm=False)
        live = pair.live
        sent = [0]

        def send_forever() -> None:
            try:
                while sent[0] < 100_000:
                    producer.send("y" * 1000)
                    sent[0] += 1
            except HaFailoverError:
                return

        pair.pause(live)
        thread = threading.Thread(target=send_forever, daemon=True)
        thread.start()
        time.sleep(1.5)
        stalled_at = sent[0]
        time.sleep(0.5)
        assert sent[0] == stalled_at, "sends must wait for the window"
        assert stalled_at <= 64 * 1024 // 1000 + 1
        assert connection._window.buffered_bytes <= 64 * 1024 + 2000
        pair.resume(live)
        wait_until(lambda: sent[0] > stalled_at + 100, 20, "sending to resume")


def test_window_with_small_bodies_and_large_headers_never_stalls(pair: BrokerPair) -> None:
    """The live counts a frame's bytes as the client does (headers included): with small
    bodies and large headers the client's window must still get confirmations in time."""
    url = url_for(pair, "stomp", confirmation_window_size="64KiB", call_timeout="5s")
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://f4s", confirm=False)
        for seq in range(5000):
            producer.send(b"x", headers={"a-long-header-name": "v" * 60, "seq": seq})
        connection.create_session().create_producer("queue://f4s").send("end", headers={"seq": -1})
    assert len(drain(url_for(pair, "stomp"), "queue://f4s")) == 5001


def test_amqp_unconfirmed_sends_are_held_to_the_window(pair: BrokerPair) -> None:
    """AMQP has no reattach window, but pipelined confirmed sends are still held to
    confirmation_window_size bytes while the broker does not answer (bounded memory)."""
    url = url_for(pair, "amqp", confirmation_window_size="64KiB", heartbeat="0")
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://f4amqp")
        producer.send("warm-up")
        live = pair.live
        sent = [0]

        def send_forever() -> None:
            try:
                while sent[0] < 100_000:
                    producer.send_async("y" * 1000)
                    sent[0] += 1
            except HaFailoverError:
                return

        pair.pause(live)
        thread = threading.Thread(target=send_forever, daemon=True)
        thread.start()
        time.sleep(1.5)
        stalled_at = sent[0]
        time.sleep(0.5)
        assert sent[0] == stalled_at, "sends must wait for confirmations"
        assert stalled_at <= 64 * 1024 // 1000 + 1
        pair.resume(live)
        wait_until(lambda: sent[0] > stalled_at + 100, 20, "sending to resume")
