"""The driver's tracing hook: the points where an instrumentation may watch a send, a
receive, a message listener's processing and a failover, and nothing more.

No hook is installed by default; the driver then pays one module attribute test per call.
An instrumentation (``hafailover.otel``, the ``otel`` extra) installs one ``TracingHooks``
for the whole process with ``install``. The driver calls it on the thread doing the work:
the application's for a send or a receive, the session's around a message listener, and
the listener thread once per failover, never under the connection's lock. A hook decides
nothing for the driver: it may add properties to the copy of a message that goes out
(the trace context travels there), and must neither block nor raise.

This module imports nothing of any tracing library.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Final, Protocol

import attrs

from hafailover.core.report import FailoverReport
from hafailover.destination import Destination
from hafailover.message import Message
from hafailover.url import Protocol as WireProtocol

if TYPE_CHECKING:
    from hafailover.driver.consumer import Consumer

__all__ = ["Peer", "SendTrace", "TracingHooks", "install", "installed"]


@attrs.frozen
class Peer:
    """The broker a connection is on (or was last on), as tracing names it."""

    protocol: WireProtocol
    product: str  # what the broker calls itself; "" when it says nothing
    host: str
    port: int


class SendTrace(Protocol):
    """One send being watched."""

    def end(self, error: BaseException | None, peer: Peer) -> None:
        """The send completed (``error`` None: confirmed, or written when nothing is
        confirmed); ``peer`` is the broker the connection is on by then."""
        ...


class TracingHooks(Protocol):
    """What an instrumentation implements."""

    def send(self, peer: Peer, destination: Destination, message: Message) -> SendTrace:
        """Before a send is written; ``message`` is the copy that goes out, which the hook
        may give properties (and an id, ``ensure_message_id``)."""
        ...

    def receive(
        self, peer: Peer, destination: Destination, message: Message, started_ns: int
    ) -> AbstractContextManager[None]:
        """Around the end of a ``receive()`` (its automatic acknowledge) that returns
        ``message``; the call began at ``started_ns`` (``time.time_ns()``)."""
        ...

    def process(
        self, peer: Peer, destination: Destination, message: Message
    ) -> AbstractContextManager[None]:
        """Around a message listener's call with ``message``."""
        ...

    def failover(self, peer: Peer, report: FailoverReport, ended_ns: int) -> None:
        """Once per connection failure, with its report, which was made at ``ended_ns``."""
        ...


_hooks: TracingHooks | None = None
_NOTHING: Final[AbstractContextManager[None]] = contextlib.nullcontext()


def install(hooks: TracingHooks | None) -> TracingHooks | None:
    """Make ``hooks`` the process's tracing hooks (None: none); returns the previous ones."""
    global _hooks
    previous, _hooks = _hooks, hooks
    return previous


def installed() -> TracingHooks | None:
    return _hooks


def started() -> int:
    """When a receive began, if anybody will want to know."""
    return time.time_ns() if _hooks is not None else 0


def receiving(
    consumer: Consumer, message: Message, started_ns: int
) -> AbstractContextManager[None]:
    hooks = _hooks
    if hooks is None or not started_ns:
        return _NOTHING
    return hooks.receive(
        consumer.session.connection._peer, consumer.destination, message, started_ns
    )


def processing(consumer: Consumer, message: Message) -> AbstractContextManager[None]:
    hooks = _hooks
    if hooks is None:
        return _NOTHING
    return hooks.process(consumer.session.connection._peer, consumer.destination, message)
