"""Waiting for the broker: the completion an application holds, and what the driver keeps
beside each call the sessions core tracks by token.

A ``SendCompletion`` is finished under the connection's lock; its done-callbacks are run
after the lock is released, on the thread that finished it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from hafailover.destination import Destination
from hafailover.errors import HaFailoverError
from hafailover.message import Message

if TYPE_CHECKING:
    from hafailover.driver.calls import Calls
    from hafailover.driver.consumer import Consumer
    from hafailover.driver.producer import Producer

__all__ = ["Callback", "SendCompletion", "Waiting"]


class SendCompletion:
    """The outcome of an asynchronous send (or of any call waiting for the broker)."""

    __slots__ = ("_callbacks", "_connection", "_done", "_error", "message")

    def __init__(self, connection: Calls, message: Message | None) -> None:
        self._connection = connection
        self.message = message
        self._done = False
        self._error: HaFailoverError | None = None
        self._callbacks: list[Callable[[SendCompletion], None]] | None = None

    def done(self) -> bool:
        return self._done

    def exception(self) -> HaFailoverError | None:
        """The error it ended with, or None (also while not done)."""
        return self._error

    def result(self, timeout: float | None = None) -> None:
        """Wait until the broker confirmed it; raise what went wrong.

        ``timeout`` defaults to the connection's call_timeout; time spent failing over does
        not count (F1), unless call_failover_timeout is set."""
        if not self._done:
            self._connection._wait_done(self, timeout)
        if self._error is not None:
            raise self._error

    def add_done_callback(self, callback: Callable[[SendCompletion], None]) -> None:
        """Call ``callback(self)`` once done (at once if it already is), on the thread that
        completes it: keep it short and never block in it."""
        with self._connection._cond:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback(self)

    def _finish(self, error: HaFailoverError | None) -> list[Callback]:
        """Under the connection's lock; returns the callbacks to run outside it."""
        self._done = True
        self._error = error
        callbacks, self._callbacks = self._callbacks, None
        return [(callback, self) for callback in callbacks or ()]


Callback = tuple[Callable[[SendCompletion], None], SendCompletion]


@attrs.define(slots=True)
class Waiting:
    """The driver's side of a call the sessions core tracks: what to finish, and what a
    resend needs."""

    completion: SendCompletion
    destination: Destination | None = None  # a send: where it goes again
    producer: Producer | None = None  # a send: whose flush() waits for it
    consumer: Consumer | None = None  # a subscription
