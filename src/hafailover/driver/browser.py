"""A queue browser of the threaded driver (F11)."""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hafailover.core.waits import CallBudget, Wait
from hafailover.destination import Destination
from hafailover.driver.waits import Steps, attempts, blocking, run_steps
from hafailover.errors import BrowserInvalidatedError, NotConnectedError, UnblockedError
from hafailover.message import Message

if TYPE_CHECKING:
    from hafailover.driver.session import Session
    from hafailover.protocols.base import Link

__all__ = ["Browser"]


class Browser:
    """Iterates over a queue's waiting messages without consuming them.

    Each iteration takes a fresh snapshot. A failover during iteration raises
    BrowserInvalidatedError (F11): the rest of the snapshot is gone, and iterating silently
    to the end would lie about what the queue holds."""

    def __init__(self, session: Session, queue: Destination) -> None:
        self.session = session
        self.queue = queue
        self._buffer: collections.deque[Message] = collections.deque()
        self._ended = False
        self._invalid = False
        self._iterating = False

    def _invalidate(self) -> None:
        if self._iterating:
            self._invalid = True

    def __iter__(self) -> Iterator[Message]:
        connection = self.session.connection
        subscription = run_steps(connection, self._open_steps())
        try:
            while (message := run_steps(connection, self._next_steps(subscription))) is not None:
                yield message
        finally:
            self._end(subscription)

    def _open_steps(self) -> Steps[str]:
        """Start a snapshot (waiting out a failover, F1); its subscription. Whoever runs
        these steps ends the snapshot with ``_end`` once they have returned."""
        session = self.session
        session._check_open()
        connection = session.connection
        link, subscription = yield from attempts(
            functools.partial(self._opened, connection._failover_deadline())
        )
        if link.calls_block:
            try:
                yield from blocking(functools.partial(link.browse, subscription, self.queue))
            except BaseException as exc:
                self._end(subscription)
                if isinstance(exc, NotConnectedError | UnblockedError):
                    raise BrowserInvalidatedError(f"browsing {self.queue} failed: {exc}") from exc
                raise
        return subscription

    def _opened(self, deadline: float | None) -> tuple[Link, str]:
        """Under the lock, once the connection admits calls (WouldBlock, nothing done,
        while it fails over): register the snapshot and ask for it unless the link's calls
        block."""
        connection = self.session.connection
        with connection._cond:
            link = connection._admit(deadline, block=False)
            subscription = f"browse-{next(connection._subscription_ids)}"
            self._buffer.clear()
            self._ended = self._invalid = False
            self._iterating = True
            connection._browsing[subscription] = self
            if not link.calls_block:
                try:
                    link.browse(subscription, self.queue)
                except BaseException:
                    self._iterating = False
                    connection._browsing.pop(subscription, None)
                    raise
        return link, subscription

    def _next_steps(self, subscription: str) -> Steps[Message | None]:
        """The snapshot's next message, None at its end; BrowserInvalidatedError once a
        failover cut it (F11)."""
        session = self.session
        connection = session.connection
        while True:
            with connection._cond:
                if self._invalid:
                    raise BrowserInvalidatedError(
                        f"the connection failed over while browsing {self.queue}; browse again"
                    )
                if self._buffer:
                    return self._buffer.popleft()
                if self._ended:
                    return None
                session._check_open()
            # No timeout: the snapshot ends, or a failover invalidates it.
            yield Wait(self._changed, CallBudget(math.inf))

    def _changed(self) -> bool:
        """Under the lock: whether a waiting ``_next_steps`` should look again."""
        return bool(self._buffer) or self._ended or self._invalid or self.session._closed

    def _end(self, subscription: str) -> None:
        with self.session.connection._cond:
            self._iterating = False
            self.session.connection._browsing.pop(subscription, None)

    def messages(self) -> list[Message]:
        """The whole snapshot as a list."""
        return list(self)

    def close(self) -> None:
        with self.session.connection._cond:
            self._iterating = False
