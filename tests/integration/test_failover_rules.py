"""DESIGN.md section 4, rule by rule, over STOMP and AMQP, against the bundled pair.

Each test names its rule. Failures are real: the live node is SIGKILLed (or SIGSTOPped) in
the middle of real traffic; nothing is mocked.
"""

from __future__ import annotations

import threading
import time

import pytest

import hafailover
from hafailover import (
    AckMode,
    AcknowledgeFailedError,
    BrowserInvalidatedError,
    ConnectionClosedError,
    DisconnectedError,
    ErrorCode,
    FailoverNotice,
    HaFailoverError,
    LinkReliability,
    Message,
    StaleAcknowledgeError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from reference_broker import BrokerPair

from .apis import Api
from .support import drain, proxy, seqs, single_url, url_for, wait_until

pytestmark = pytest.mark.timeout(90)


def _fill(url: str, queue: str, count: int) -> None:
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer(queue)
        for completion in [producer.send_async(f"m{i}", headers={"seq": i}) for i in range(count)]:
            completion.result()


def test_f1_calls_block_during_failover_then_complete(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F1: send, receive and session/consumer creation wait while failing over, then work."""
    url = url_for(pair, protocol)
    with api.connect(url) as connection:
        session = connection.create_session()
        producer = session.create_producer("queue://f1")
        producer.send("before", headers={"seq": 0})
        sent: list[int] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def produce() -> None:
            seq = 1
            while not stop.is_set():
                try:
                    producer.send(f"m{seq}", headers={"seq": seq})
                    sent.append(seq)
                except BaseException as exc:  # noqa: BLE001 - any error fails the test below
                    errors.append(exc)
                    return
                seq += 1

        thread = threading.Thread(target=produce)
        thread.start()
        wait_until(lambda: len(sent) > 50, 10, "traffic")
        pair.kill(pair.live)
        # Created during the failover: waits, then works on the backup.
        late_session = connection.create_session()
        consumer = late_session.create_consumer("queue://f1")
        wait_until(lambda: connection.statistics().failovers == 1, 20, "the failover")
        count_after = len(sent)
        wait_until(lambda: len(sent) > count_after + 50, 10, "traffic after failover")
        stop.set()
        thread.join(10)
        assert errors == []
        connection.start()
        received = set()
        while (message := consumer.receive(1.0)) is not None:
            received.add(int(str(message.properties["seq"])))
        assert set(sent) | {0} <= received


def test_f2_exhausted_reconnect_raises_disconnect(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F2: when reconnection gives up, blocked and later calls raise code DISCONNECT."""
    url = url_for(pair, protocol, reconnect_attempts=3, retry_interval="50ms")
    notices: list[HaFailoverError] = []
    with api.connect(url, exception_listener=notices.append) as connection:
        producer = connection.create_session().create_producer("queue://f2")
        producer.send("one")
        backup = pair.backup
        pair.kill(backup)
        pair.kill(pair.nodes[0] if pair.nodes[0].running else pair.nodes[1])

        def send_until_it_fails() -> None:
            for _ in range(1000):
                producer.send("more")
                time.sleep(0.01)

        with pytest.raises(DisconnectedError) as raised:
            send_until_it_fails()
        assert raised.value.code is ErrorCode.DISCONNECT
        with pytest.raises(DisconnectedError):
            connection.create_session()
        wait_until(lambda: len(notices) == 1, 5, "the DISCONNECT notice")
        assert notices[0].code is ErrorCode.DISCONNECT
        assert connection.reports[-1].code is ErrorCode.DISCONNECT


def test_f2_close_releases_blocked_calls_at_once(pair: BrokerPair, protocol: str, api: Api) -> None:
    """F2: close() during failover releases every waiter at once."""
    url = url_for(pair, protocol, retry_interval="200ms")
    connection = api.connect(url)
    producer = connection.create_session().create_producer("queue://f2c")
    producer.send("one")
    for node in pair.nodes:
        pair.kill(node)
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            producer.send("blocked")
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), "the send must wait while the connection fails over"
    started = time.monotonic()
    connection.close()
    thread.join(5)
    assert time.monotonic() - started < 5
    assert len(outcome) == 1
    assert isinstance(outcome[0], ConnectionClosedError)


def test_f3_in_doubt_send_is_unblocked_without_duplicate_detection(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F3: a send waiting for the broker when it died is released with UNBLOCKED."""
    url = url_for(pair, protocol, duplicate_detection="false")
    with api.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://f3")
        producer.send("warm-up")
        live = pair.live
        pair.pause(live)  # the send reaches a broker that never answers
        completion = producer.send_async("in doubt")
        time.sleep(0.3)
        assert not completion.done()
        pair.kill(live)
        with pytest.raises(UnblockedError) as raised:
            completion.result(20)
        assert raised.value.code is ErrorCode.UNBLOCKED
        report = connection.reports[-1]
        assert report.code is ErrorCode.FAILOVER
        assert completion.message is not None
        assert completion.message.message_id in report.in_doubt
        producer.send("after")  # the connection works on


def test_f3_commit_caught_by_failover_raises(pair: BrokerPair, protocol: str, api: Api) -> None:
    """F3: a commit written and waiting for its answer when the live died raises
    outcome-unknown (the broker may have done it), never rolled-back, never hangs."""
    url = url_for(pair, protocol)
    with api.connect(url) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer("queue://f3tx")
        producer.send("a", headers={"seq": 1})
        # A confirmed send on the same connection: the broker answered everything before it
        # (on AMQP, the transfer commit() waits for), so the commit is written at once.
        connection.create_session().create_producer("queue://f3tx-sync").send("sync")
        live = pair.live
        pair.pause(live)
        outcome: list[BaseException | None] = []

        def commit() -> None:
            try:
                session.commit()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001
                outcome.append(exc)

        thread = threading.Thread(target=commit)
        thread.start()
        time.sleep(0.3)
        pair.kill(live)
        thread.join(30)
        assert len(outcome) == 1
        assert isinstance(outcome[0], TransactionOutcomeUnknownError), outcome
        # The session works on: a retried transaction commits.
        producer.send("b", headers={"seq": 2})
        session.commit()


@pytest.mark.parametrize("role", ["consumer", "producer"])
def test_f2_f3_a_commit_whose_answer_is_lost_for_good_says_what_may_have_happened(
    pair: BrokerPair, protocol: str, role: str, api: Api
) -> None:
    """F2 + F3: the answer to a commit is lost and the connection cannot fail over
    (reconnect_attempts=0): commit() raises DisconnectedError saying whether the commit was
    written (it may have happened: the broker did it here) or not (rolled back)."""
    queue = f"queue://f3lost-{role}"
    port = pair.live.stomp_port if protocol == "stomp" else pair.live.amqp_port
    if role == "consumer":
        _fill(url_for(pair, protocol), queue, 5)
    with proxy(port) as cut_off:
        url = single_url(protocol, "127.0.0.1", cut_off.port, pair, reconnect_attempts=0)
        with api.connect(url) as connection:
            session = connection.create_session(AckMode.SESSION_TRANSACTED)
            if role == "consumer":
                consumer = session.create_consumer(queue)
                connection.start()
                assert all(consumer.receive(5) is not None for _ in range(5))
            else:
                session.create_producer(queue).send("m", headers={"seq": 0})
                # A confirmed send on the same connection: the broker answered everything
                # before it, so nothing but the commit's own answer is left to lose.
                connection.create_session().create_producer(f"{queue}-sync").send("sync")
            cut_off.mute()
            # AMQP settles a transaction's acknowledges before the discharge is written;
            # muted, they never are: that commit was never written. STOMP writes both.
            written = not (protocol == "amqp" and role == "consumer")
            with pytest.raises(DisconnectedError) as raised:
                session.commit()
            said = str(raised.value)
            assert ("may or may not" in said) if written else ("rolled back" in said), said
    left = seqs(drain(url_for(pair, protocol), queue))
    if role == "consumer":
        assert sorted(left) == ([] if written else [0, 1, 2, 3, 4])
    else:
        assert left == [0]  # the broker committed what the client could not confirm


def test_f3_a_commit_that_times_out_before_it_is_written_rolls_back_on_the_broker(
    pair: BrokerPair,
    api: Api,
) -> None:
    """AMQP settles a transaction's acknowledges before writing the discharge. A broker that
    is slow (paused shorter than the heartbeat) past call_timeout: commit() says rolled back
    and rolls the broker's transaction back too, so the batch comes again on this very
    connection, with no failover."""
    url = url_for(pair, "amqp", heartbeat="5s", call_timeout="500ms")
    _fill(url, "queue://f3slow", 5)
    with api.connect(url) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        consumer = session.create_consumer("queue://f3slow")
        connection.start()
        assert all(consumer.receive(5) is not None for _ in range(5))
        pair.pause(pair.live)
        try:
            with pytest.raises(TransactionRolledBackError, match="timed out"):
                session.commit()
        finally:
            pair.resume(pair.live)
        again = []
        while len(again) < 5 and (message := consumer.receive(10)) is not None:
            again.append(message)
        assert sorted(seqs(again)) == [0, 1, 2, 3, 4]
        session.commit()
        assert connection.statistics().failovers == 0
    assert drain(url, "queue://f3slow") == []


def test_f5_consumers_and_temporary_queues_are_recreated(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F5: after a reconnect to the backup, consumers receive again and a temporary queue
    keeps its name."""
    url = url_for(pair, protocol)
    with api.connect(url) as connection:
        session = connection.create_session(AckMode.CLIENT_INDIVIDUAL)
        consumer = session.create_consumer("queue://f5")
        temporary = session.create_temporary_queue()
        temp_consumer = session.create_consumer(temporary)
        producer = session.create_producer()
        connection.start()
        producer.send("before", destination="queue://f5")
        before = consumer.receive(5)
        assert before is not None
        before.acknowledge()  # confirmed by the broker: it will not come again
        pair.kill(pair.live)
        producer.send("after", destination="queue://f5")
        producer.send("to temporary", destination=temporary)
        after = consumer.receive(10)
        assert after is not None
        assert after.text == "after"
        reply = temp_consumer.receive(10)
        assert reply is not None
        assert reply.text == "to temporary"
        report = connection.reports[-1]
        assert report.code is ErrorCode.FAILOVER
        assert not report.reattached


def test_f5_a_recreation_the_broker_is_slow_to_answer_is_retried_not_given_up(
    pair: BrokerPair, monkeypatch: pytest.MonkeyPatch, api: Api
) -> None:
    """F5: the backup does not answer a recreated consumer's attach within call_timeout
    (simulated: the first such wait on the reconnect thread times out). That attempt fails
    and the next one recreates the consumer; it is never closed behind the app's back."""
    from hafailover.protocols.amqp import transport as amqp_adapter

    real_subscribe = amqp_adapter.AmqpTransport.subscribe
    slowed: list[str] = []

    def slow_once(self: object, *args: object, **kwargs: object) -> object:
        if threading.current_thread().name == "hafailover-reconnect" and not slowed:
            slowed.append("attach")
            kwargs["timeout"] = 1e-6  # the adapter's own wait times out
        return real_subscribe(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(amqp_adapter.AmqpTransport, "subscribe", slow_once)
    url = url_for(pair, "amqp")
    with api.connect(url) as connection:
        consumer = connection.create_session().create_consumer("queue://f5slow")
        connection.start()
        pair.kill(pair.live)
        wait_until(lambda: connection.statistics().failovers == 1, 20, "the failover")
        assert slowed == ["attach"]
        connection.create_session().create_producer("queue://f5slow").send(
            "after", headers={"seq": 1}
        )
        message = consumer.receive(10)
        assert message is not None and message.text == "after"


def test_f6_auto_ack_redelivers_at_most_the_last_message(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F6: AUTO_ACKNOWLEDGE: only the last delivered message may come again."""
    url = url_for(pair, protocol)
    _fill(url, "queue://f6", 200)
    with api.connect(url) as connection:
        consumer = connection.create_session(AckMode.AUTO).create_consumer("queue://f6")
        connection.start()
        got: list[int] = []
        for _ in range(50):
            message = consumer.receive(5)
            assert message is not None
            got.append(int(str(message.properties["seq"])))
        pair.kill(pair.live)
        failures: list[ErrorCode] = []
        messages: list[str] = []
        while len(set(got)) < 200:
            try:
                message = consumer.receive(10)
            except HaFailoverError as exc:
                failures.append(exc.code)
                messages.append(str(exc))
                continue
            assert message is not None
            got.append(int(str(message.properties["seq"])))
        duplicates = len(got) - len(set(got))
        assert duplicates <= 1, got
        assert failures in ([], [ErrorCode.ACKNOWLEDGE_FAILED]), messages


def test_f6_holds_when_the_live_dies_under_pipelined_acknowledges(
    pair: BrokerPair, protocol: str
) -> None:
    """F6 with AUTO acknowledges in flight: messages stamped by their sender are handed out
    without waiting for the previous acknowledge, and the live is SIGKILLed while the
    consumer takes them as fast as it can. Whatever the broker had not confirmed comes
    again (reattached: replayed; reconnected: redelivered and dropped), and the
    application sees at most the last message it had before the kill again."""
    url = url_for(pair, protocol)
    total = 3000
    _fill(url, "queue://f6kill", total)
    killed = threading.Event()
    with hafailover.connect(url) as connection:
        consumer = connection.create_session(AckMode.AUTO).create_consumer(
            "queue://f6kill", prefetch=500
        )
        connection.start()
        got: list[int] = []
        failures = 0
        while len(set(got)) < total:
            if len(got) == 1000 and not killed.is_set():
                threading.Thread(target=lambda: (pair.kill(pair.live), killed.set())).start()
            try:
                message = consumer.receive(15)
            except AcknowledgeFailedError:
                failures += 1
                continue
            assert message is not None, f"stalled after {len(set(got))} of {total}"
            got.append(int(str(message.properties["seq"])))
        assert killed.wait(10)
        wait_until(lambda: connection.statistics().failovers >= 1, 20, "the failover")
        # Each failover brings back at most the one message handed out last, once. On a
        # loaded machine a missed heart-beat can add a failover of its own: count them all.
        failovers = connection.statistics().failovers
        assert len(got) - len(set(got)) <= failovers, (
            failovers,
            sorted({s for s in got if got.count(s) > 1}),
        )
        assert failures <= failovers
    assert drain(url, "queue://f6kill") == []


def test_f7_dups_ok_is_silent(pair: BrokerPair, protocol: str, api: Api) -> None:
    """F7: DUPS_OK_ACKNOWLEDGE: failover is silent apart from the exception listener."""
    url = url_for(pair, protocol)
    _fill(url, "queue://f7", 200)
    notices: list[HaFailoverError] = []
    with api.connect(url, exception_listener=notices.append) as connection:
        consumer = connection.create_session(AckMode.DUPS_OK).create_consumer("queue://f7")
        connection.start()
        got: list[int] = []
        for _ in range(50):
            message = consumer.receive(5)
            assert message is not None
            got.append(int(str(message.properties["seq"])))
        pair.kill(pair.live)
        while len(set(got)) < 200:
            message = consumer.receive(10)  # never raises
            assert message is not None
            got.append(int(str(message.properties["seq"])))
        wait_until(lambda: len(notices) == 1, 5, "the notice")
        assert isinstance(notices[0], FailoverNotice)


def test_f8_client_ack_dirty_session_raises_then_recovers(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F8: unacknowledged messages at failover make the session dirty: acknowledge() recovers
    and raises; the messages come again; acknowledging them then works."""
    url = url_for(pair, protocol)
    _fill(url, "queue://f8", 5)
    with api.connect(url) as connection:
        session = connection.create_session(AckMode.CLIENT)
        consumer = session.create_consumer("queue://f8")
        connection.start()
        first = [consumer.receive(5) for _ in range(5)]
        assert all(m is not None for m in first)
        pair.kill(pair.live)
        wait_until(lambda: connection.statistics().failovers == 1, 20, "the failover")
        with pytest.raises(StaleAcknowledgeError):
            session.acknowledge()
        again = [consumer.receive(10) for _ in range(5)]
        assert all(m is not None for m in again)
        assert sorted(seqs([m for m in again if m is not None])) == [0, 1, 2, 3, 4]
        session.acknowledge()
        assert consumer.receive(1.0) is None
    assert drain(url, "queue://f8") == []


@pytest.mark.parametrize("individual", [False, True], ids=["client", "client-individual"])
def test_f8_acknowledge_called_while_failing_over_raises_and_loses_nothing(
    pair: BrokerPair, protocol: str, individual: bool, api: Api
) -> None:
    """F1 + F8: an acknowledge() called during the failover waits for it, then finds the
    session dirty: it raises, and nothing is acknowledged on the new connection (where the
    old delivery ids name other messages)."""
    url = url_for(pair, protocol)
    _fill(url, "queue://f8w", 10)
    mode = AckMode.CLIENT_INDIVIDUAL if individual else AckMode.CLIENT
    with api.connect(url) as connection:
        session = connection.create_session(mode)
        consumer = session.create_consumer("queue://f8w", prefetch=10)
        connection.start()
        first = [consumer.receive(5) for _ in range(5)]
        assert all(m is not None for m in first)
        pair.kill(pair.live)
        wait_until(lambda: connection.state == "failing over", 10, "the failover to start")
        with pytest.raises(StaleAcknowledgeError):
            first[-1].acknowledge()  # type: ignore[union-attr]
        received = []
        while (message := consumer.receive(3.0)) is not None:
            received.append(message)
            message.acknowledge()
        assert sorted(seqs(received)) == list(range(10))
    assert drain(url, "queue://f8w") == []


def test_f8_recover_after_failover_cleans_the_session(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F8: recover() after failover succeeds and the session is clean."""
    url = url_for(pair, protocol)
    _fill(url, "queue://f8r", 3)
    with api.connect(url) as connection:
        session = connection.create_session(AckMode.CLIENT)
        consumer = session.create_consumer("queue://f8r")
        connection.start()
        assert consumer.receive(5) is not None
        pair.kill(pair.live)
        wait_until(lambda: connection.statistics().failovers == 1, 20, "the failover")
        session.recover()
        again = [consumer.receive(10) for _ in range(3)]
        assert all(m is not None for m in again)
        assert all(m is not None and m.redelivered for m in again[:1])
        again[-1].acknowledge()  # type: ignore[union-attr]
    assert drain(url, "queue://f8r") == []


def test_f9_transaction_becomes_rollback_only_and_retry_commits(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F9: a dirty transaction at failover is rollback-only: commit() raises rolled-back; the
    application replays on the same session and the retry commits, once-and-only-once."""
    url = url_for(pair, protocol)
    with api.connect(url) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer("queue://f9")
        batch = [Message(body=f"m{i}", properties={"seq": i}) for i in range(10)]
        for message in batch:
            producer.send(message)
        pair.kill(pair.live)
        wait_until(lambda: connection.statistics().failovers == 1, 20, "the failover")
        with pytest.raises(TransactionRolledBackError) as raised:
            session.commit()
        assert raised.value.code is ErrorCode.TRANSACTION_ROLLED_BACK
        assert connection.reports[-1].transactions_rolled_back == (session.session_id,)
        for message in batch:
            producer.send(message)
        session.commit()
    assert sorted(seqs(drain(url, "queue://f9"))) == list(range(10))


def test_f9_rollback_after_failover_succeeds(pair: BrokerPair, protocol: str, api: Api) -> None:
    """F9: rollback() always succeeds and cleans the session; received work comes again."""
    url = url_for(pair, protocol)
    _fill(url, "queue://f9r", 3)
    with api.connect(url) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        consumer = session.create_consumer("queue://f9r")
        connection.start()
        assert consumer.receive(5) is not None
        pair.kill(pair.live)
        wait_until(lambda: connection.statistics().failovers == 1, 20, "the failover")
        session.rollback()
        got = [consumer.receive(10) for _ in range(3)]
        assert sorted(seqs([m for m in got if m is not None])) == [0, 1, 2]
        session.commit()
    assert drain(url, "queue://f9r") == []


def test_f10_listener_once_per_failure_from_many_threads(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F10: the exception listener hears every failure exactly once, with code FAILOVER,
    while several sessions work on several threads; a listener that raises is harmless."""
    url = url_for(pair, protocol)
    heard: list[HaFailoverError] = []

    def listener(error: HaFailoverError) -> None:
        heard.append(error)
        raise RuntimeError("a broken listener must not break the connection")

    with api.connect(url, exception_listener=listener) as connection:
        stop = threading.Event()
        errors: list[BaseException] = []

        def work(index: int) -> None:
            producer = connection.create_session().create_producer(f"queue://f10-{index}")
            while not stop.is_set():
                try:
                    producer.send("x")
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        pair.kill(pair.live)
        wait_until(lambda: connection.statistics().failovers == 1, 20, "the failover")
        time.sleep(0.5)
        stop.set()
        for thread in threads:
            thread.join(10)
        assert errors == []
        wait_until(lambda: len(heard) >= 1, 5, "the notice")
        time.sleep(0.3)
        assert len(heard) == 1
        assert heard[0].code is ErrorCode.FAILOVER
        assert isinstance(heard[0], FailoverNotice)
        assert heard[0].reattached is False


def test_f11_browser_failover_raises(pair: BrokerPair, protocol: str, api: Api) -> None:
    """F11: a failover during browsing raises BrowserInvalidatedError, never a silent end."""
    url = url_for(pair, protocol)
    _fill(url, "queue://f11", 20)
    with api.connect(url) as connection:
        session = connection.create_session()
        assert len(session.create_browser("queue://f11").messages()) == 20
        iterator = iter(session.create_browser("queue://f11"))
        assert next(iterator) is not None
        pair.kill(pair.live)
        wait_until(lambda: connection.statistics().failovers == 1, 20, "the failover")
        with pytest.raises(BrowserInvalidatedError):
            for _ in iterator:
                pass
        # Browsing again works on the backup, and nothing was consumed.
        assert len(session.create_browser("queue://f11").messages()) == 20


def test_f12_initial_connect_does_not_fail_over(pair: BrokerPair, protocol: str, api: Api) -> None:
    """F12: the first connection does not go to the backup unless initial_connect_attempts
    allows more attempts; topology learned from the live adds the backup."""
    live, backup = pair.live, pair.backup
    live_port = live.stomp_port if protocol == "stomp" else live.amqp_port
    backup_port = backup.stomp_port if protocol == "stomp" else backup.amqp_port
    creds = f"{pair.user}:{pair.password}"
    # Only the live in the URL: the backup comes from the topology announcement.
    url = f"{protocol}://{creds}@127.0.0.1:{live_port}?heartbeat=250ms&retry_interval=50ms"
    with api.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://f12")
        pair.kill(live)
        producer.send("after", headers={"seq": 1})
        assert connection.reports[-1].to_broker is not None
        assert str(backup_port) in connection.reports[-1].to_broker
    dead = f"failover:({protocol}://{creds}@127.0.0.1:{live_port},{protocol}://{creds}@127.0.0.1:{backup_port})"
    with pytest.raises(hafailover.NotConnectedError):
        api.connect(f"{dead}?initial_connect_attempts=1")
    with api.connect(f"{dead}?initial_connect_attempts=2&retry_interval=50ms") as connection:
        assert connection.broker is not None
        assert str(backup_port) in connection.broker


def test_f13_resend_after_unknown_outcome_is_stored_once(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F13: a send whose outcome was unknown at failover is resent with its duplicate id and
    stored once; sending the same Message object twice stores it once."""
    url = url_for(pair, protocol)
    with api.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://f13")
        message = Message(body="once", properties={"seq": 1})
        producer.send(message)
        producer.send(message)  # same id: the broker drops the copy and still confirms
        live = pair.live
        pair.pause(live)
        pending = [producer.send_async(f"m{i}", headers={"seq": 10 + i}) for i in range(20)]
        time.sleep(0.3)
        pair.kill(live)
        for completion in pending:
            completion.result(30)
        assert len(connection.reports[-1].resent) >= 1
    got = seqs(drain(url, "queue://f13"))
    assert sorted(got) == [1, *range(10, 30)]


def test_f14_contradicting_link_reliability_is_refused(
    pair: BrokerPair, protocol: str, api: Api
) -> None:
    """F14: at-least-once on a no-ack session is a configuration error."""
    with api.connect(url_for(pair, protocol)) as connection:
        session = connection.create_session(AckMode.NO_ACKNOWLEDGE)
        with pytest.raises(hafailover.ConfigurationError):
            session.create_consumer("queue://f14", reliability=LinkReliability.AT_LEAST_ONCE)
        session.create_consumer("queue://f14", reliability=LinkReliability.AT_MOST_ONCE)
        client = connection.create_session(AckMode.CLIENT)
        with pytest.raises(hafailover.ConfigurationError):
            client.create_consumer("queue://f14", reliability=LinkReliability.UNRELIABLE)
