"""The reconnect schedule: which broker each attempt goes to, and how long to wait first.

This module owns the retry policy of DESIGN.md section 3 (retry_interval,
retry_interval_multiplier, max_retry_interval, retry_jitter, reconnect_attempts,
initial_connect_attempts, failover_method, topology) and is the only module
that imports tenacity. It never sleeps or reads a clock of its own: the caller
passes ``sleep`` (the driver's is interruptible by close()) and a random source,
so tests run the whole schedule instantly and deterministically.

An attempt is one connection try to one broker. The first attempt after a loss
is made at once; before attempt k >= 2 the schedule waits
``min(retry_interval * multiplier ** (k - 2), max_retry_interval)``, spread by
+/- retry_jitter of itself (the Artemis formula, plus jitter).

Broker order (Qpid failover methods):
- roundrobin: start with the broker the connection was on (a transient blip can
  then reattach to the same server), then the next ones in list order, cycling;
- singlebroker: only the broker the connection was on;
- random: each pass over the list in a fresh random order;
- nofailover: the first connection like roundrobin, and no reconnect at all;
- priority: every reconnect starts with the first broker (the preferred one), then the
  next ones in list order; while connected elsewhere, the driver probes the preferred
  broker every failback_interval and ``failback_due`` says when to move back.

A broker can redirect the client (AMQP ``amqp:connection:redirect``): the next attempt
goes to the address it named, once, before the method's order (``redirect``).

What an announced failover list does to the known brokers is the policy's
failover_server_list (``learn_topology``): add (the URL's brokers, then the announced
ones), replace (the broker connected to, then the announced ones) or ignore.

The first connection (F12) goes to the first broker and, by default, nowhere
else: failing over to a backup needs one successful connection first, unless
initial_connect_attempts allows more attempts, which then walk the list.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Final, TypeVar

import attrs
import tenacity

from hafailover.errors import ConfigurationError, SecurityError
from hafailover.url import BrokerAddress, FailoverMethod, FailoverPolicy, ServerListAction

__all__ = [
    "Attempt",
    "AttemptsExhausted",
    "BrokerRotation",
    "ReconnectCancelled",
    "ReconnectSchedule",
]

T = TypeVar("T")


@attrs.frozen
class Attempt:
    """One planned connection attempt."""

    number: int  # 1-based within this reconnect (or initial connect)
    broker: BrokerAddress
    delay: float  # seconds waited before making it


class AttemptsExhausted(Exception):  # noqa: N818 - an outcome, not a failure of this module
    """Every allowed attempt failed; ``last_error`` is the final attempt's error."""

    def __init__(self, attempts: int, last_error: BaseException | None) -> None:
        super().__init__(f"gave up after {attempts} attempt(s): {last_error!r}")
        self.attempts = attempts
        self.last_error = last_error


class ReconnectCancelled(Exception):  # noqa: N818 - an outcome, not a failure of this module
    """The application closed the connection while reconnecting."""


class BrokerRotation:
    """The known brokers and the order attempts walk them in.

    Brokers come from the URL and from what the broker announces (F12), as
    failover_server_list says: with ``add`` the latest announcement replaces the
    previously learned brokers and the URL's brokers are always kept; with ``replace``
    the list becomes the broker the announcement came from and the announced ones.
    """

    def __init__(self, policy: FailoverPolicy, rng: random.Random) -> None:
        self._policy = policy
        self._rng = rng
        self._learned: tuple[BrokerAddress, ...] = ()
        self._replaced: tuple[BrokerAddress, ...] | None = None  # the list, once replaced
        self._current = policy.brokers[0]
        self._redirect: BrokerAddress | None = None

    @property
    def brokers(self) -> tuple[BrokerAddress, ...]:
        if self._replaced is not None:
            return self._replaced
        known = {b.endpoint for b in self._policy.brokers}
        return self._policy.brokers + tuple(b for b in self._learned if b.endpoint not in known)

    @property
    def preferred(self) -> BrokerAddress | None:
        """With failover_method=priority, the broker to move back to; else None."""
        if self._policy.failover_method is FailoverMethod.PRIORITY:
            return self._policy.brokers[0]
        return None

    def failback_due(self, connected: BrokerAddress) -> bool:
        """Is a connection to ``connected`` away from the preferred broker (so the driver
        probes the preferred one and moves back once it answers)?"""
        preferred = self.preferred
        return preferred is not None and connected.endpoint != preferred.endpoint

    def redirect(self, host: str, port: int | None) -> BrokerAddress:
        """The broker redirected the client to ``host``:``port`` (the scheme's default port
        when None): the next attempt goes there, once, with the current broker's scheme and
        credentials."""
        template = self._current
        self._redirect = attrs.evolve(
            template, host=host, port=template.default_port if port is None else port
        )
        return self._redirect

    @property
    def current(self) -> BrokerAddress:
        return self._current

    def connected_to(self, broker: BrokerAddress) -> None:
        """Remember the broker a connection succeeded on: reconnects start there."""
        self._current = broker

    def learn_topology(self, endpoints: Sequence[tuple[str, int]]) -> bool:
        """Take the (host, port) pairs a broker announced; return whether anything changed.

        Announced brokers use the scheme and credentials of the current broker:
        an announcement says where the other nodes are, not how to log in.
        """
        action = self._policy.server_list_action
        if action is ServerListAction.IGNORE:
            return False
        template = self._current
        learned = tuple(
            attrs.evolve(template, host=host, port=port) for host, port in dict.fromkeys(endpoints)
        )
        if action is ServerListAction.REPLACE:
            replaced = (template, *(b for b in learned if b.endpoint != template.endpoint))
            if replaced == self._replaced:
                return False
            self._replaced = replaced
            return True
        if learned == self._learned:
            return False
        self._learned = learned
        return True

    def order(self, *, initial: bool) -> Iterator[BrokerAddress]:
        """An endless sequence of brokers, one per attempt; a redirect goes first, once."""
        for broker in self._method_order(initial=initial):
            redirect, self._redirect = self._redirect, None
            if redirect is not None:
                yield redirect
            yield broker

    def _method_order(self, *, initial: bool) -> Iterator[BrokerAddress]:
        brokers = self.brokers
        method = self._policy.failover_method
        if initial:
            if method is FailoverMethod.SINGLEBROKER:
                while True:
                    yield brokers[0]
            yield from self._cycle(brokers, 0)
        if method is FailoverMethod.SINGLEBROKER:
            while True:
                yield self._current
        if method is FailoverMethod.RANDOM:
            while True:
                shuffled = list(self.brokers)
                self._rng.shuffle(shuffled)
                yield from shuffled
        if method is FailoverMethod.PRIORITY:
            yield from self._cycle(brokers, 0)
        start = next((i for i, b in enumerate(brokers) if b.endpoint == self._current.endpoint), 0)
        yield from self._cycle(brokers, start)

    @staticmethod
    def _cycle(brokers: tuple[BrokerAddress, ...], start: int) -> Iterator[BrokerAddress]:
        index = start
        while True:
            yield brokers[index % len(brokers)]
            index += 1


class _ProportionalJitter(tenacity.wait.wait_base):
    """Spread another wait by +/- a fraction of itself, with an injected random source."""

    def __init__(self, inner: tenacity.wait.wait_base, jitter: float, rng: random.Random) -> None:
        self._inner = inner
        self._jitter = jitter
        self._rng = rng

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        delay = float(self._inner(retry_state))
        if not self._jitter:
            return delay
        return max(0.0, delay * (1.0 + self._rng.uniform(-self._jitter, self._jitter)))


class _StopWhen(tenacity.stop.stop_base):
    def __init__(self, predicate: Callable[[], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._predicate()


# What no further attempt can fix: the broker refused the credentials, or the
# configuration is wrong. Everything else an attempt raises is retried.
_NOT_RETRYABLE: Final = (ConfigurationError, SecurityError)


class ReconnectSchedule:
    """Runs connection attempts by the policy, with injected sleep and randomness."""

    def __init__(self, policy: FailoverPolicy, *, rng: random.Random | None = None) -> None:
        self.policy = policy
        self._rng = rng if rng is not None else random.Random()
        self.rotation = BrokerRotation(policy, self._rng)
        self._wait = _ProportionalJitter(
            tenacity.wait_exponential(
                multiplier=policy.retry_interval,
                exp_base=policy.retry_interval_multiplier,
                min=0,
                max=policy.max_retry_interval,
            ),
            policy.retry_jitter,
            self._rng,
        )

    def attempts_allowed(self, *, initial: bool) -> int:
        """How many attempts one connect (initial) or reconnect may make; -1 is forever."""
        if initial:
            return self.policy.initial_connect_attempts
        return self.policy.effective_reconnect_attempts

    def delay_before(self, attempt_number: int) -> float:
        """Seconds to wait before attempt ``attempt_number`` (1-based)."""
        if attempt_number <= 1:
            return 0.0
        state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt_number - 1
        return self._wait(state)

    def plan(self, *, initial: bool, limit: int) -> list[Attempt]:
        """The first ``limit`` attempts as they would be made (for reports and tests)."""
        allowed = self.attempts_allowed(initial=initial)
        count = limit if allowed == -1 else min(limit, allowed)
        order = self.rotation.order(initial=initial)
        return [Attempt(n, next(order), self.delay_before(n)) for n in range(1, count + 1)]

    def run(
        self,
        connect: Callable[[BrokerAddress, int], T],
        *,
        initial: bool,
        sleep: Callable[[float], None],
        cancelled: Callable[[], bool],
        on_failure: Callable[[Attempt, BaseException], None] | None = None,
    ) -> T:
        """Call ``connect(broker, attempt_number)`` until it returns.

        Raises AttemptsExhausted when the allowed attempts all failed and
        ReconnectCancelled when ``cancelled()`` turns true. Only errors that no retry
        can fix propagate at once: refused credentials (SecurityError) and a
        configuration the broker cannot take (ConfigurationError). Any other failure
        of an attempt, including a local one (an illegal state met while connecting,
        a bug), is one failed attempt: giving up on it would end reconnection for a
        cause the next attempt may not meet.
        """
        allowed = self.attempts_allowed(initial=initial)
        if allowed == 0:
            raise AttemptsExhausted(0, None)
        stop: tenacity.stop.stop_base = _StopWhen(cancelled)
        if allowed != -1:
            stop = stop | tenacity.stop_after_attempt(allowed)
        order = self.rotation.order(initial=initial)
        current: list[Attempt] = []
        waited = [0.0]  # what tenacity actually slept before the coming attempt

        def sleep_and_note(seconds: float) -> None:
            waited[0] = seconds
            sleep(seconds)

        def after(retry_state: tenacity.RetryCallState) -> None:
            outcome = retry_state.outcome
            if on_failure is not None and outcome is not None and outcome.failed:
                error = outcome.exception()
                assert error is not None
                on_failure(current[-1], error)

        retrying = tenacity.Retrying(
            stop=stop,
            wait=self._wait,
            sleep=sleep_and_note,
            retry=tenacity.retry_if_not_exception_type(_NOT_RETRYABLE),
            after=after,
            reraise=False,
        )
        try:
            for attempt in retrying:
                if cancelled():
                    raise ReconnectCancelled()
                number = attempt.retry_state.attempt_number
                broker = next(order)
                current.append(Attempt(number, broker, waited[0]))
                waited[0] = 0.0
                with attempt:
                    result = connect(broker, number)
                if not attempt.retry_state.outcome or not attempt.retry_state.outcome.failed:
                    self.rotation.connected_to(broker)
                    return result
        except tenacity.RetryError as exc:
            if cancelled():
                raise ReconnectCancelled() from None
            last = exc.last_attempt
            raise AttemptsExhausted(
                last.attempt_number, last.exception() if last.failed else None
            ) from None
        raise AssertionError("tenacity ended without an outcome")  # pragma: no cover
