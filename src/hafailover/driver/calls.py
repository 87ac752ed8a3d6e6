"""The calls of the threaded driver: admission, waiting for the broker, flow control.

Every call that needs the network is admitted here (stop the world, F1), registered with
the sessions core when it waits for the broker, and finished here when the core says it
ended; waiting counts no time spent failing over against call_timeout. A mixin of
``Connection``: it holds no state of its own.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

from hafailover.core.failover import Admission, FailoverMachine
from hafailover.core.inflight import CallKind, SessionsCore
from hafailover.core.waits import CallBudget, Wait
from hafailover.destination import Destination
from hafailover.driver.completions import Callback, SendCompletion, Waiting
from hafailover.driver.waits import (
    Steps,
    Waiter,
    WouldBlock,
    attempts,
    blocking,
    budget_of,
)
from hafailover.errors import (
    AcknowledgeFailedError,
    CallTimeoutError,
    ConnectionClosedError,
    DisconnectedError,
    ErrorCode,
    HaFailoverError,
    NotConnectedError,
    StaleAcknowledgeError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from hafailover.protocols.base import Link
from hafailover.url import FailoverPolicy

if TYPE_CHECKING:
    from hafailover.driver.consumer import Consumer
    from hafailover.driver.producer import Producer

__all__ = ["Calls", "WatchedCondition", "WouldBlock", "error_for"]


class _Owner(Protocol):
    """The session a call belongs to."""

    session_id: int


_ERRORS_BY_CODE: Final[Mapping[ErrorCode, type[HaFailoverError]]] = {
    ErrorCode.DISCONNECT: DisconnectedError,
    ErrorCode.NOT_CONNECTED: NotConnectedError,
    ErrorCode.UNBLOCKED: UnblockedError,
    ErrorCode.CLOSED: ConnectionClosedError,
    ErrorCode.TRANSACTION_ROLLED_BACK: TransactionRolledBackError,
    ErrorCode.TRANSACTION_OUTCOME_UNKNOWN: TransactionOutcomeUnknownError,
    ErrorCode.ACKNOWLEDGE_FAILED: AcknowledgeFailedError,
    ErrorCode.ACKNOWLEDGE_STALE: StaleAcknowledgeError,
}


def error_for(code: ErrorCode, text: str) -> HaFailoverError:
    """The error class of a code the core decided."""
    return _ERRORS_BY_CODE.get(code, NotConnectedError)(text)


class WatchedCondition(threading.Condition):
    """The connection's condition. Every ``notify_all`` (a call ended, room in the window,
    a delivery buffered, the connection back or gone) is also told to ``watcher``, which
    must never block: how hafailover.aio's event loop learns to look again.

    It also runs the flushes of link outboxes queued while it was held (``flush_later``)
    as soon as the thread that queued them lets go of it: on leaving its outermost
    ``with``, or on waiting. So bytes are decided and queued under the lock and written
    outside it, by the thread that queued them, and a write that blocks never holds the
    lock (the reader still delivers; docs/core.md, "I/O")."""

    def __init__(self) -> None:
        lock = threading.RLock()
        super().__init__(lock)
        self.watcher: Callable[[], None] | None = None
        self._flushes: list[Callable[[], None]] = []  # queued by the thread holding it
        self._release = lock.release
        # The RLock's own helpers, which Condition uses too (not in the typeshed stubs).
        self._held: Callable[[], bool] = lock._is_owned  # type: ignore[attr-defined]
        self._release_all: Callable[[], Any] = lock._release_save  # type: ignore[attr-defined]
        # Condition.wait releases through this attribute: flush once released.
        self._release_save = self._release_and_flush

    def notify_all(self) -> None:
        super().notify_all()
        watcher = self.watcher
        if watcher is not None:
            watcher()

    def flush_later(self, flush: Callable[[], None]) -> None:
        """Run ``flush`` once this thread no longer holds the lock (now if it does not)."""
        if not self._held():
            flush()
        elif flush not in self._flushes:
            self._flushes.append(flush)

    def __exit__(self, *exc: object) -> None:
        flushes = self._flushes
        if not flushes:
            self._release()
            return
        self._flushes = []  # taken while still held: only this thread could have queued
        self._release()
        if self._held():  # a nested hold: the outermost one's release flushes
            self._flushes = flushes + self._flushes
            return
        for flush in flushes:
            flush()

    def _release_and_flush(self) -> Any:
        """``wait`` lets go of every hold at once: flush first thing after (its waiter is
        registered already, so no notify is missed meanwhile)."""
        flushes, self._flushes = self._flushes, []
        state = self._release_all()
        for flush in flushes:
            flush()
        return state


class Calls:
    """Admission, registration and waiting; mixed into ``Connection``, whose state it uses."""

    policy: FailoverPolicy
    _cond: WatchedCondition
    _machine: FailoverMachine
    _core: SessionsCore
    _link: Link | None
    _waiting: dict[int, Waiting]
    _closing: bool

    if TYPE_CHECKING:

        def link_lost(self, link: Link, reason: str) -> None: ...

    def link_output(self, link: Link, flush: Callable[[], None]) -> None:
        """``LinkEvents``: ``link`` queued bytes; they are written once this thread lets go
        of the lock (never under it: a peer that stops reading must not stop the reader)."""
        self._cond.flush_later(flush)

    def _io_failed(self, link: Link, exc: HaFailoverError) -> None:
        """A write failed: the link is dead even if its reader has not noticed yet."""
        if isinstance(exc, NotConnectedError | UnblockedError):
            self.link_lost(link, str(exc))

    def _admitted_link(self) -> Link | None:
        """Under the lock, for what is written only if it can go now (an acknowledge, a
        give-back, an unsubscribe) and never waits: the link when the machine admits
        calls (F1), else None."""
        admission, _ = self._machine.admit()
        return self._link if admission is Admission.PROCEED else None

    def _admits(self) -> bool:
        """Under the lock: whether the machine admits calls now (F1)."""
        return self._admitted_link() is not None

    def _check_open(self) -> None:
        if self._closing:
            raise ConnectionClosedError("the connection is closed")

    def _admit(self, deadline: float | None, *, block: bool = True) -> Link:
        """Under the lock: wait while failing over (F1); return the link to use.
        ``block=False``: raise WouldBlock instead of waiting."""
        return self._served(functools.partial(self._admit_now, deadline), block=block)

    def _served(self, attempt: Callable[[], Link], *, block: bool) -> Link:
        """Under the lock: ``attempt()`` until it does not raise WouldBlock, each wait it
        raises served on this thread (``block``), or raised to the caller to serve."""
        while True:
            try:
                return attempt()
            except WouldBlock as blocked:
                wait = blocked.wait
                if not block or wait is None:
                    raise
            Waiter(self, wait).block()

    def _admit_now(self, deadline: float | None) -> Link:
        """Under the lock: the link to use, or WouldBlock with the wait for the machine to
        admit calls again, bounded by ``deadline`` (call_failover_timeout)."""
        admission, code = self._machine.admit()
        if admission is Admission.PROCEED and self._link is not None:
            return self._link
        if admission is Admission.RAISE:
            assert code is not None
            raise error_for(code, f"the connection is {self._machine.state.value}")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise CallTimeoutError(
                f"the connection did not come back within call_failover_timeout "
                f"({self.policy.call_failover_timeout}s)"
            )
        raise WouldBlock(Wait(self._admission_changed, CallBudget(math.inf, remaining)))

    def _admission_changed(self) -> bool:
        """Under the lock: whether a call waiting to be admitted should look again."""
        admission, _ = self._machine.admit()
        return admission is not Admission.WAIT or self._closing

    def _failover_deadline(self) -> float | None:
        timeout = self.policy.call_failover_timeout
        return None if timeout is None else time.monotonic() + timeout

    def _call(
        self,
        kind: CallKind,
        completion: SendCompletion,
        session: _Owner | None,
        *,
        destination: Destination | None = None,
        producer: Producer | None = None,
        consumer: Consumer | None = None,
        resendable: bool = False,
        size: int = 0,
        commit: bool = False,
        tag: str = "",
        acked_id: str = "",
        subscription: str = "",
    ) -> int:
        """Under the lock: register a call that waits for the broker; returns its token.
        An acknowledge gives its ``subscription``, its delivery's ``tag`` and, when
        pipelined, ``acked_id``."""
        message = completion.message
        token = self._core.call(
            kind,
            None if session is None else session.session_id,
            resendable=resendable,
            size=size,
            message_id=message.ensure_message_id() if message is not None else acked_id,
            subscription=consumer.subscription if consumer is not None else subscription,
            tag=tag,
            commit=commit,
        )
        self._waiting[token] = Waiting(completion, destination, producer, consumer)
        return token

    def _written(self, token: int | None, link: Link, command_id: int, *, asked: bool) -> None:
        """Under the lock: the call's frame left on ``link``."""
        if token is not None:
            self._core.written(
                token, link=link.serial, command_id=command_id, windowed=link.windowed, asked=asked
            )

    def _end_calls(self, tokens: Iterable[int], error: HaFailoverError | None) -> list[Callback]:
        """Under the lock: finish the completions of calls the core ended; returns their
        callbacks to run outside it."""
        callbacks: list[Callback] = []
        for token in tokens:
            waiting = self._waiting.pop(token, None)
            if waiting is None:
                continue
            if waiting.producer is not None:
                waiting.producer._outstanding -= 1
            callbacks.extend(waiting.completion._finish(error))
        self._cond.notify_all()
        return callbacks

    def _abandon(self, token: int, error: HaFailoverError) -> list[Callback]:
        """Under the lock: a call ends without the broker (its write failed, locally)."""
        self._core.abandon(token)
        return self._end_calls((token,), error)

    def _ask_for_receipt(self) -> None:
        """Under the lock: someone waits for a cumulative confirmation that no written frame
        has asked for yet; write one frame that asks."""
        link = self._admitted_link()
        if link is None or not link.windowed:
            return
        if not self._core.sync_needed():
            return
        self._write_sync(link)

    def _write_sync(self, link: Link) -> None:
        """Under the lock: write one frame that asks the broker for a receipt covering every
        window command so far (a sync), as a waiting call would."""
        token = self._call(CallKind.SYNC, SendCompletion(self, None), None)
        try:
            link.sync(token)
        except HaFailoverError as exc:
            self._abandon(token, exc)
            self._io_failed(link, exc)
            return
        self._written(token, link, self._core.window.next_id - 1, asked=True)

    def _completion_wait(
        self, completion: SendCompletion, timeout: float | None = None
    ) -> Wait[SendCompletion]:
        """The wait for ``completion``: up to ``timeout`` (None: call_timeout) of time the
        connection is up, and call_failover_timeout of time failing over (F1)."""
        return Wait(
            completion.done,
            budget_of(self, timeout),
            completion,
            asks_receipt=True,
            timed_out=lambda: f"the broker did not answer within {self.policy.call_timeout}s",
        )

    def _completion_steps(self, completion: SendCompletion) -> Steps[None]:
        """``completion.result()`` as steps: its wait, then what it ended with."""
        if not completion.done():
            yield self._completion_wait(completion)
        error = completion.exception()
        if error is not None:
            raise error

    def _wait_done(self, completion: SendCompletion, timeout: float | None) -> None:
        """Wait for a completion; failover time does not count against call_timeout."""
        Waiter(self, self._completion_wait(completion, timeout)).block()

    def _wait_until(
        self, done: Callable[[], bool], timeout: float | None, timed_out: Callable[[], str]
    ) -> None:
        """Wait until ``done()`` for the broker's answers, asking for a receipt where one
        is missing; time spent failing over does not count against the timeout (F1), but
        against call_failover_timeout when it is set: a call already written when the
        connection was lost waits no longer for it to come back than a call not yet made."""
        wait: Wait[SendCompletion] = Wait(
            done, budget_of(self, timeout), asks_receipt=True, timed_out=timed_out
        )
        Waiter(self, wait).block()

    def _wait_window_room(self, size: int, deadline: float | None, *, block: bool = True) -> Link:
        """Under the lock: admission plus window flow control (F4). ``block=False``: raise
        WouldBlock instead of waiting."""
        return self._served(functools.partial(self._room_now, size, deadline), block=block)

    def _room_now(self, size: int, deadline: float | None) -> Link:
        """Under the lock: the link, admitted and with room for ``size`` bytes, or
        WouldBlock with the wait for it."""
        link = self._admit_now(deadline)
        if not self._core.has_room(size, windowed=link.windowed):
            raise WouldBlock(self._room_wait(size, windowed=link.windowed))
        return link

    def _room_wait(self, size: int, *, windowed: bool) -> Wait[SendCompletion]:
        """The wait for room in the confirmation window (or for the link to change): the
        broker confirming nothing for call_timeout ends it."""
        return Wait(
            lambda: not self._admits() or self._core.has_room(size, windowed=windowed),
            budget_of(self),
            timed_out=lambda: (
                f"the broker confirmed nothing for {self.policy.call_timeout}s while the "
                f"confirmation window ({self._core.window.size} bytes) was full"
            ),
        )

    def _admit_locked(self, deadline: float | None) -> Link:
        """The link to use, or WouldBlock (nothing done) while failing over (F1)."""
        with self._cond:
            return self._admit(deadline, block=False)

    def _subscribe_steps(self, consumer: Consumer) -> Steps[None]:
        """Start a consumer's subscription, waiting through failover (F1): a link whose
        calls block subscribes with the lock let go."""
        deadline = self._failover_deadline()
        while True:
            link = yield from attempts(functools.partial(self._admit_locked, deadline))
            try:
                token = consumer._subscribe_decided(link)
                if token is not None:
                    yield from blocking(
                        functools.partial(consumer._write_subscription, link, token)
                    )
            except HaFailoverError as exc:
                if isinstance(exc, NotConnectedError | UnblockedError):
                    self._io_failed(link, exc)
                    continue  # the failover recreates the link; subscribe on the new one
                with self._cond:
                    consumer.session._consumers.pop(consumer.subscription, None)
                if isinstance(exc, CallTimeoutError):
                    # The broker may still attach it: take back what was asked for.
                    with contextlib.suppress(HaFailoverError):
                        link.unsubscribe(consumer.subscription)
                raise
            return
