"""The driver's seam for a caller that must never block (``hafailover.aio``): each call
here either finishes now or raises WouldBlock with the wait it needs, as a value
(hafailover.core.waits), for the caller to serve with the one ``Waiter``; or it is written
as steps (``driver/waits.py``): each wait for the broker yielded as a ``Wait``, each
blocking socket call that has no other form (an AMQP attach or declare, joining a
listener thread) as a ``Blocking`` for the caller to make off its loop. The drain of a
zero-prefetch consumer whose receive timed out is a blocking call of its own (``drain``).

The only way in to the driver's state for such a caller: hafailover.aio reads no private
member of the driver (tests/aio/test_no_driver_privates.py), so what it needs is named
here, and a change inside the driver changes this module, not the bridge. No rule is
decided here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from hafailover.ack_modes import AckMode
from hafailover.core.subscriptions import SubscriptionKind
from hafailover.core.waits import Wait
from hafailover.destination import Destination
from hafailover.driver.browser import Browser
from hafailover.driver.completions import SendCompletion
from hafailover.driver.connection import Connection
from hafailover.driver.consumer import Consumer
from hafailover.driver.producer import Producer
from hafailover.driver.session import Session
from hafailover.driver.transactions import TransactionAttempt
from hafailover.driver.waits import Steps, budget_of
from hafailover.errors import IllegalStateError
from hafailover.message import Message, PropertyValue

__all__ = [
    "SendOptions",
    "acknowledge",
    "ask_for_receipt",
    "browse_end",
    "browse_next",
    "browse_open",
    "close_session",
    "commit",
    "completion_wait",
    "create_consumer",
    "create_durable_consumer",
    "create_session",
    "create_shared_consumer",
    "create_shared_durable_consumer",
    "drain",
    "end_attempt",
    "failover_deadline",
    "flush_wait",
    "pull_now",
    "receive_now",
    "release",
    "rollback",
    "send",
    "send_now",
    "temporary_queue",
    "unsubscribe",
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
) -> Steps[SendCompletion]:
    """Write a send as steps: it waits for admission and room, and begins its transaction
    first in a transacted session."""
    return producer._send_steps(message, *options, receipt=receipt)


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


def release(message: Message) -> Steps[None]:
    """``message.release()`` as steps: it waits out a failover (F1), then writes the
    give-back (nothing to wait for after it)."""
    consumer = getattr(message._releaser, "__self__", None)
    if not isinstance(consumer, Consumer):
        raise IllegalStateError(
            "this message was built here, not received: there is nothing to release"
        )
    return consumer._release_steps(message)


def acknowledge(session: Session, message: Message | None, confirm: bool = True) -> Steps[None]:
    """``message.acknowledge(confirm=)`` (on the session that delivered it), or
    ``session.acknowledge()`` when None, as steps: it waits out a failover, then (unless
    ``confirm`` is False) for the broker's confirmation."""
    if message is None:
        return session._acknowledge_all_steps()
    delivery = message.delivery
    connection = session.connection
    with connection._cond:
        owner = None if delivery is None else connection._sessions.get(delivery.session_id)
    return (owner or session)._acknowledge_message_steps(message, confirm)


# --- transactions -------------------------------------------------------------------------


def commit(session: Session) -> Steps[None]:
    """``session.commit()`` as steps."""
    return session._commit_steps()


def rollback(session: Session) -> Steps[None]:
    """``session.rollback()`` as steps."""
    return session._rollback_steps()


def end_attempt(attempt: TransactionAttempt, error: BaseException | None) -> Steps[bool]:
    """The end of a transaction block's attempt (``attempt.__exit__``) as steps: commit,
    or roll back when the block raised ``error``; whether to swallow ``error``."""
    return attempt._exit_steps(error)


# --- consumers ----------------------------------------------------------------------------


def pull_now(consumer: Consumer) -> Message:
    """Zero prefetch: the next message, or WouldBlock having asked the broker for one."""
    return consumer._pull_now()


def drain(consumer: Consumer) -> Message | None:
    """Zero prefetch, a receive timed out: take the request back (blocking: a round trip
    to the broker); the message the broker sent meanwhile, if any."""
    return consumer._drain_now()


def create_consumer(
    session: Session, destination: str | Destination, **options: Any
) -> Steps[Consumer]:
    """``session.create_consumer`` as steps (the same options)."""
    return session._consumer_steps(destination, **options)


def create_durable_consumer(
    session: Session, topic: str | Destination, name: str, **options: Any
) -> Steps[Consumer]:
    """``session.create_durable_consumer`` as steps (the same options)."""
    return _named(
        "create_durable_consumer", session._durable_consumer_steps, topic, name, **options
    )


def create_shared_consumer(
    session: Session, topic: str | Destination, name: str, **options: Any
) -> Steps[Consumer]:
    """``session.create_shared_consumer`` as steps (the same options)."""
    return _named(
        "create_shared_consumer",
        session._shared_consumer_steps,
        SubscriptionKind.SHARED,
        topic,
        name,
        **options,
    )


def create_shared_durable_consumer(
    session: Session, topic: str | Destination, name: str, **options: Any
) -> Steps[Consumer]:
    """``session.create_shared_durable_consumer`` as steps (the same options)."""
    return _named(
        "create_shared_durable_consumer",
        session._shared_consumer_steps,
        SubscriptionKind.SHARED_DURABLE,
        topic,
        name,
        **options,
    )


def _named(
    call: str, steps: Callable[..., Steps[Consumer]], *args: Any, **options: Any
) -> Steps[Consumer]:
    """``steps(*args, **options)``, an option it does not take named as the caller's
    ``call``'s, not as the private method's."""
    try:
        inspect.signature(steps).bind(*args, **options)
    except TypeError as exc:
        raise TypeError(f"{call}() {exc}") from None
    return steps(*args, **options)


def unsubscribe(session: Session, name: str) -> Steps[None]:
    """``session.unsubscribe(name)`` as steps."""
    return session._unsubscribe_steps(name)


def temporary_queue(session: Session) -> Steps[Destination]:
    """``session.create_temporary_queue()`` as steps."""
    return session._temporary_queue_steps()


def close_session(session: Session) -> Steps[None]:
    """``session.close()`` as steps."""
    return session._close_steps()


# --- browsers -----------------------------------------------------------------------------


def browse_open(browser: Browser) -> Steps[str]:
    """Start a snapshot of the browser's queue; its subscription, for ``browse_next`` and
    ``browse_end``."""
    return browser._open_steps()


def browse_next(browser: Browser, subscription: str) -> Steps[Message | None]:
    """The snapshot's next message (None at its end) as steps; BrowserInvalidatedError
    once a failover cut it (F11)."""
    return browser._next_steps(subscription)


def browse_end(browser: Browser, subscription: str) -> None:
    """The snapshot is done with (never waits)."""
    browser._end(subscription)
