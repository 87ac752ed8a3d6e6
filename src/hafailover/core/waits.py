"""A call waiting for the broker, as a value: what ends it, which completion it waits for,
and how long it may wait (call_timeout and call_failover_timeout together).

Theory of operation: a call that cannot finish now (its answer has not come, the connection
is failing over, the confirmation window is full) does not wait by itself. It hands its
caller a ``Wait``; one waiter (``hafailover.driver.waits``) serves it, on a thread over the
connection's condition or on an asyncio loop, and both ask this module the same questions:
is it done, has its time run out, how long until it looks again. So ``call_timeout`` and
``call_failover_timeout`` mean the same whatever waits.

``CallBudget`` is the rule (F1): time the connection is up counts against ``call_timeout``;
time spent failing over does not, and counts against ``call_failover_timeout`` instead when
one is set, for a call already written as for a call not yet admitted. Pure: the time that
passed and whether the connection was up are told, never read from a clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Final, Generic, TypeVar

import attrs

__all__ = ["LOOK_AGAIN", "CallBudget", "Expiry", "Wait"]

# The longest a waiter sleeps before it looks again, so a change it is not told of (the
# connection going down or coming back, which moves time between the two budgets) shows.
LOOK_AGAIN: Final = 0.5

C = TypeVar("C")


class Expiry(enum.Enum):
    """Which budget ran out."""

    CALL_TIMEOUT = "call_timeout"
    CALL_FAILOVER_TIMEOUT = "call_failover_timeout"


def _seconds(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"a wait's budget is a number of seconds, not {value!r}")
    return float(value)


def _optional_seconds(value: float | None) -> float | None:
    return None if value is None else _seconds(value)


@attrs.frozen
class CallBudget:
    """What is left of a call's two timeouts. ``failover_left`` None: failing over may take
    as long as it takes (no call_failover_timeout). ``math.inf`` as ``left``: no call
    timeout (a call waiting only to be admitted)."""

    left: float = attrs.field(converter=_seconds)
    failover_left: float | None = attrs.field(default=None, converter=_optional_seconds)

    def spent(self, seconds: float, *, up: bool) -> CallBudget:
        """``seconds`` waited, the connection ``up`` (admitting calls) or failing over."""
        if seconds <= 0:
            return self
        if up:
            return attrs.evolve(self, left=self.left - seconds)
        if self.failover_left is None:
            return self
        return attrs.evolve(self, failover_left=self.failover_left - seconds)

    @property
    def expiry(self) -> Expiry | None:
        """The budget that ran out, if one did (the call's own first)."""
        if self.left <= 0:
            return Expiry.CALL_TIMEOUT
        if self.failover_left is not None and self.failover_left <= 0:
            return Expiry.CALL_FAILOVER_TIMEOUT
        return None

    @property
    def pause(self) -> float:
        """How long to wait before looking again, if nothing changes meanwhile."""
        if self.failover_left is None:
            return max(0.0, min(self.left, LOOK_AGAIN))
        return max(0.0, min(self.left, self.failover_left, LOOK_AGAIN))


def _never_times_out() -> str:
    return "the call timed out"


@attrs.frozen(eq=False)
class Wait(Generic[C]):
    """A call that waits: until ``done()`` (asked under the connection's lock), for
    ``completion`` when it waits for one call's answer (None: a change of state, such as
    the connection coming back or room in the window), within ``budget``.
    ``asks_receipt``: while it waits, the broker is asked to confirm what no written frame
    asked for yet (a pipelined send or acknowledge). ``timed_out()``: what the call says
    when its own timeout runs out."""

    done: Callable[[], bool]
    budget: CallBudget
    completion: C | None = None
    asks_receipt: bool = False
    timed_out: Callable[[], str] = _never_times_out
