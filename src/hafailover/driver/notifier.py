"""The listener thread: exception listeners, lifecycle events and asynchronous errors are
told here, in order, never on a protocol or application thread (F10).

A listener that raises is logged and the thread goes on.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Notifier"]

log = logging.getLogger("hafailover")


class Notifier:
    """One daemon thread, started on the first notice, ended by ``stop``."""

    def __init__(self) -> None:
        self._notices: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def tell(self, listeners: list[Callable[[Any], None]], value: object) -> None:
        """Call each listener with ``value`` on the listener thread."""
        if listeners:
            self.post(lambda: _call_each(listeners, value))

    def post(self, action: Callable[[], None]) -> None:
        with self._cond:
            self._notices.append(action)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="hafailover-listener", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Tell what is queued, then end the thread (not waited for from itself)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._notices:
                    if self._stopping:
                        return
                    self._cond.wait(0.5)
                action = self._notices.popleft()
            action()


def _call_each(listeners: list[Callable[[Any], None]], value: object) -> None:
    for listener in listeners:
        call_listener(listener, value)


def call_listener(listener: Callable[[Any], None], value: object) -> None:
    try:
        listener(value)
    except Exception:
        log.exception("a connection listener raised (ignored)")
