"""The one waiter: serves a ``Wait`` (hafailover.core.waits) on a thread, over the
connection's condition, or on an asyncio loop, with the same looks in between.

Each look, under the connection's lock: done? Then the time since the last look is counted
against the budget of the state it passed in (up: call_timeout; failing over:
call_failover_timeout, F1), the broker is asked for a receipt if the wait needs one, and an
expired budget raises CallTimeoutError. Otherwise the caller sleeps until the driver changes
something or the look's pause is over, whichever comes first: on the condition, or on the
loop (``hafailover.aio`` wakes it through the condition's watcher). Owns no state of the
connection; never writes except through ``ask_for_receipt``.

A call written as steps yields a ``Wait`` for each wait for the broker, and a ``Blocking``
for the socket I/O that has no form that does not block (an AMQP attach or declare, a
drain, joining a listener thread): a thread makes it where it stands, hafailover.aio on the loop's
default executor. A ``Blocking`` never waits for a message or for a failover: it is one
request and its answer, bounded by the link (call_timeout) and ended by the link's loss.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

from hafailover.core.waits import CallBudget, Expiry, Wait
from hafailover.errors import CallTimeoutError

if TYPE_CHECKING:
    from hafailover.driver.calls import Calls
    from hafailover.driver.completions import SendCompletion

__all__ = [
    "Blocking",
    "Steps",
    "Waiter",
    "WouldBlock",
    "attempts",
    "blocking",
    "budget_of",
    "run_steps",
]

T = TypeVar("T")


@attrs.frozen
class Blocking(Generic[T]):
    """A step that makes ``call()``, blocking I/O with no non-blocking form (an AMQP
    attach or declare, joining a listener thread): bounded by the link, never a wait for a message
    or for a failover. Whoever runs the steps makes it off its event loop, if it has one,
    and sends its result back in (or throws what it raised)."""

    call: Callable[[], T]


# A call that waits, written as the waits it needs: each Wait it yields is served by whoever
# runs it (``run_steps`` on a thread, hafailover.aio on a loop), and a CallTimeoutError met
# serving one is thrown back in where it was yielded; each Blocking it yields is made and its
# result sent back in. Yielded outside the connection's lock.
Steps = Generator[Wait[Any] | Blocking[Any], Any, T]


def blocking(call: Callable[[], T]) -> Generator[Blocking[T], Any, T]:
    """``result = yield from blocking(call)``: ``call()`` as a step, typed."""
    result: T = yield Blocking(call)
    return result


class WouldBlock(Exception):  # noqa: N818 - a signal between the driver and hafailover.aio, not an error
    """A call made not to block would have to wait: for the connection to come back (F1),
    for room in the confirmation window, or for a completion (a previous AUTO
    acknowledge). Nothing was sent; the caller serves ``wait`` its own way (with a
    ``Waiter``; None: until the driver changes something) and asks again. When the wait's
    budget runs out the caller passes the CallTimeoutError to ``timed_out``, if given,
    which raises what a blocking call would have raised then."""

    def __init__(
        self,
        wait: Wait[SendCompletion] | None = None,
        timed_out: Callable[[CallTimeoutError], None] | None = None,
    ) -> None:
        super().__init__("the call would block")
        self.wait = wait
        self.timed_out = timed_out


def budget_of(connection: Calls, timeout: float | None = None) -> CallBudget:
    """A new call's budget: ``timeout`` (None: the connection's call_timeout) and the
    connection's call_failover_timeout."""
    policy = connection.policy
    return CallBudget(
        policy.call_timeout if timeout is None else timeout, policy.call_failover_timeout
    )


class Waiter:
    """Serves one ``wait`` of ``connection``: ``block()`` on a thread, ``await
    until(changed)`` on a loop."""

    __slots__ = ("_budget", "_connection", "_last", "wait")

    def __init__(self, connection: Calls, wait: Wait[Any]) -> None:
        self._connection = connection
        self.wait = wait
        self._budget = wait.budget
        self._last = time.monotonic()

    def look(self) -> float | None:
        """None when the wait is over; else how long to sleep before looking again.
        Raises CallTimeoutError when a budget ran out."""
        connection = self._connection
        wait = self.wait
        with connection._cond:
            if wait.done():
                return None
            now = time.monotonic()
            self._budget = self._budget.spent(now - self._last, up=connection._admits())
            self._last = now
            if wait.asks_receipt:
                connection._ask_for_receipt()
            expiry = self._budget.expiry
            if expiry is Expiry.CALL_TIMEOUT:
                raise CallTimeoutError(wait.timed_out())
            if expiry is Expiry.CALL_FAILOVER_TIMEOUT:
                raise CallTimeoutError(
                    "the connection did not come back within call_failover_timeout "
                    f"({connection.policy.call_failover_timeout}s)"
                )
            return self._budget.pause

    def block(self) -> None:
        """On a thread: until the wait is over, asleep on the connection's condition."""
        cond = self._connection._cond
        with cond:
            while (pause := self.look()) is not None:
                cond.wait(pause)

    async def until(self, changed: Callable[[float], Awaitable[None]]) -> None:
        """On a loop: until the wait is over; ``changed(pause)`` returns when the driver
        changed something or ``pause`` seconds passed."""
        while (pause := self.look()) is not None:
            await changed(pause)


def attempts(attempt: Callable[[], T]) -> Steps[T]:
    """``attempt()`` until it does not raise WouldBlock, each wait it raises yielded (an
    attempt that raises it has changed nothing, so it is simply made again)."""
    while True:
        try:
            return attempt()
        except WouldBlock as blocked:
            wait = blocked.wait
            if wait is None:
                raise
        yield wait


def run_steps(connection: Calls, steps: Steps[T]) -> T:
    """On a thread: run ``steps``, each wait served by the Waiter on the condition, each
    blocking call made here."""
    sent: Any = None
    raised: BaseException | None = None
    while True:
        try:
            step = steps.send(sent) if raised is None else steps.throw(raised)
        except StopIteration as finished:
            result: T = finished.value
            return result
        sent = raised = None
        try:
            if isinstance(step, Blocking):
                sent = step.call()
            else:
                Waiter(connection, step).block()
        except CallTimeoutError as exc:
            raised = exc
        except Exception as exc:  # a blocking call's failure is the steps' to handle
            if not isinstance(step, Blocking):
                raise
            raised = exc
