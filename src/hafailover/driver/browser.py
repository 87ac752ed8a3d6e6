"""A queue browser of the threaded driver (F11)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hafailover.destination import Destination
from hafailover.errors import BrowserInvalidatedError, NotConnectedError, UnblockedError
from hafailover.message import Message

if TYPE_CHECKING:
    from hafailover.driver.session import Session

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
        session = self.session
        session._check_open()
        connection = session.connection
        with connection._cond:
            link = connection._admit(connection._failover_deadline())
            subscription = f"browse-{next(connection._subscription_ids)}"
            self._buffer.clear()
            self._ended = self._invalid = False
            self._iterating = True
            connection._browsing[subscription] = self
            if not link.calls_block:
                link.browse(subscription, self.queue)
        try:
            if link.calls_block:
                link.browse(subscription, self.queue)
            while True:
                with connection._cond:
                    while not (self._buffer or self._ended or self._invalid):
                        session._check_open()
                        connection._cond.wait(1.0)
                    if self._invalid:
                        raise BrowserInvalidatedError(
                            f"the connection failed over while browsing {self.queue}; browse again"
                        )
                    if not self._buffer:
                        return
                    message = self._buffer.popleft()
                yield message
        except (NotConnectedError, UnblockedError) as exc:
            raise BrowserInvalidatedError(f"browsing {self.queue} failed: {exc}") from exc
        finally:
            with connection._cond:
                self._iterating = False
                connection._browsing.pop(subscription, None)

    def messages(self) -> list[Message]:
        """The whole snapshot as a list."""
        return list(self)

    def close(self) -> None:
        with self.session.connection._cond:
            self._iterating = False
