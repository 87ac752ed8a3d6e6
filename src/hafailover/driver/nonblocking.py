"""The driver's seam for a caller that must never block (``hafailover.aio``): each call
here either finishes now or raises WouldBlock with the wait it needs, as a value
(hafailover.core.waits), for the caller to serve with the one ``Waiter``.

The only way in to the driver's state for such a caller: hafailover.aio reads no private
member of the driver (tests/aio/test_no_driver_privates.py), so what it needs is named
here, and a change inside the driver changes this module, not the bridge. No rule is
decided here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hafailover.ack_modes import AckMode
from hafailover.core.waits import Wait
from hafailover.destination import Destination
from hafailover.driver.completions import SendCompletion
from hafailover.driver.connection import Connection
from hafailover.driver.consumer import Consumer
from hafailover.driver.producer import Producer
from hafailover.driver.session import Session
from hafailover.driver.waits import Steps, budget_of
from hafailover.message import Message, PropertyValue

__all__ = [
    "SendOptions",
    "acknowledge",
    "ask_for_receipt",
    "completion_wait",
    "create_session",
    "failover_deadline",
    "flush_wait",
    "receive_now",
    "send",
    "send_now",
    "watch",
]

# destination, headers, persistent, priority, time_to_live: as Producer.send takes them.
SendOptions = tuple[
    str | Destination | None,
    Mapping[str, PropertyValue] | None,
    bool | None,
    int | None,
    float | None,
]


def watch(connection: Connection, watcher: Callable[[], None] | None) -> None:
    """Tell ``watcher`` of every change a waiting call may wait for (a call ended, room in
    the window, a delivery, the connection back or gone). It is called on a driver thread
    under the connection's lock: it must never block."""
    connection._cond.watcher = watcher


def ask_for_receipt(connection: Connection) -> None:
    """Someone awaits a confirmation: ask the broker for one if no written frame has."""
    with connection._cond:
        connection._ask_for_receipt()


def failover_deadline(connection: Connection) -> float | None:
    """A new call's deadline (time.monotonic()) for the connection to come back, from
    call_failover_timeout; kept across the tries of one call."""
    return connection._failover_deadline()


def completion_wait(connection: Connection, completion: SendCompletion) -> Wait[SendCompletion]:
    """The wait for ``completion``: call_timeout and call_failover_timeout, as
    ``completion.result()`` waits."""
    return connection._completion_wait(completion)


def send_now(
    producer: Producer,
    message: Message | bytes | str,
    options: SendOptions,
    *,
    receipt: bool,
    failover_deadline: float | None,
) -> SendCompletion:
    """Write a send now and return its completion, or raise WouldBlock having sent nothing
    (failing over, the window full, a transaction to begin)."""
    return producer._send(
        message, *options, receipt=receipt, block=False, failover_deadline=failover_deadline
    )


def send(
    producer: Producer, message: Message | bytes | str, options: SendOptions, *, receipt: bool
) -> SendCompletion:
    """Write a send, waiting for admission, room and its transaction to begin (blocks)."""
    return producer._send(message, *options, receipt=receipt)


def flush_wait(producer: Producer, timeout: float | None = None) -> Wait[SendCompletion] | None:
    """The wait of ``producer.flush(timeout)``; None when nothing is outstanding."""
    connection = producer.session.connection
    with connection._cond:
        if producer._outstanding <= 0:
            return None
    return Wait(
        lambda: producer._outstanding <= 0,
        budget_of(connection, timeout),
        asks_receipt=True,
        timed_out=lambda: f"{producer._outstanding} send(s) still unconfirmed after the timeout",
    )


def receive_now(consumer: Consumer) -> Message | None:
    """The next message if one can be handed out without waiting, else None; raises
    WouldBlock while an AUTO acknowledge must be confirmed first (F6)."""
    return consumer._receive_now()


def create_session(connection: Connection, ack_mode: AckMode) -> Steps[Session]:
    """``connection.create_session(ack_mode)`` as steps: it waits while failing over."""
    return connection._session_steps(ack_mode)


def acknowledge(session: Session, message: Message | None) -> Steps[None]:
    """``message.acknowledge()`` (on the session that delivered it), or
    ``session.acknowledge()`` when None, as steps: it waits out a failover, then for the
    broker's confirmation."""
    if message is None:
        return session._acknowledge_all_steps()
    delivery = message.delivery
    connection = session.connection
    with connection._cond:
        owner = None if delivery is None else connection._sessions.get(delivery.session_id)
    return (owner or session)._acknowledge_message_steps(message)
