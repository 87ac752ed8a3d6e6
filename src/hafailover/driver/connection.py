"""The threaded driver's connection: the lock, the threads and the executor of effects.

Theory of operation
-------------------
A ``Connection`` is one logical connection that outlives any number of broker connections
("links", ``protocols/base.py``). Two pure parts decide everything: the ``FailoverMachine``
(``core/failover.py``: connected, failing over, restoring, failed, closed) and the
``SessionsCore`` (``core/inflight.py``: every call waiting for the broker, the confirmation
window, each session's acknowledge and transaction rules). This module carries out what
they decide, and is the only place with locks, threads and clocks.

- One condition (``_cond``, over a re-entrant lock) guards the connection's state: the two
  pure parts, the current link, and every session's and consumer's buffers. Decisions are
  made under it; frames are queued in the link's outbox under it (so command ids follow
  wire order) and written once the thread lets go of it, under the outbox's own write
  lock (``protocols/outbox.py``, docs/core.md "Decide under the lock, write outside it");
  calls that block on the broker (the links whose ``calls_block`` is set) are made
  outside it.
- Stop the world (F1): every call that needs the network first asks ``machine.admit()``
  and waits on the condition while the connection fails over or is being restored.
- Any notice of a lost link, from the reader, a heartbeat, or a failed write on an
  application's thread, is the same event, ``Lost(link)``; the machine counts the first
  notice about the current link and ignores the rest, and remembers one about a link an
  attempt is opening (that attempt then fails instead of restoring a dead link). The
  first starts one reconnect thread that runs the ``ReconnectSchedule``; however it ends
  short of success, it tells the machine ``Exhausted`` (F2, F10).
- Each attempt opens a link; the sessions core plans the failover (``FailoverPlan``: what
  to replay, resend, complete and release; what each session's rules did), the machine
  hands the plan back as ``ReattachSessions``/``RecreateSessions``, this module writes it
  on the new link, then reports ``Restored``; only then are the calls the plan gave up
  released (F3), waiting calls woken (F1) and the listener told (F10).
- Exception listeners and lifecycle events run on one listener thread (``notifier.py``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from hafailover.ack_modes import AckMode
from hafailover.core.failover import (
    CancelReconnect,
    CloseRequested,
    CloseTransport,
    Connected,
    Effect,
    Exhausted,
    FailoverMachine,
    FailoverState,
    FailPendingCalls,
    InvalidateBrowsers,
    LearnTopology,
    NotifyListener,
    PreferredAnswered,
    ReattachSessions,
    RecreateSessions,
    Restored,
    StartReconnect,
    TopologyAnnounced,
    UnblockPendingCalls,
    WakeBlockedCalls,
)
from hafailover.core.inflight import FailoverPlan, SessionsCore
from hafailover.core.report import FailoverReport, SessionFailover
from hafailover.core.schedule import (
    Attempt,
    AttemptsExhausted,
    ReconnectCancelled,
    ReconnectSchedule,
)
from hafailover.core.window import ConfirmationWindow
from hafailover.destination import Destination
from hafailover.driver import tracing
from hafailover.driver.calls import Calls, WatchedCondition, error_for
from hafailover.driver.completions import Callback, Waiting
from hafailover.driver.events import (
    ConnectionEvent,
    ConnectionStatistics,
    FailoverCompleted,
    FailoverFailed,
)
from hafailover.driver.link_events import Deferred, LinkEventHandlers, run_deferred
from hafailover.driver.notifier import Notifier, call_listener
from hafailover.driver.waits import Steps, attempts, run_steps
from hafailover.errors import (
    ConfigurationError,
    ConnectionClosedError,
    DisconnectedError,
    ErrorCode,
    FailoverNotice,
    HaFailoverError,
    NotConnectedError,
    RemoteError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.protocols.base import Link, LinkFactory, Opened
from hafailover.protocols.factory import make_link
from hafailover.url import BrokerAddress, FailoverPolicy, parse_url

if TYPE_CHECKING:
    from hafailover.driver.browser import Browser
    from hafailover.driver.consumer import Consumer
    from hafailover.driver.session import Session

__all__ = ["Connection", "connect", "error_for"]

log = logging.getLogger("hafailover")


def connect(
    url: str | FailoverPolicy,
    *,
    user: str | None = None,
    password: str | None = None,
    exception_listener: Callable[[HaFailoverError], None] | None = None,
    link_factory: LinkFactory = make_link,
) -> Connection:
    """Open a connection from a URL (``failover:(stomp://h1:61613,...)?options``, DESIGN 3).

    Blocks until the first connection succeeds or ``initial_connect_attempts`` are used up
    (F12). ``user``/``password`` apply to every broker that does not name its own.
    ``link_factory`` makes the link to one broker (the URL's protocol by default); the
    driver's tests give a scripted one."""
    policy = url if isinstance(url, FailoverPolicy) else parse_url(url)
    if user is not None or password is not None:
        policy = attrs.evolve(
            policy,
            brokers=tuple(
                b
                if b.user is not None
                else attrs.evolve(
                    b, user=user, password=password if password is not None else b.password
                )
                for b in policy.brokers
            ),
        )
    connection = Connection(
        policy, exception_listener=exception_listener, link_factory=link_factory
    )
    connection._open()
    return connection


class Connection(Calls, LinkEventHandlers):
    """A connection that keeps working through failover. Use ``connect()`` to make one."""

    def __init__(
        self,
        policy: FailoverPolicy,
        *,
        exception_listener: Callable[[HaFailoverError], None] | None = None,
        rng: random.Random | None = None,
        link_factory: LinkFactory = make_link,
    ) -> None:
        self.policy = policy
        self._link_factory = link_factory
        self._cond = WatchedCondition()
        self._machine = FailoverMachine(reconnect_enabled=policy.reconnect_attempts != 0)
        self._core = SessionsCore(policy.confirmation_window_size)
        self._window = self._core.window
        self._schedule = ReconnectSchedule(policy, rng=rng)
        self._link: Link | None = None
        # The link an attempt is opening, and what it delivered before it became the
        # connection's (a reattached broker resends deliveries right after CONNECTED).
        self._opening: Link | None = None
        self._early: list[tuple[str, str, Message]] = []
        self._session_token: str | None = None  # the broker's session id, for reattach
        self._waiting: dict[int, Waiting] = {}  # by the core's token
        self._sessions: dict[int, Session] = {}
        self._browsing: dict[str, Browser] = {}  # browse subscription -> its browser
        self._session_ids = itertools.count(1)
        self._subscription_ids = itertools.count(1)
        self._started = False
        self._closing = False
        self._cancel = threading.Event()
        # Failover bookkeeping for the report.
        self._lost_at = 0.0
        self._lost_reason = ""
        self._lost_from = ""
        self._attempts = 0
        self._session_parts: tuple[SessionFailover, ...] = ()
        self._degraded: tuple[str, ...] = ()
        self._detects_duplicates = False  # the connected broker's duplicate detection
        # The broker connected to (or last, or the first to try), as tracing names it.
        first = policy.brokers[0]
        self._peer = tracing.Peer(first.protocol, "", first.host, first.port)
        self._reports: list[FailoverReport] = []
        self._reattached = 0
        self._in_doubt = 0
        self._received = 0
        self._duplicates_dropped = 0  # by consumers' duplicate windows (consumer_dedup)
        self._exception_listener = exception_listener
        self._event_listeners: list[Callable[[ConnectionEvent], None]] = []
        self._notifier = Notifier()

    # --- public -----------------------------------------------------------------------------

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def broker(self) -> str | None:
        """The broker connected to now (redacted), None while failing over."""
        with self._cond:
            link = self._link
            return link.broker.redacted() if link is not None and self._machine.is_up else None

    @property
    def broker_detects_duplicates(self) -> bool:
        """Whether sends carry duplicate ids (the URL's duplicate_detection) and the broker
        connected to drops a copy by its id: then resending after an unknown outcome, or
        retrying a transaction with the same messages, stores each message once (F13)."""
        with self._cond:
            return self.policy.duplicate_detection and self._detects_duplicates

    @property
    def state(self) -> str:
        return self._machine.state.value

    @property
    def reports(self) -> tuple[FailoverReport, ...]:
        """Every failover's report, oldest first."""
        with self._cond:
            return tuple(self._reports)

    def statistics(self) -> ConnectionStatistics:
        with self._cond:
            core = self._core
            return ConnectionStatistics(
                sent=core.sent,
                confirmed=core.confirmed,
                failovers=self._machine.failovers_completed,
                reattached=self._reattached,
                replayed=core.replayed,
                resent=core.resent,
                in_doubt=self._in_doubt,
                received=self._received,
                duplicates_dropped=self._duplicates_dropped,
            )

    def set_exception_listener(self, listener: Callable[[HaFailoverError], None] | None) -> None:
        """Called once per connection failure (F10): FailoverNotice (code FAILOVER) when
        failover succeeded, DisconnectedError (code DISCONNECT) when it gave up, and
        asynchronous errors the broker reported."""
        self._exception_listener = listener

    def add_event_listener(self, listener: Callable[[ConnectionEvent], None]) -> None:
        """Lifecycle events for applications and metrics (failure, failover done / failed)."""
        with self._cond:
            self._event_listeners.append(listener)

    def create_session(self, ack_mode: AckMode = AckMode.AUTO) -> Session:
        """A session; ``AckMode.SESSION_TRANSACTED`` for a transacted one."""
        return run_steps(self, self._session_steps(ack_mode))

    def _session_steps(self, ack_mode: AckMode) -> Steps[Session]:
        if not isinstance(ack_mode, AckMode):
            raise ConfigurationError(f"ack_mode must be an AckMode, not {ack_mode!r}")
        deadline = self._failover_deadline()
        return (yield from attempts(functools.partial(self._new_session, ack_mode, deadline)))

    def _new_session(self, ack_mode: AckMode, deadline: float | None) -> Session:
        """A new session, or WouldBlock (nothing done) while failing over (F1)."""
        from hafailover.driver.session import Session

        with self._cond:
            self._check_open()
            self._admit(deadline, block=False)
            session_id = next(self._session_ids)
            session = Session(self, session_id, ack_mode, self._core.open_session)
            self._sessions[session_id] = session
            return session

    def start(self) -> None:
        """Start (or resume) delivery to consumers."""
        with self._cond:
            self._check_open()
            self._started = True
            self._cond.notify_all()

    def stop(self) -> None:
        """Pause delivery; receive() waits and listeners are not called until start()."""
        with self._cond:
            self._started = False

    def close(self) -> None:
        """Close every session and the connection; release every blocked call at once (F2)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            sessions = list(self._sessions.values())
            for session in sessions:
                session._closed = True
            link = self._link
            after = self._apply(self._machine.handle(CloseRequested()))
        self._cancel.set()
        run_deferred(after)
        if link is not None:
            with contextlib.suppress(Exception):
                link.close()
        for session in sessions:
            session._join()
            for consumer in list(session._consumers.values()):
                consumer._release_dedup_file(closing_all=True)
        self._notifier.stop()

    # --- opening and failing over -----------------------------------------------------------

    def _run_schedule(self, *, initial: bool) -> None:
        """Make attempts until one connects (the schedule's rules: F2, F12)."""
        self._schedule.run(
            lambda broker, n: self._attempt(broker, n, initial=initial),
            initial=initial,
            sleep=self._cancellable_sleep,
            cancelled=self._reconnect_over,
            on_failure=self._attempt_failed,
        )

    def _reconnect_over(self) -> bool:
        """close() was called, or the machine ended (no attempt can bring it back)."""
        if self._cancel.is_set():
            return True
        with self._cond:
            return self._machine.finished

    def _open(self) -> None:
        try:
            self._run_schedule(initial=True)
        except AttemptsExhausted as exc:
            with self._cond:
                self._apply(self._machine.handle(Exhausted(exc.attempts, str(exc.last_error))))
            raise NotConnectedError(
                f"could not connect to {', '.join(b.redacted() for b in self.policy.brokers)} "
                f"after {exc.attempts} attempt(s): {exc.last_error}"
            ) from exc.last_error
        except ReconnectCancelled:
            raise ConnectionClosedError("the connection was closed while connecting") from None

    def _attempt(self, broker: Any, number: int, *, initial: bool) -> None:
        """One connection attempt: open, then carry out the failover's plan; raise if any
        step fails (the schedule then makes the next attempt)."""
        self._attempts = number
        link = self._make_opening_link()
        resume = None if initial else self._session_token
        try:
            opened = link.open(broker, resume=resume)
            if opened.resumed:
                with self._cond:
                    refusal = self._core.reattach_refusal(opened.last_received)
                if refusal is not None:
                    # The core cannot reattach (its window and the server disagree, or
                    # transacted commands never reached the server): end that server session
                    # (its transactions roll back) and start a new one instead (F4, F5).
                    log.info("not reattaching to %s: %s", broker.redacted(), refusal)
                    link.close()
                    link = self._make_opening_link()
                    opened = link.open(broker, resume=None)
            restored = self._prepare(link, opened, initial=initial)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                link.abort()
            # The machine remembers the link as dead; if it was being restored, it goes
            # back to failing over.
            self.link_lost(link, f"failover attempt failed: {exc}")
            raise
        # Restored: from here nothing may fail the attempt (a second schedule would start
        # beside this one), so what the restore released runs outside the try.
        run_deferred(restored)
        log.debug("connected to %s (resumed=%s)", broker.redacted(), opened.resumed)

    def _make_opening_link(self) -> Link:
        link = self._link_factory(self, self.policy, self._window)
        with self._cond:
            self._opening = link
            self._early = []
        return link

    def _attempt_failed(self, attempt: Attempt, error: BaseException) -> None:
        log.info(
            "connection attempt %d to %s failed: %s",
            attempt.number,
            attempt.broker.redacted(),
            error,
        )

    def _cancellable_sleep(self, seconds: float) -> None:
        if self._cancel.wait(seconds):
            raise ReconnectCancelled()

    def _prepare(self, link: Link, opened: Opened, *, initial: bool) -> list[Deferred]:
        """Make ``link`` the connection's: plan the failover, carry the plan out, restore.
        Raises if the link was lost meanwhile; returns what the restore released, to run
        once the attempt has succeeded."""
        with self._cond:
            if self._closing:
                raise ReconnectCancelled()
            if self._machine.link_known_lost(link.serial):
                # Reported lost between open() and now: a failed attempt, asked before the
                # plan is made (making one changes the sessions core).
                raise NotConnectedError(f"{opened.broker.redacted()} was lost while connecting")
            self._link = link
            # First the broker now current: an announced list is read relative to it
            # (failover_server_list=replace keeps it first).
            self._schedule.rotation.connected_to(opened.broker)
            if opened.topology and self.policy.use_topology:
                self._apply(self._machine.handle(TopologyAnnounced(opened.topology)))
            self._detects_duplicates = opened.detects_duplicates
            broker = opened.broker
            self._peer = tracing.Peer(broker.protocol, opened.product, broker.host, broker.port)
            if link.windowed:
                self._session_token = opened.session_id
            if initial:
                self._core.first_connection()
                self._take_early_deliveries(link)
                after = self._apply(
                    self._machine.handle(Connected(opened.broker, link=link.serial))
                )
                return after + self._failback_probe(link, opened.broker)
            self._degraded = (() if link.windowed else ("reattach",)) + (
                ("duplicate detection",)
                if self.policy.duplicate_detection and not opened.detects_duplicates
                else ()
            )
            plan = self._core.failover(resumed=opened.resumed, last_received=opened.last_received)
            self._session_parts = plan.sessions
            # The plan says which it is: a resumed session the core cannot reattach to is
            # planned as a reconnect (reattach_refusal, asked above, ended that session).
            connected = Connected(
                opened.broker, resumed=plan.reattached, plan=plan, link=link.serial
            )
            after = self._apply(self._machine.handle(connected))
            self._take_early_deliveries(link)
        run_deferred(after)  # the recreation's I/O, outside the lock
        with self._cond:
            machine = self._machine
            if machine.state is not FailoverState.RESTORING or machine.link != link.serial:
                raise NotConnectedError(f"{opened.broker.redacted()} was lost during failover")
            if opened.resumed:
                self._reattached += 1
            return self._apply(machine.handle(Restored())) + self._failback_probe(
                link, opened.broker
            )

    # --- priority failback ------------------------------------------------------------------

    def _failback_probe(self, link: Link, broker: BrokerAddress) -> list[Deferred]:
        """Under the lock, once ``link`` serves calls: with failover_method=priority and a
        broker other than the preferred one, the thread that probes the preferred one."""
        preferred = self._schedule.rotation.preferred
        if preferred is None or not self._schedule.rotation.failback_due(broker):
            return []
        thread = threading.Thread(
            target=self._probe_preferred,
            args=(link.serial, preferred),
            name="hafailover-failback",
            daemon=True,
        )
        return [thread.start]

    def _probe_preferred(self, serial: int, preferred: BrokerAddress) -> None:
        """Every failback_interval while link ``serial`` is the connection's: does the
        preferred broker answer? The machine decides whether to move back (a clean point
        only); this thread ends once the link is replaced or the move has begun."""
        while not self._cancel.wait(self.policy.failback_interval):
            with self._cond:
                link = self._link
                if self._closing or link is None or link.serial != serial:
                    return
                from_broker = link.broker.redacted()
            if not self._preferred_answers(preferred):
                continue
            with self._cond:
                blocker = self._core.failback_blocker() or ""
                effects = self._machine.handle(PreferredAnswered(serial, blocker))
                if (
                    not effects
                    and link is self._link
                    and link.windowed
                    and self._core.unreceipted_commands()
                ):
                    self._write_sync(link)  # so that the next probe finds a clean point
                if effects:
                    self._lost_at = time.monotonic()
                    self._lost_reason = f"moving back to the preferred broker {preferred}"
                    self._lost_from = from_broker
                    log.info("%s answers; moving back to it", preferred.redacted())
                elif blocker:
                    log.debug("%s answers; not moving back yet: %s", preferred, blocker)
                after = self._apply(effects)
            run_deferred(after)
            if effects or not self._machine.is_up:
                return

    def _preferred_answers(self, preferred: BrokerAddress) -> bool:
        """Open a connection to the preferred broker and close it again: it answers when
        it logs the client in (a passive backup or a dead node does not)."""
        probe = self._link_factory(
            _ProbeEvents(), self.policy, ConfirmationWindow(self.policy.confirmation_window_size)
        )
        try:
            probe.open(preferred, resume=None)
        except Exception as exc:  # noqa: BLE001 - any failure means it does not answer yet
            log.debug("probe of %s: %s", preferred.redacted(), exc)
            with contextlib.suppress(Exception):
                probe.abort()
            return False
        with contextlib.suppress(Exception):
            probe.close()
        return True

    def link_redirected(self, link: Link, host: str, port: int | None) -> None:
        """The broker of ``link`` (the connection's, or one an attempt is opening) sent the
        client elsewhere (AMQP ``amqp:connection:redirect``): the next attempt goes there.
        The link's loss follows and fails over as any loss does."""
        with self._cond:
            if link is not self._link and link is not self._opening:
                return
            target = self._schedule.rotation.redirect(host, port)
            source = link.broker.redacted()
        log.warning("%s redirects the client to %s", source, target.redacted())

    def _run_reconnect(self) -> None:
        """The reconnect thread. However the schedule ends short of success (attempts used
        up, an error no retry can fix, close(), a bug), the machine hears Exhausted: pending
        calls fail and the listener hears DISCONNECT unless close() came first (F2, F10)."""
        try:
            self._run_schedule(initial=False)
        except AttemptsExhausted as exc:
            attempts, reason = exc.attempts, str(exc.last_error)
        except ReconnectCancelled:
            attempts, reason = self._attempts, "reconnection ended"
        except Exception as exc:
            if not isinstance(exc, HaFailoverError):
                log.exception("reconnection failed")
            attempts, reason = self._attempts, str(exc)
        else:
            return  # connected
        with self._cond:
            after = self._apply(self._machine.handle(Exhausted(attempts, reason)))
        run_deferred(after)

    # --- carrying out the machine's effects -------------------------------------------------

    def _apply(self, effects: list[Effect]) -> list[Deferred]:
        """Under the lock: carry out effects; return what to do once the lock is released
        (I/O that may block, threads to start, completion callbacks)."""
        after: list[Deferred] = []
        for effect in effects:
            if isinstance(effect, StartReconnect):
                thread = threading.Thread(
                    target=self._run_reconnect, name="hafailover-reconnect", daemon=True
                )
                after.append(thread.start)
            elif isinstance(effect, CancelReconnect):
                self._cancel.set()
            elif isinstance(effect, CloseTransport):
                link = self._link
                if link is not None and not self._closing:
                    after.append(link.close if effect.gracefully else link.abort)
            elif isinstance(effect, LearnTopology):
                if self._schedule.rotation.learn_topology(effect.endpoints):
                    log.info(
                        "topology: %s",
                        ", ".join(b.redacted() for b in self._schedule.rotation.brokers),
                    )
            elif isinstance(effect, ReattachSessions):
                assert effect.plan is not None
                after.extend(self._reattach(effect.plan))
            elif isinstance(effect, RecreateSessions):
                assert effect.plan is not None
                after.append(self._recreate(effect.plan))
            elif isinstance(effect, UnblockPendingCalls):
                after.extend(
                    self._end_calls(
                        self._core.release(effect.tokens),
                        UnblockedError(
                            "the connection failed over before the broker answered; "
                            "the outcome is unknown"
                        ),
                    )
                )
            elif isinstance(effect, FailPendingCalls):
                error = error_for(effect.code, f"connection {effect.code.value}")
                after.extend(self._end_calls(self._core.release_all(), error))
            elif isinstance(effect, InvalidateBrowsers):
                for browser in self._browsing.values():
                    browser._invalidate()  # F11: the rest of its snapshot died with the link
            elif isinstance(effect, WakeBlockedCalls):
                self._cond.notify_all()
            elif isinstance(effect, NotifyListener):
                self._notify_failover(effect)
        return after

    def _reattach(self, plan: FailoverPlan) -> list[Callback]:
        """Under the lock: write the plan on a server that kept the session (F4)."""
        link = self._link
        assert link is not None
        for command in plan.replay:
            link.replay(command.payload)
        for token in plan.resend:
            self._resend(link, token)
        callbacks = self._end_calls(plan.complete, None)
        for session in self._sessions.values():
            outcome = plan.outcomes.get(session.session_id)
            if outcome is not None:
                session._failed_over(outcome, link, reattached=True)
        return callbacks

    def _recreate(self, plan: FailoverPlan) -> Callable[[], None]:
        """Under the lock: apply the sessions' outcomes on a new session (F5-F9); returns
        the recreation to run outside it (a link whose calls block is waited on)."""
        link = self._link
        assert link is not None
        consumers: list[Consumer] = []
        temporary: list[Destination] = []
        for session in self._sessions.values():
            outcome = plan.outcomes.get(session.session_id)
            if outcome is not None:
                session._failed_over(outcome, link, reattached=False)
            consumers.extend(c for c in session._consumers.values() if not c._closed)
            temporary.extend(session._temporary)

        def recreate() -> None:
            for destination in temporary:
                link.temporary_queue(destination)
            for consumer in consumers:
                consumer._subscribe_on(link)
            with self._cond:
                for token in plan.resend:
                    self._resend(link, token)
                for command in plan.resend_frames:
                    link.resend(command.payload)
                    self._core.count_sent()

        return recreate

    def _resend(self, link: Link, token: int) -> None:
        """Under the lock: send again a confirmed send of the plan (F13)."""
        waiting = self._waiting.get(token)
        if waiting is None or waiting.completion.message is None or waiting.destination is None:
            return
        command_id = link.send(
            waiting.destination, waiting.completion.message, tx=None, token=token
        )
        self._core.resent_on(token, link=link.serial, command_id=command_id)

    def _notify_failover(self, effect: NotifyListener) -> None:
        machine = self._machine
        report = FailoverReport(
            code=effect.code,
            reason=effect.reason or self._lost_reason,
            from_broker=self._lost_from,
            to_broker=machine.broker.redacted() if machine.broker is not None else None,
            reattached=effect.reattached,
            failback=effect.failback,
            attempts=self._attempts,
            duration=time.monotonic() - self._lost_at if self._lost_at else 0.0,
            sessions=self._session_parts,
            degraded=self._degraded if effect.code is ErrorCode.FAILOVER else (),
        )
        self._reports.append(report)
        self._in_doubt += len(report.in_doubt)
        hooks = tracing.installed()
        if hooks is not None:
            on_failover = functools.partial(hooks.failover, self._peer, ended_ns=time.time_ns())
            self._notifier.post(lambda: call_listener(on_failover, report))
        event: ConnectionEvent
        error: HaFailoverError
        if effect.code is ErrorCode.FAILOVER:
            log.warning("%s", report.summary())
            event = FailoverCompleted(report)
            error = FailoverNotice(report.summary(), reattached=effect.reattached, report=report)
        else:
            log.error("%s", report.summary())
            event = FailoverFailed(report)
            error = DisconnectedError(report.summary())
        self._notify_all(event, error)

    def _notify_all(self, event: ConnectionEvent | None, error: HaFailoverError | None) -> None:
        """Tell event listeners, then the exception listener, on the listener thread."""
        listeners = list(self._event_listeners) if event is not None else []
        exception_listener = self._exception_listener

        def tell() -> None:
            for listener in listeners:
                call_listener(listener, event)
            if error is not None and exception_listener is not None:
                call_listener(exception_listener, error)

        self._notifier.post(tell)


class _ProbeEvents:
    """The events of a failback probe's link: it subscribes to nothing and sends nothing,
    so only its output (the handshake) matters, written at once (no lock is held)."""

    def link_message(self, link: Link, subscription: str, tag: str, message: Message) -> None:
        pass

    def link_completed(self, link: Link, token: int, error: RemoteError | None) -> None:
        pass

    def link_confirmed(self, link: Link, upto: int) -> None:
        pass

    def link_error(self, link: Link, error: Any) -> None:
        pass

    def link_browse_end(self, link: Link, subscription: str) -> None:
        pass

    def link_lost(self, link: Link, reason: str) -> None:
        pass

    def link_redirected(self, link: Link, host: str, port: int | None) -> None:
        pass

    def link_output(self, link: Link, flush: Callable[[], None]) -> None:
        flush()
