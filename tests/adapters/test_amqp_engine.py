"""The AMQP engine with no socket: its bytes go to a scripted proton peer in memory and the
time is a number, so openings, losses, heart-beats and settlements run in milliseconds and
in a chosen order (the real broker and real sockets: test_amqp_transport.py)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proton import Collector, Condition, Connection, Delivery, Event, Receiver, Transport

from hafailover.destination import Destination
from hafailover.errors import (
    CallTimeoutError,
    NotConnectedError,
    ProtocolError,
    TransactionOutcomeUnknownError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.protocols.amqp.engine import AmqpEngine, Pending
from hafailover.url import BrokerAddress

BROKER = BrokerAddress("amqp", "127.0.0.1", 5672)
QUEUE = Destination.queue("q")


class Recorder:
    """The engine's events, in the order they were taken."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def on_message(self, subscription: str, delivery: int, message: Message) -> None:
        self.log.append(("message", subscription, delivery, message.body))

    def on_settled(self, token: int, error: object) -> None:
        self.log.append(("settled", token, error))

    def on_error(self, error: object) -> None:
        self.log.append(("error", error))

    def on_lost(self, reason: str) -> None:
        self.log.append(("lost", reason))

    def on_browse_end(self, subscription: str) -> None:
        self.log.append(("browse_end", subscription))

    def kinds(self) -> list[str]:
        return [entry[0] for entry in self.log]


class Peer:
    """A broker's proton engine in server mode that answers what the test tells it to."""

    def __init__(self, *, attach: bool = True) -> None:
        self.connection = Connection()
        self.collector = Collector()
        self.connection.collect(self.collector)
        self.transport = Transport(Transport.SERVER)
        self.transport.sasl().allowed_mechs("ANONYMOUS")
        self.transport.bind(self.connection)
        self.attach = attach  # answer attaches (else they wait)
        self.unanswered: list[Any] = []
        self.received: list[Delivery] = []
        self.closed_links: list[str] = []

    def process(self) -> None:
        while (event := self.collector.peek()) is not None:
            kind = event.type
            if kind == Event.CONNECTION_REMOTE_OPEN:
                assert event.connection is not None
                event.connection.open()
            elif kind == Event.SESSION_REMOTE_OPEN:
                assert event.session is not None
                event.session.open()
            elif kind == Event.LINK_REMOTE_OPEN:
                if self.attach:
                    self.answer(event.link)
                else:
                    self.unanswered.append(event.link)
            elif kind == Event.LINK_REMOTE_CLOSE:
                assert event.link is not None
                self.closed_links.append(event.link.name)
            elif kind == Event.DELIVERY:
                delivery = event.delivery
                assert delivery is not None
                link = delivery.link
                if isinstance(link, Receiver) and delivery.readable and not delivery.partial:
                    link.recv(delivery.pending)
                    link.advance()
                    self.received.append(delivery)
            self.collector.pop()

    @staticmethod
    def answer(link: Any) -> None:
        link.source.copy(link.remote_source)
        link.target.copy(link.remote_target)
        link.open()
        if link.is_receiver:
            link.flow(1000)

    def settle(self, count: int, state: int = Delivery.ACCEPTED) -> None:
        for delivery in self.received[:count]:
            delivery.update(state)
            delivery.settle()
        del self.received[:count]


def exchange(engine: AmqpEngine, peer: Peer, now: float) -> None:
    """Pass bytes both ways until neither side has anything more to say."""
    for _ in range(50):
        moved = False
        out = engine.output()
        if out and peer.transport.capacity() > 0:
            peer.transport.push(out)
            moved = True
        peer.process()
        size = peer.transport.pending()
        if size > 0:
            data = peer.transport.peek(size) or b""
            peer.transport.pop(size)
            engine.received(data, now)
            moved = True
        if not moved:
            return
    raise AssertionError("the two engines never stopped talking")


def opened(heartbeat: float = 1.0, **peer: Any) -> tuple[AmqpEngine, Peer, Recorder]:
    events = Recorder()
    engine = AmqpEngine(events, heartbeat=heartbeat)
    opening = engine.start(BROKER)
    broker = Peer(**peer)
    exchange(engine, broker, 0.0)
    assert opening.done
    assert opening.result().broker == BROKER
    return engine, broker, events


def take(engine: AmqpEngine) -> None:
    """Call the queued events, as the driver's I/O does once it lets go of its lock."""
    for callback, args in engine.take_events():
        callback(*args)


def test_the_idle_timeout_waits_for_the_login() -> None:
    """A broker slow to answer the login is not declared dead by the heart-beat: until the
    SASL outcome the caller's connect timeout bounds the handshake."""
    events = Recorder()
    engine = AmqpEngine(events, heartbeat=0.25)
    opening = engine.start(BROKER)
    broker = Peer()
    broker.transport.push(engine.output())  # the headers, which the broker does not answer yet
    assert engine.tick(0.0) == 0.0  # no deadline: nothing heard yet, nothing to keep alive
    engine.tick(3600.0)
    take(engine)
    assert not opening.done
    assert events.log == []
    broker.process()
    exchange(engine, broker, 3600.0)
    assert opening.done
    assert broker.transport.remote_idle_timeout > 0  # the Open announced it after the login


def test_a_silent_broker_is_lost_once_and_its_waiters_wake_after_the_loss() -> None:
    engine, _, events = opened(heartbeat=1.0, attach=False)
    attaching = engine.subscribe("s", QUEUE, credit=10, settle_on_delivery=False)
    declared = engine.declare()
    woke: list[str] = []
    attaching.notify = lambda: woke.append(f"after {events.kinds()}")
    declared.notify = lambda: woke.append(f"after {events.kinds()}")
    deadline = engine.tick(0.5)
    assert 0.5 < deadline <= 2.5
    engine.tick(1.9)
    take(engine)
    assert events.log == []
    engine.tick(2.6)  # twice the heart-beat without a byte
    assert engine.ended
    take(engine)
    assert events.kinds() == ["lost"]
    assert "idle-timeout" in events.log[0][1]
    assert woke == ["after ['lost']", "after ['lost']"]
    with pytest.raises(UnblockedError, match="subscribe 's'"):
        attaching.result()
    with pytest.raises(UnblockedError, match="declare"):
        declared.result()
    engine.input_closed("closed by the broker", 3.0)
    engine.tick(4.0)
    take(engine)
    assert events.kinds() == ["lost"]  # once


def test_a_commit_cut_by_a_loss_is_in_doubt() -> None:
    engine, broker, events = opened()
    declared = engine.declare()
    exchange(engine, broker, 0.1)
    # The peer is no transaction coordinator: it attached the link but answers nothing.
    assert not declared.done
    engine.input_closed("reading failed: connection reset", 0.2)
    take(engine)
    assert events.kinds() == ["lost"]
    assert "connection reset" in events.log[0][1]
    with pytest.raises(UnblockedError):
        declared.result()


def test_a_refusal_that_ends_the_session_reaches_its_request_after_the_loss() -> None:
    """RabbitMQ refuses a transaction coordinator by ending the session: the declare gets
    the refusal, not a loss, and wakes only once the loss is reported, so what its caller
    does next meets a failover already begun, never the dead connection."""
    engine, broker, events = opened(attach=False)
    declared = engine.declare()
    woke: list[list[str]] = []
    declared.notify = lambda: woke.append(events.kinds())
    exchange(engine, broker, 0.1)
    session = broker.unanswered[0].session
    session.condition = Condition("amqp:not-implemented", "transactions are not supported")
    session.close()
    exchange(engine, broker, 0.2)
    take(engine)
    assert events.kinds() == ["lost"]
    assert woke == [["lost"]]
    with pytest.raises(ProtocolError, match="amqp:not-implemented"):
        declared.result()


def test_requests_after_the_end_are_refused() -> None:
    engine, _, _ = opened()
    engine.abort()
    with pytest.raises(NotConnectedError):
        engine.transfer(1, "queue://q", False, b"x", None)
    with pytest.raises(NotConnectedError):
        engine.declare()


def test_an_abandoned_attach_is_undone_when_the_answer_comes() -> None:
    engine, broker, _ = opened(attach=False)
    attaching = engine.subscribe("s", QUEUE, credit=10, settle_on_delivery=False)
    exchange(engine, broker, 0.1)
    attaching.abandoned = True  # the caller stopped waiting (CallTimeoutError)
    for link in broker.unanswered:
        broker.answer(link)
    exchange(engine, broker, 0.2)
    assert not attaching.done
    assert broker.closed_links  # the engine closed what nobody took
    # and the name is free again
    engine.subscribe("s", QUEUE, credit=10, settle_on_delivery=False)


def test_a_refused_transfer_is_settled_with_the_refusal() -> None:
    engine, broker, events = opened()
    engine.transfer(7, "queue://q", False, b"payload", None)
    engine.transfer(8, "queue://q", False, b"payload", None)
    exchange(engine, broker, 0.1)
    broker.settle(1, Delivery.REJECTED)
    broker.settle(1, Delivery.ACCEPTED)
    exchange(engine, broker, 0.2)
    take(engine)
    assert [entry[:2] for entry in events.log] == [("settled", 7), ("settled", 8)]
    assert isinstance(events.log[0][2], ProtocolError)
    assert events.log[1][2] is None


def test_a_close_ends_with_the_brokers_close() -> None:
    engine, broker, events = opened()
    declared = engine.declare()
    engine.close()
    exchange(engine, broker, 0.1)
    broker.connection.close()
    exchange(engine, broker, 0.2)
    take(engine)
    assert engine.ended
    assert events.log == []  # an asked-for close is no loss
    with pytest.raises(Exception, match="closed"):
        declared.result()


def test_the_broker_closing_says_why() -> None:
    engine, broker, events = opened()
    broker.connection.condition = Condition("amqp:connection:forced", "the live is shutting down")
    broker.connection.close()
    exchange(engine, broker, 0.1)
    take(engine)
    assert events.kinds() == ["lost"]
    assert "shutting down" in events.log[0][1]


def test_a_pending_fails_once_and_a_late_answer_is_refused() -> None:
    request: Pending[int] = Pending("x", TransactionOutcomeUnknownError)
    request.fail(CallTimeoutError("first"))
    request.fail(UnblockedError("second"))
    assert not request.succeed(1)
    with pytest.raises(CallTimeoutError, match="first"):
        request.result()


# Sends, the broker's settlements and a loss, in any order: every send is settled at most
# once, only with what the broker said before the loss, and nothing is settled after it.
_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(1, 3)),
        st.tuples(st.just("accept"), st.integers(1, 3)),
        st.tuples(st.just("reject"), st.integers(1, 3)),
        st.tuples(st.just("exchange"), st.just(0)),
        st.tuples(st.just("lose"), st.just(0)),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(steps=_STEPS)
def test_each_send_is_settled_at_most_once_and_never_after_the_loss(
    steps: list[tuple[str, float]],
) -> None:
    engine, broker, events = opened(heartbeat=1.0)
    now = 0.0
    tokens = iter(range(1, 10_000))
    sent: list[int] = []
    for step, amount in steps:
        if step == "send" and not engine.ended:
            for _ in range(int(amount)):
                token = next(tokens)
                engine.transfer(token, "queue://q", False, b"m", None)
                sent.append(token)
        elif step in ("accept", "reject"):
            state = Delivery.ACCEPTED if step == "accept" else Delivery.REJECTED
            broker.settle(int(amount), state)
        elif step == "exchange" and not engine.ended:
            exchange(engine, broker, now)
        elif step == "lose":
            engine.input_closed("closed by the broker", now)
        elif step == "tick":
            now += amount
            engine.tick(now)
        take(engine)
    kinds = events.kinds()
    settled = [entry[1] for entry in events.log if entry[0] == "settled"]
    assert len(settled) == len(set(settled))
    assert set(settled) <= set(sent)
    # Not asserted: their order. Deliveries one read updates come out of proton's collector
    # in its own order (an acceptance and a rejection in one read can come reversed), and
    # AMQP does not order settlements across deliveries either.
    assert kinds.count("lost") <= 1
    if "lost" in kinds:
        assert "settled" not in kinds[kinds.index("lost") :]
        assert engine.ended


def _peer_sender(broker: Peer) -> Any:
    from proton import Endpoint, Sender

    link = broker.connection.link_head(Endpoint.LOCAL_ACTIVE)
    while link is not None and not isinstance(link, Sender):
        link = link.next(Endpoint.LOCAL_ACTIVE)
    assert link is not None
    return link


def test_a_pull_subscription_has_credit_only_while_a_receive_waits() -> None:
    """Zero prefetch: no credit at the attach, one per pull (never more), and a drain the
    broker answers by returning it; a drain answered by a message completes after it."""
    from proton import Message as ProtonMessage

    engine, broker, events = opened()
    attaching = engine.subscribe("s", QUEUE, credit=0, settle_on_delivery=False)
    exchange(engine, broker, 0.1)
    assert attaching.done
    sender = _peer_sender(broker)
    assert sender.credit == 0
    engine.pull("s")
    engine.pull("s")  # a second wake of the same receive asks for nothing more
    exchange(engine, broker, 0.2)
    broker.process()
    assert sender.credit == 1
    drained = engine.drain("s")
    exchange(engine, broker, 0.3)
    assert sender.drain_mode and not drained.done
    sender.drained()  # nothing to send: the broker gives the credit back
    exchange(engine, broker, 0.4)
    take(engine)
    assert drained.done and sender.credit == 0

    engine.pull("s")
    exchange(engine, broker, 0.5)
    assert sender.credit == 1 and not sender.drain_mode  # a pull is no drain
    drained = engine.drain("s")
    exchange(engine, broker, 0.6)
    sender.delivery(b"t1")
    sender.send(ProtonMessage(body="pulled").encode())
    sender.advance()
    exchange(engine, broker, 0.7)
    woke: list[list[str]] = []
    drained.notify = lambda: woke.append(events.kinds())
    take(engine)
    assert drained.done
    assert woke == [["message"]]  # the message was routed before the drain's waiter woke
