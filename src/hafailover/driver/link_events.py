"""What a link tells the driver: deliveries, answers, confirmations, errors and its loss.

Called on whatever thread noticed it (a link's reader, a heartbeat, a write that failed on
an application's thread); each takes the connection's lock, hands the event to the pure
parts, and runs what they decided once the lock is released. A mixin of ``Connection``: it
holds no state of its own. An event of a link the connection has replaced is ignored here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from hafailover.core.failover import Effect, FailoverMachine, Lost
from hafailover.core.inflight import SessionsCore
from hafailover.driver.calls import WatchedCondition
from hafailover.driver.completions import Callback, Waiting
from hafailover.driver.events import ConnectionEvent, FailureDetected
from hafailover.errors import HaFailoverError, ProtocolError
from hafailover.message import Message
from hafailover.protocols.base import Link

if TYPE_CHECKING:
    from hafailover.driver.browser import Browser
    from hafailover.driver.session import Session

__all__ = ["Deferred", "LinkEventHandlers", "run_deferred"]

log = logging.getLogger("hafailover")

# What is done once the lock is released: blocking I/O, a thread to start, or a completion's
# callback with its completion.
Deferred = Callable[[], None] | Callback


class LinkEventHandlers:
    """The ``LinkEvents`` of ``Connection``, whose state they use."""

    _cond: WatchedCondition
    _machine: FailoverMachine
    _core: SessionsCore
    _link: Link | None
    _opening: Link | None
    _early: list[tuple[str, str, Message]]
    _waiting: dict[int, Waiting]
    _sessions: dict[int, Session]
    _browsing: dict[str, Browser]
    _closing: bool
    _lost_at: float
    _lost_reason: str
    _lost_from: str

    if TYPE_CHECKING:

        def _end_calls(
            self, tokens: Iterable[int], error: HaFailoverError | None
        ) -> list[Callback]: ...

        def _apply(self, effects: list[Effect]) -> list[Deferred]: ...

        def _notify_all(
            self, event: ConnectionEvent | None, error: HaFailoverError | None
        ) -> None: ...

    def link_message(self, link: Any, subscription: str, tag: str, message: Message) -> None:
        with self._cond:
            if link is not self._link:
                if link is self._opening:
                    # Before the attempt made it the connection's: kept for _prepare.
                    self._early.append((subscription, tag, message))
                return  # else a late delivery of a link replaced by a failover
            self._route_message(subscription, tag, message)

    def _take_early_deliveries(self, link: Link) -> None:
        """Under the lock, once ``link`` is the connection's and the failover rules are
        applied: route what it delivered while it was still being opened."""
        early = self._early if link is self._opening else []
        self._opening, self._early = None, []
        for subscription, tag, message in early:
            self._route_message(subscription, tag, message)

    def _route_message(self, subscription: str, tag: str, message: Message) -> None:
        """Under the lock: a delivery of the current link to its browser or consumer."""
        browser = self._browsing.get(subscription)
        if browser is not None:
            browser._buffer.append(message)
            self._cond.notify_all()
            return
        for session in self._sessions.values():
            consumer = session._consumers.get(subscription)
            if consumer is not None:
                consumer._arrived(tag, message)
                return

    def link_completed(self, link: Any, token: int, error: HaFailoverError | None) -> None:
        with self._cond:
            waiting = self._waiting.get(token)
            answer = self._core.answered(token, error)
            callbacks = self._end_calls(answer.done, None)
            if answer.failed:
                callbacks.extend(self._end_calls(answer.failed, error))
            if answer.refused_subscriptions and waiting is not None and waiting.consumer:
                # The broker refused the subscription: the consumer is gone, so a
                # reconnect does not ask again (and get refused again).
                consumer = waiting.consumer
                consumer._closed = True
                consumer.session._consumers.pop(consumer.subscription, None)
        run_deferred(callbacks)

    def link_confirmed(self, link: Any, upto: int) -> None:
        with self._cond:
            current = self._link
            if current is None or link is not current or not current.windowed:
                return
            if self._core.confirmed_upto(upto):
                self._cond.notify_all()  # room in the window for blocked senders

    def link_browse_end(self, link: Any, subscription: str) -> None:
        with self._cond:
            browser = self._browsing.get(subscription)
            if browser is not None and link is self._link:
                browser._ended = True
                self._cond.notify_all()

    def link_error(self, link: Any, error: ProtocolError) -> None:
        log.warning("%s", error)
        self._notify_all(None, error)

    def link_lost(self, link: Any, reason: str) -> None:
        """The reader, a heartbeat or a failed write noticed ``link`` is gone."""
        with self._cond:
            if self._closing:
                return
            from_broker = link.broker.redacted()
            effects = self._machine.handle(Lost(reason, link=link.serial))
            if effects:
                # The first notice of the current link's loss (the machine ignores the rest).
                self._lost_at = time.monotonic()
                self._lost_reason = reason
                self._lost_from = from_broker
                log.warning("connection to %s lost: %s; failing over", from_broker, reason)
                self._notify_all(FailureDetected(from_broker, reason), None)
            after = self._apply(effects)
        run_deferred(after)


def run_deferred(actions: Iterable[Deferred]) -> None:
    """Outside the lock: run deferred I/O and completion callbacks (a callback that raises
    is logged, never fatal)."""
    for action in actions:
        if isinstance(action, tuple):
            callback, completion = action
            try:
                callback(completion)
            except Exception:
                log.exception("a send completion callback raised (ignored)")
        else:
            action()
