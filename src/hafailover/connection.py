"""The threaded driver and the public API: connection, session, producer, consumer, browser.

Theory of operation
-------------------
A ``Connection`` is one logical connection that outlives any number of broker connections
("links", ``_links.py``). Its state is the pure ``FailoverMachine``; this module carries out
the machine's effects, and is the only place with locks, threads and clocks.

- One condition (``_cond``, over a re-entrant lock) guards all of the connection's state:
  the machine, the current link, the confirmation window, the calls waiting for the broker
  ("pending", by token) and every session's and consumer's buffers. STOMP frames are written
  under it so command ids follow wire order; calls that block on the broker (AMQP attach,
  declare, discharge) are made outside it.
- Stop the world (F1): every call that needs the network first asks ``machine.admit()``
  and waits on the condition while the connection fails over.
- A lost link starts one reconnect thread that runs the ``ReconnectSchedule``. Each attempt
  opens a link and, if the broker still holds the session, reattaches (replays the window
  after the broker's last-received id, F4); otherwise recreates sessions, consumers and
  temporary queues and resends the confirmed-persistent sends that carry a duplicate id (F5,
  F13), failing the other waiting calls with UNBLOCKED (F3). Only when all of that is done
  is the machine told ``Connected``, so no application call slips in half-way.
- Exception listeners and lifecycle events run on one notifier thread, never on a protocol
  thread, and a listener that raises is logged (F10).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, NoReturn

import attrs

from hafailover._links import Link, LinkFactory, make_link
from hafailover.ack_modes import (
    AckAction,
    AckDecision,
    AckMode,
    AckRules,
    ClientAckRules,
    LinkReliability,
    TransactedAckRules,
    check_link_reliability,
    rules_for,
)
from hafailover.adapters.base import Opened
from hafailover.destination import Destination, parse_destination
from hafailover.errors import (
    AcknowledgeFailedError,
    BrowserInvalidatedError,
    CallTimeoutError,
    ConfigurationError,
    ConnectionClosedError,
    DisconnectedError,
    ErrorCode,
    FailoverNotice,
    HaFailoverError,
    IllegalStateError,
    LocalError,
    MessageTooLargeError,
    NotConnectedError,
    ProtocolError,
    RemoteError,
    SecurityError,
    StaleAcknowledgeError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from hafailover.failover import (
    Admission,
    CancelReconnect,
    CloseRequested,
    CloseTransport,
    Connected,
    Effect,
    Exhausted,
    FailoverMachine,
    FailPendingCalls,
    LearnTopology,
    Lost,
    NotifyListener,
    ReattachSessions,
    RecreateSessions,
    StartReconnect,
    TopologyAnnounced,
    UnblockPendingCalls,
    WakeBlockedCalls,
)
from hafailover.message import Message, PropertyValue
from hafailover.report import FailoverReport, SessionFailover
from hafailover.schedule import Attempt, AttemptsExhausted, ReconnectCancelled, ReconnectSchedule
from hafailover.tx.state import CommitAction, CommitDecision, TxPhase
from hafailover.url import FailoverPolicy, parse_url
from hafailover.window import ConfirmationWindow, ReattachImpossibleError

__all__ = [
    "Browser",
    "Connection",
    "ConnectionEvent",
    "ConnectionStatistics",
    "Consumer",
    "FailoverCompleted",
    "FailoverFailed",
    "FailureDetected",
    "Producer",
    "SendCompletion",
    "Session",
    "connect",
]

log = logging.getLogger("hafailover")

# The largest message body a producer accepts (a clear error instead of a broker's refusal).
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
DEFAULT_PREFETCH: Final = 100
# With a broker whose receipts come in frame order (the reattach extension promises it), one
# receipt confirms every send before it: ask for one every this many confirmed sends, and
# whenever somebody waits.
RECEIPT_EVERY: Final = 64

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


def _error_for(code: ErrorCode, text: str) -> HaFailoverError:
    return _ERRORS_BY_CODE.get(code, NotConnectedError)(text)


# --- lifecycle events ----------------------------------------------------------------------


@attrs.frozen
class FailureDetected:
    """The connection to ``broker`` was lost; failover starts (or, if disabled, it ends)."""

    broker: str
    reason: str


@attrs.frozen
class FailoverCompleted:
    """Failover succeeded; ``report`` says what it did."""

    report: FailoverReport


@attrs.frozen
class FailoverFailed:
    """Failover gave up: the connection is disconnected for good."""

    report: FailoverReport


ConnectionEvent = FailureDetected | FailoverCompleted | FailoverFailed


@attrs.frozen
class ConnectionStatistics:
    """Counters since the connection was made."""

    sent: int  # messages handed to the broker (including resends)
    confirmed: int  # sends the broker confirmed
    failovers: int  # failovers completed
    reattached: int  # of which reattached the session on the same server
    replayed: int  # commands replayed from the confirmation window
    resent: int  # confirmed sends resent with their duplicate id after a reconnect
    in_doubt: int  # sends released with UNBLOCKED: may or may not have been stored
    received: int  # messages handed to the application


# --- waiting for the broker ----------------------------------------------------------------


class SendCompletion:
    """The outcome of an asynchronous send (or of any call waiting for the broker)."""

    __slots__ = ("_callbacks", "_connection", "_done", "_error", "message")

    def __init__(self, connection: Connection, message: Message | None) -> None:
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

    def _finish(self, error: HaFailoverError | None) -> list[Callable[[SendCompletion], None]]:
        """Under the connection's lock; returns the callbacks to run outside it."""
        self._done = True
        self._error = error
        callbacks, self._callbacks = self._callbacks, None
        return callbacks or []


_KIND_SEND: Final = "send"
_KIND_CALL: Final = "call"  # ack, commit, rollback: not resendable
_KIND_SYNC: Final = "sync"  # a frame written only for its receipt


_Callback = tuple[Callable[["SendCompletion"], None], "SendCompletion"]


@attrs.define(slots=True)
class _Pending:
    kind: str
    completion: SendCompletion
    session: Session | None
    command_id: int
    destination: Destination | None = None
    producer: Producer | None = None
    resendable: bool = False
    consumer: Consumer | None = None  # a subscription waiting for the broker
    cumulative: bool = False  # confirmed by its own or any later receipt (in _receipt_order)
    size: int = 0  # bytes counted against the window of a link without one (flow control)


# --- the connection ------------------------------------------------------------------------


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


class Connection:
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
        self._cond = threading.Condition(threading.RLock())
        self._machine = FailoverMachine(reconnect_enabled=policy.reconnect_attempts != 0)
        self._schedule = ReconnectSchedule(policy, rng=rng)
        self._window: ConfirmationWindow[Any] = ConfirmationWindow(policy.confirmation_window_size)
        self._link: Link | None = None
        self._link_dead = False  # the link being prepared by a failover died
        # The link a connection attempt is opening, and what it delivered before it became
        # the connection's (a reattached broker resends deliveries right after CONNECTED).
        self._opening: Link | None = None
        self._early: list[tuple[str, str, Message]] = []
        self._session_token: str | None = None  # the broker's session id, for reattach
        self._pending: dict[int, _Pending] = {}
        self._unblock: set[int] = set()  # calls a reconnect releases with UNBLOCKED (F3)
        # Cumulative receipts (windowed STOMP links): confirmed sends in wire order, and how
        # many were written since the last frame that asked for a receipt.
        self._receipt_order: collections.deque[int] = collections.deque()
        self._unreceipted = 0
        # Links without the window extension (AMQP, plain STOMP brokers): bytes of confirmed
        # sends still waiting for the broker, held to the window size all the same.
        self._unconfirmed_bytes = 0
        self._tokens = itertools.count(1)
        self._sessions: dict[int, Session] = {}
        self._browsing: dict[str, Browser] = {}  # browse subscription -> its browser
        self._session_ids = itertools.count(1)
        self._subscription_ids = itertools.count(1)
        self._started = False
        self._closing = False
        self._cancel = threading.Event()
        self._reconnect_thread: threading.Thread | None = None
        # Failover bookkeeping for the report.
        self._lost_at = 0.0
        self._lost_reason = ""
        self._lost_from = ""
        self._attempts = 0
        self._session_parts: dict[int, SessionFailover] = {}
        self._degraded: tuple[str, ...] = ()
        self._reports: list[FailoverReport] = []
        # Counters.
        self._sent = 0
        self._confirmed = 0
        self._reattached = 0
        self._replayed = 0
        self._resent = 0
        self._in_doubt = 0
        self._received = 0
        # Listeners, called on the notifier thread.
        self._exception_listener = exception_listener
        self._event_listeners: list[Callable[[ConnectionEvent], None]] = []
        self._notices: collections.deque[Callable[[], None]] = collections.deque()
        self._notifier: threading.Thread | None = None
        self._notify_cond = threading.Condition()

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
    def state(self) -> str:
        return self._machine.state.value

    @property
    def reports(self) -> tuple[FailoverReport, ...]:
        """Every failover's report, oldest first."""
        with self._cond:
            return tuple(self._reports)

    def statistics(self) -> ConnectionStatistics:
        with self._cond:
            return ConnectionStatistics(
                sent=self._sent,
                confirmed=self._confirmed,
                failovers=self._machine.failovers_completed,
                reattached=self._reattached,
                replayed=self._replayed,
                resent=self._resent,
                in_doubt=self._in_doubt,
                received=self._received,
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
        if not isinstance(ack_mode, AckMode):
            raise ConfigurationError(
                f"ack_mode must be an AckMode, not {ack_mode!r}",
            )
        with self._cond:
            self._check_open()
            self._admit(self._failover_deadline())  # F1: waits while failing over
            session = Session(self, next(self._session_ids), ack_mode)
            self._sessions[session.session_id] = session
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
            effects = self._machine.handle(CloseRequested())
            link = self._link
            after = self._apply(effects)
        self._cancel.set()
        for action in after:
            action()
        if link is not None:
            with contextlib.suppress(Exception):
                link.close()
        for session in sessions:
            session._join()
        self._notify(None)  # wake the notifier so it ends
        notifier = self._notifier
        if notifier is not None and notifier is not threading.current_thread():
            notifier.join(5.0)

    # --- opening and failing over -----------------------------------------------------------

    def _open(self) -> None:
        try:
            self._schedule.run(
                lambda broker, n: self._attempt(broker, n, initial=True),
                initial=True,
                sleep=self._cancellable_sleep,
                cancelled=self._cancel.is_set,
                on_failure=self._attempt_failed,
            )
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
        """One connection attempt: open, then reattach or recreate; raise if any step fails."""
        self._attempts = number
        link = self._make_opening_link()
        resume = None if initial else self._session_token
        try:
            opened = link.open(broker, resume=resume)
            if opened.resumed and not self._can_reattach(opened):
                # Reattach would need transacted commands the broker never received: end
                # that session (its transactions roll back) and start a new one instead.
                link.close()
                link = self._make_opening_link()
                opened = link.open(broker, resume=None)
            self._prepare(link, opened, initial=initial)
        except BaseException:
            with contextlib.suppress(Exception):
                link.abort()
            raise
        log.debug("connected to %s (resumed=%s)", broker.redacted(), opened.resumed)

    def _make_opening_link(self) -> Link:
        link = self._link_factory(self, self.policy, self._window)
        with self._cond:
            self._opening = link
            self._early = []
        return link

    def _can_reattach(self, opened: Opened) -> bool:
        with self._cond:
            return self._window.enabled and not any(
                not c.replayable and c.command_id > opened.last_received for c in self._window
            )

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

    def _prepare(self, link: Link, opened: Opened, *, initial: bool) -> None:
        """Make ``link`` the connection's and bring every session onto it."""
        with self._cond:
            if self._closing:
                raise ReconnectCancelled()
            self._link = link
            self._link_dead = False
            if opened.topology and self.policy.use_topology:
                self._apply(self._machine.handle(TopologyAnnounced(opened.topology)))
            self._schedule.rotation.connected_to(opened.broker)
            if link.windowed:
                self._session_token = opened.session_id
            if initial:
                self._window.reconnect()
                self._take_early_deliveries(link)
                self._apply(self._machine.handle(Connected(opened.broker, resumed=False)))
                return
            self._session_parts = {}
            self._degraded = () if link.windowed else ("reattach",)
            if opened.resumed:
                self._reattach(link, opened)
                resumed_ok = True
            else:
                resumed_ok = False
                recreate = self._reset_sessions_for_reconnect()
            self._take_early_deliveries(link)
        if not resumed_ok:
            self._recreate(link, recreate)
        with self._cond:
            if self._link_dead or self._closing:
                raise NotConnectedError(f"{opened.broker.redacted()} was lost during failover")
            self._finish_failover(opened, resumed=resumed_ok)

    def _reattach(self, link: Link, opened: Opened) -> None:
        """Under the lock: replay what the broker never received (F4)."""
        last = opened.last_received
        try:
            plan = self._window.reattach(last)
        except ReattachImpossibleError as exc:
            raise NotConnectedError(f"reattach refused by the client: {exc}") from exc
        for command in plan.replay:
            link.replay(command.payload)
        replayed_ids = tuple(c.command_id for c in plan.replay)
        self._replayed += len(replayed_ids)
        # Calls the broker received before the drop whose answer was lost with the socket:
        # a send with a duplicate id is sent again (the broker drops the copy and answers),
        # an acknowledge was done; a commit's outcome is unknown (the tx rules decide).
        resent: dict[int, list[str]] = collections.defaultdict(list)
        for token, pending in list(self._pending.items()):
            if pending.command_id < 0 or pending.command_id > last:
                continue
            if pending.kind == _KIND_SEND and pending.resendable:
                message = pending.completion.message
                assert message is not None
                assert pending.destination is not None
                pending.command_id = link.send(pending.destination, message, tx=None, token=token)
                self._resent += 1
                self._sent += 1
                if pending.session is not None:
                    resent[pending.session.session_id].append(message.message_id or "")
            elif (
                pending.kind == _KIND_CALL
                and pending.session is not None
                and pending.session._committing
            ):
                continue  # the commit's fate is decided below
            else:
                self._complete_locked(token, None)
        for session in self._sessions.values():
            # The server kept the session: its subscriptions and transaction live on.
            for consumer in session._consumers.values():
                if consumer._on_link:
                    consumer._on_link = link.serial
            if session._tx is not None:
                session._tx_link = link.serial
            self._session_parts[session.session_id] = session._failed_over(
                reattached=True,
                commit_received=self._commit_received(session, last),
                replayed=replayed_ids
                if session.session_id == min(self._sessions, default=0)
                else (),
                resent=tuple(resent.get(session.session_id, ())),
            )
        for token, pending in list(self._pending.items()):
            owner = pending.session
            if (
                pending.kind == _KIND_CALL
                and owner is not None
                and owner._committing
                and 0 <= pending.command_id <= last
            ):
                self._fail_locked(token, UnblockedError("the commit's reply was lost"))

    def _commit_received(self, session: Session, last: int) -> bool | None:
        for pending in self._pending.values():
            if pending.session is session and pending.kind == _KIND_CALL and session._committing:
                return 0 <= pending.command_id <= last
        return None

    def _reset_sessions_for_reconnect(self) -> _Recreate:
        """Under the lock: apply the ack-mode and transaction rules of a reconnect (F5-F9) and
        sort the waiting calls into resends and in-doubt ones."""
        # The pending calls say what to resend; the window only restarts its ids.
        self._window.reconnect()
        self._receipt_order.clear()
        self._unreceipted = 0
        resends: list[int] = []
        self._unblock = {
            token
            for token, pending in self._pending.items()
            if not (pending.kind == _KIND_SEND and pending.resendable)
        }
        in_doubt: dict[int, list[str]] = collections.defaultdict(list)
        resent: dict[int, list[str]] = collections.defaultdict(list)
        for token, pending in sorted(self._pending.items()):
            if pending.kind == _KIND_SEND and pending.resendable:
                resends.append(token)
                if pending.session is not None and pending.completion.message is not None:
                    resent[pending.session.session_id].append(
                        pending.completion.message.message_id or ""
                    )
            elif pending.kind == _KIND_SEND and pending.session is not None:
                message = pending.completion.message
                in_doubt[pending.session.session_id].append(
                    message.message_id or "" if message is not None else ""
                )
        subscriptions: list[Consumer] = []
        temporary: list[Destination] = []
        for session in self._sessions.values():
            self._session_parts[session.session_id] = session._failed_over(
                reattached=False,
                commit_received=None,
                resent=tuple(resent.get(session.session_id, ())),
                in_doubt=tuple(in_doubt.get(session.session_id, ())),
            )
            subscriptions.extend(c for c in session._consumers.values() if not c._closed)
            temporary.extend(session._temporary)
        return _Recreate(tuple(subscriptions), tuple(temporary), tuple(resends))

    def _recreate(self, link: Link, plan: _Recreate) -> None:
        """Outside the lock (AMQP blocks): temporary queues, subscriptions, then resends."""
        for destination in plan.temporary:
            link.temporary_queue(destination)
        for consumer in plan.consumers:
            with self._cond:
                consumer._subscribe_on(link)
        with self._cond:
            for token in plan.resends:
                pending = self._pending.get(token)
                if pending is None or pending.completion.message is None:
                    continue
                assert pending.destination is not None
                pending.cumulative = False
                pending.command_id = link.send(
                    pending.destination, pending.completion.message, tx=None, token=token
                )
                self._resent += 1
                self._sent += 1

    def _finish_failover(self, opened: Opened, *, resumed: bool) -> None:
        """Under the lock: tell the machine; its effects wake the world and the listener."""
        if resumed:
            self._reattached += 1
        # Only calls made on the lost link are released; those the recreation made on the new
        # one (subscriptions, resends) wait for their answers.
        keep = set(self._pending) - self._unblock
        effects = self._machine.handle(Connected(opened.broker, resumed=resumed))
        after = self._apply(effects, keep=keep)
        for action in after:
            action()

    def _run_reconnect(self) -> None:
        try:
            self._schedule.run(
                lambda broker, n: self._attempt(broker, n, initial=False),
                initial=False,
                sleep=self._cancellable_sleep,
                cancelled=self._cancel.is_set,
                on_failure=self._attempt_failed,
            )
        except ReconnectCancelled:
            return
        except (AttemptsExhausted, LocalError, SecurityError) as exc:
            reason = str(exc.last_error) if isinstance(exc, AttemptsExhausted) else str(exc)
            attempts = exc.attempts if isinstance(exc, AttemptsExhausted) else self._attempts
            with self._cond:
                after = self._apply(self._machine.handle(Exhausted(attempts, reason)))
            for action in after:
                action()

    # --- applying the machine's effects -----------------------------------------------------

    def _apply(
        self, effects: list[Effect], keep: set[int] | None = None
    ) -> list[Callable[[], None]]:
        """Under the lock: carry out effects; return the I/O to do once the lock is released."""
        after: list[Callable[[], None]] = []
        for effect in effects:
            if isinstance(effect, StartReconnect):
                thread = threading.Thread(
                    target=self._run_reconnect, name="hafailover-reconnect", daemon=True
                )
                self._reconnect_thread = thread
                after.append(thread.start)
            elif isinstance(effect, CancelReconnect):
                self._cancel.set()
            elif isinstance(effect, CloseTransport):
                link = self._link
                if link is not None and not self._closing:
                    after.append(link.abort)
            elif isinstance(effect, LearnTopology):
                if self._schedule.rotation.learn_topology(effect.endpoints):
                    log.info(
                        "topology: %s",
                        ", ".join(b.redacted() for b in self._schedule.rotation.brokers),
                    )
            elif isinstance(effect, ReattachSessions | RecreateSessions):
                pass  # done by _prepare before the machine heard of the connection
            elif isinstance(effect, UnblockPendingCalls):
                for token in list(self._pending):
                    if keep is None or token not in keep:
                        self._fail_locked(
                            token,
                            UnblockedError(
                                "the connection failed over before the broker answered; "
                                "the outcome is unknown"
                            ),
                        )
            elif isinstance(effect, FailPendingCalls):
                for token in list(self._pending):
                    self._fail_locked(
                        token, _error_for(effect.code, f"connection {effect.code.value}")
                    )
                for session in self._sessions.values():
                    session._wake_browsers()
            elif isinstance(effect, WakeBlockedCalls):
                self._cond.notify_all()
            elif isinstance(effect, NotifyListener):
                self._notify_failover(effect)
        return after

    def _notify_failover(self, effect: NotifyListener) -> None:
        machine = self._machine
        report = FailoverReport(
            code=effect.code,
            reason=effect.reason or self._lost_reason,
            from_broker=self._lost_from,
            to_broker=machine.broker.redacted() if machine.broker is not None else None,
            reattached=effect.reattached,
            attempts=self._attempts,
            duration=time.monotonic() - self._lost_at if self._lost_at else 0.0,
            sessions=tuple(self._session_parts.values()),
            degraded=self._degraded if effect.code is ErrorCode.FAILOVER else (),
        )
        self._reports.append(report)
        self._in_doubt += len(report.in_doubt)
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
        listeners = list(self._event_listeners)
        exception_listener = self._exception_listener

        def tell() -> None:
            if event is not None:
                for listener in listeners:
                    self._call_listener(listener, event)
            if error is not None and exception_listener is not None:
                self._call_listener(exception_listener, error)

        self._notify(tell)

    @staticmethod
    def _call_listener(listener: Callable[[Any], None], value: object) -> None:
        try:
            listener(value)
        except Exception:
            log.exception("a connection listener raised (ignored)")

    def _notify(self, action: Callable[[], None] | None) -> None:
        with self._notify_cond:
            self._notices.append(action or (lambda: None))
            if self._notifier is None:
                self._notifier = threading.Thread(
                    target=self._notify_loop, name="hafailover-listener", daemon=True
                )
                self._notifier.start()
            self._notify_cond.notify()

    def _notify_loop(self) -> None:
        while True:
            with self._notify_cond:
                while not self._notices:
                    if self._closing:
                        return
                    self._notify_cond.wait(0.5)
                action = self._notices.popleft()
            action()

    # --- link events (transport threads) -----------------------------------------------------

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
            consumer = session._by_subscription.get(subscription)
            if consumer is not None:
                consumer._arrived(tag, message)
                return

    def link_completed(self, link: Any, token: int, error: RemoteError | None) -> None:
        with self._cond:
            pending = self._pending.get(token)
            if pending is None:
                return
            if error is None and pending.cumulative:
                callbacks = self._complete_through(token)
            elif error is None:
                if pending.kind == _KIND_SEND:
                    self._confirmed += 1
                callbacks = self._complete_locked(token, None)
            else:
                callbacks = self._fail_locked(token, error)
                consumer = pending.consumer
                if consumer is not None and not isinstance(
                    error, NotConnectedError | UnblockedError | CallTimeoutError
                ):
                    # The broker refused the subscription: the consumer is gone, so a
                    # reconnect does not ask again (and get refused again).
                    consumer._closed = True
                    consumer.session._consumers.pop(consumer.subscription, None)
        for callback, completion in callbacks:
            self._run_callback(callback, completion)

    def link_confirmed(self, link: Any, upto: int) -> None:
        with self._cond:
            current = self._link
            if current is None or link is not current or not current.windowed:
                return
            try:
                if self._window.confirm(upto):
                    self._cond.notify_all()  # room in the window for blocked senders
            except ReattachImpossibleError:
                log.warning(
                    "%s confirmed a command never sent (%d): ignored",
                    current.broker.redacted(),
                    upto,
                )

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
        with self._cond:
            current = self._link
            if current is None or link is not current or self._closing:
                return
            if not self._machine.is_up:
                self._link_dead = True  # a link being prepared died: that attempt fails
                return
            self._lost_at = time.monotonic()
            self._lost_reason = reason
            self._lost_from = current.broker.redacted()
            log.warning("connection to %s lost: %s; failing over", self._lost_from, reason)
            for browser in self._browsing.values():
                browser._invalidate()  # F11: the rest of its snapshot died with the link
            effects = self._machine.handle(Lost(reason))
            self._notify_all(FailureDetected(self._lost_from, reason), None)
            after = self._apply(effects)
        for action in after:
            action()

    # --- calls ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise ConnectionClosedError("the connection is closed")

    def _admit(self, deadline: float | None) -> Link:
        """Under the lock: wait while failing over (F1); return the link to use."""
        while True:
            admission, code = self._machine.admit()
            if admission is Admission.PROCEED and self._link is not None:
                return self._link
            if admission is Admission.RAISE:
                assert code is not None
                raise _error_for(code, f"the connection is {self._machine.state.value}")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise CallTimeoutError(
                    f"the connection did not come back within call_failover_timeout "
                    f"({self.policy.call_failover_timeout}s)"
                )
            self._cond.wait(remaining)

    def _failover_deadline(self) -> float | None:
        timeout = self.policy.call_failover_timeout
        return None if timeout is None else time.monotonic() + timeout

    def _register(self, pending: _Pending) -> int:
        token = next(self._tokens)
        self._pending[token] = pending
        return token

    def _complete_locked(self, token: int, error: None) -> list[_Callback]:
        return self._finish_locked(token, None)

    def _fail_locked(self, token: int, error: HaFailoverError) -> list[_Callback]:
        return self._finish_locked(token, error)

    def _finish_locked(self, token: int, error: HaFailoverError | None) -> list[_Callback]:
        """Under the lock: end one waiting call; returns its callbacks to run outside it."""
        pending = self._pending.pop(token, None)
        if pending is None:
            return []
        self._cond.notify_all()
        return self._settle(pending, error)

    def _settle(self, pending: _Pending, error: HaFailoverError | None) -> list[_Callback]:
        if pending.producer is not None:
            pending.producer._outstanding -= 1
        self._unconfirmed_bytes -= pending.size
        completion = pending.completion
        return [(c, completion) for c in completion._finish(error)]

    def _complete_through(self, token: int) -> list[_Callback]:
        """A receipt in frame order: every cumulative call up to ``token`` is confirmed."""
        callbacks: list[_Callback] = []
        order = self._receipt_order
        pending_calls = self._pending
        while order:
            done = order.popleft()
            pending = pending_calls.pop(done, None)
            if pending is not None:
                if pending.kind == _KIND_SEND:
                    self._confirmed += 1
                callbacks.extend(self._settle(pending, None))
            if done == token:
                break
        self._cond.notify_all()
        return callbacks

    def _ask_for_receipt(self) -> None:
        """Under the lock: someone waits for a cumulative confirmation that no written frame
        has asked for yet; write one frame that asks."""
        link = self._link
        if self._unreceipted == 0 or link is None or not self._machine.is_up:
            return
        if not link.windowed:
            return
        token = self._register(
            _Pending(_KIND_SYNC, SendCompletion(self, None), None, -1, cumulative=True)
        )
        try:
            link.sync(token)
        except HaFailoverError as exc:
            self._pending.pop(token, None)
            self._io_failed(link, exc)
            return
        self._receipt_order.append(token)
        self._unreceipted = 0

    @staticmethod
    def _run_callback(
        callback: Callable[[SendCompletion], None], completion: SendCompletion
    ) -> None:
        try:
            callback(completion)
        except Exception:
            log.exception("a send completion callback raised (ignored)")

    def _wait_done(self, completion: SendCompletion, timeout: float | None) -> None:
        """Wait for a completion; failover time does not count against call_timeout."""
        self._wait_until(
            lambda: completion._done,
            timeout,
            lambda: f"the broker did not answer within {self.policy.call_timeout}s",
        )

    def _wait_until(
        self, done: Callable[[], bool], timeout: float | None, timed_out: Callable[[], str]
    ) -> None:
        """Wait until ``done()`` for the broker's answers, asking for a receipt where one
        is missing; time spent failing over does not count against the timeout (F1)."""
        budget = self.policy.call_timeout if timeout is None else timeout
        with self._cond:
            last = time.monotonic()
            while not done():
                self._ask_for_receipt()
                if budget <= 0:
                    raise CallTimeoutError(timed_out())
                self._cond.wait(min(budget, 0.5))
                now = time.monotonic()
                if self._machine.is_up:
                    budget -= now - last
                last = now

    def _wait_window_room(self, size: int, deadline: float | None) -> Link:
        """Under the lock: admission plus window flow control (F4)."""
        while True:
            link = self._admit(deadline)
            if link.windowed:
                if self._window.has_room(size):
                    return link
            elif (
                self._window.size == -1
                or self._unconfirmed_bytes == 0
                or self._unconfirmed_bytes + size <= self._window.size
            ):
                return link
            if not self._cond.wait(self.policy.call_timeout):
                raise CallTimeoutError(
                    f"the broker confirmed nothing for {self.policy.call_timeout}s while the "
                    f"confirmation window ({self._window.size} bytes) was full"
                )

    def _subscribe(self, consumer: Consumer) -> None:
        """Start a consumer's subscription, waiting through failover (F1)."""
        deadline = self._failover_deadline()
        while True:
            with self._cond:
                link = self._admit(deadline)
                try:
                    consumer._subscribe_on(link)
                except HaFailoverError as exc:
                    if isinstance(exc, NotConnectedError | UnblockedError):
                        self._io_failed(link, exc)
                        continue  # the failover recreates the link; subscribe on the new one
                    consumer.session._consumers.pop(consumer.subscription, None)
                    if isinstance(exc, CallTimeoutError):
                        # The broker may still attach it: take back what was asked for.
                        with contextlib.suppress(HaFailoverError):
                            link.unsubscribe(consumer.subscription)
                    raise
                return

    def _io_failed(self, link: Any, exc: HaFailoverError) -> None:
        """A write failed: the link is dead even if its loss has not been reported yet."""
        if isinstance(exc, NotConnectedError | UnblockedError):
            self.link_lost(link, str(exc))


@attrs.frozen
class _Recreate:
    consumers: tuple[Consumer, ...]
    temporary: tuple[Destination, ...]
    resends: tuple[int, ...]


# --- sessions ------------------------------------------------------------------------------


class Session:
    """A single-threaded context for producing and consuming (as in JMS)."""

    def __init__(self, connection: Connection, session_id: int, ack_mode: AckMode) -> None:
        self.connection = connection
        self.session_id = session_id
        self.ack_mode = ack_mode
        self.rules: AckRules = rules_for(ack_mode, session_id)
        self._consumers: dict[str, Consumer] = {}
        self._by_subscription = self._consumers
        self._temporary: list[Destination] = []
        self._tx: object = None  # the broker's transaction handle, once work started
        self._tx_link = 0
        self._committing = False
        self._tag_subscriptions: dict[str, str] = {}
        self._closed = False
        self._dispatcher: threading.Thread | None = None
        self._browsers: list[Browser] = []
        self._auto_ack: SendCompletion | None = None  # AUTO: the last acknowledge, in flight
        self._tx_sends: list[SendCompletion] = []  # AMQP: transactional transfers unsettled
        self._commit_link = 0  # serial of the link a running commit() belongs to

    @property
    def transacted(self) -> bool:
        return self.ack_mode is AckMode.SESSION_TRANSACTED

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosedError(f"session {self.session_id} is closed")
        self.connection._check_open()

    # --- factories --------------------------------------------------------------------------

    def create_producer(
        self, destination: str | Destination | None = None, *, confirm: bool = True
    ) -> Producer:
        """A producer; without a destination every send names one. ``confirm=False`` sends
        persistent messages without waiting for the broker (still kept in the confirmation
        window and stamped with a duplicate id)."""
        self._check_open()
        return Producer(
            self, None if destination is None else parse_destination(destination), confirm
        )

    def create_consumer(
        self,
        destination: str | Destination,
        *,
        selector: str | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        reliability: LinkReliability | None = None,
    ) -> Consumer:
        """A consumer of a queue, topic or temporary queue. ``reliability`` (Qpid's link
        reliability) must agree with the session's ack mode (F14)."""
        self._check_open()
        check_link_reliability(self.ack_mode, reliability)
        if selector is not None and not self.connection.policy.brokers[0].scheme.startswith(
            "stomp"
        ):
            raise ConfigurationError("message selectors are supported on STOMP connections only")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigurationError(f"prefetch must be a whole number >= 1, not {prefetch!r}")
        target = parse_destination(destination)
        connection = self.connection
        with connection._cond:
            subscription = f"sub-{next(connection._subscription_ids)}"
            consumer = Consumer(self, subscription, target, prefetch, selector)
            self._consumers[subscription] = consumer
        connection._subscribe(consumer)
        while True:
            completion = consumer._subscribed
            assert completion is not None
            try:
                completion.result()
            except UnblockedError:
                # A failover caught the subscription; the recreation subscribed it again.
                with connection._cond:
                    given_up = consumer._closed or consumer._subscribed is completion
                if not given_up:
                    continue
                consumer.close()
                raise
            except BaseException:
                # Nobody gets this consumer: its subscription must not hold messages.
                consumer.close()
                raise
            return consumer

    def create_browser(self, queue: str | Destination) -> Browser:
        """Iterate over the messages waiting on a queue without consuming them (F11)."""
        self._check_open()
        target = parse_destination(queue)
        if target.is_topic:
            raise ConfigurationError(f"only queues can be browsed, not {target}")
        browser = Browser(self, target)
        with self.connection._cond:
            self._browsers.append(browser)
        return browser

    def create_temporary_queue(self) -> Destination:
        """A queue that lives as long as the connection; recreated by name after failover."""
        self._check_open()
        connection = self.connection
        with connection._cond:
            link = connection._admit(connection._failover_deadline())
        destination = link.temporary_queue(None)
        with connection._cond:
            self._temporary.append(destination)
        return destination

    # --- acknowledge and transactions -------------------------------------------------------

    def acknowledge(self) -> None:
        """CLIENT modes: acknowledge every message this session delivered (F8)."""
        self._check_open()
        rules = self.rules
        if not isinstance(rules, ClientAckRules):
            raise IllegalStateError(
                f"acknowledge() is for CLIENT and CLIENT_INDIVIDUAL sessions, "
                f"not {self.ack_mode.value}"
            )
        self._acknowledge_delivery(None)

    def _acknowledge_message(self, message: Message) -> None:
        delivery = message.delivery
        if delivery is None:
            raise IllegalStateError("this message was not received by a session")
        self._check_open()
        self.rules.check_owner(delivery)
        if not isinstance(self.rules, ClientAckRules):
            return  # JMS: acknowledge() is ignored outside CLIENT modes
        self._acknowledge_delivery(delivery)

    def _acknowledge_delivery(self, delivery: Any | None) -> None:
        """Acknowledge ``delivery`` (None: everything this session delivered)."""
        connection = self.connection
        with connection._cond:
            # F1 first: wait out a failover, so that the rules decide with its outcome
            # applied (a session it made dirty raises) and no delivery id of the old link
            # is written on the new one, where it names another message.
            link = connection._admit(connection._failover_deadline())
            rules = self.rules
            if delivery is None:
                assert isinstance(rules, ClientAckRules)
                unacked = rules.unacknowledged
                if not unacked and not rules.dirty:
                    return
                # delivered() re-adds the last tag: harmless, it is already there.
                delivery = rules.delivered(unacked[-1]) if unacked else rules.delivered("")
            held = rules.unacknowledged if isinstance(rules, ClientAckRules) else ()
            decision = rules.acknowledge(delivery)
            if decision.action is AckAction.RAISE:
                # F8: recover implicitly: what was delivered since the failover goes back
                # to the broker too (what came before it went back with the old session).
                if decision.recover:
                    self._give_back(held)
                self._recover_locked(decision)
                assert decision.code is not None
                raise _error_for(
                    decision.code,
                    "the session failed over holding unacknowledged messages; they will be "
                    "redelivered (the session recovered)",
                )
            if decision.action is not AckAction.SEND or not decision.tags:
                return
            completion = SendCompletion(connection, None)
            token = connection._register(_Pending(_KIND_CALL, completion, self, -1))
            try:
                for tag in decision.tags[:-1]:
                    link.acknowledge(self._tag_subscriptions.pop(tag, ""), tag, tx=None, token=None)
                last = decision.tags[-1]
                connection._pending[token].command_id = (
                    connection._window.next_id if link.windowed else -1
                )
                link.acknowledge(self._tag_subscriptions.pop(last, ""), last, tx=None, token=token)
            except HaFailoverError as exc:
                connection._fail_locked(token, AcknowledgeFailedError(f"acknowledge failed: {exc}"))
                connection._io_failed(link, exc)
                # Given up: if a reattach brings them again, they are delivered again.
                self._forget_seen(decision.tags)
        completion.result()

    def recover(self) -> None:
        """Redeliver every unacknowledged message; after a failover this cleans the session."""
        self._check_open()
        if self.transacted:
            raise IllegalStateError("recover() is not for transacted sessions; use rollback()")
        connection = self.connection
        with connection._cond:
            decision = self.rules.recover()
            self._give_back(decision.redeliver)
            for consumer in self._consumers.values():
                consumer._drop_buffer(give_back=True)

    def _recover_locked(self, decision: AckDecision) -> None:
        for consumer in self._consumers.values():
            consumer._drop_buffer(give_back=True)

    def _forget_seen(self, tags: tuple[str, ...]) -> None:
        """Under the lock: deliveries whose acknowledge was given up may come again after a
        reattach (the broker still holds them); let them through when they do."""
        for consumer in self._consumers.values():
            for tag in tags:
                consumer._seen.pop(tag, None)

    def _drop_buffered(self, tags: tuple[str, ...]) -> None:
        """Under the lock: forget buffered copies of these deliveries; they stay seen, so a
        copy still on its way is dropped too."""
        dropped = set(tags)
        for consumer in self._consumers.values():
            kept = [entry for entry in consumer._buffer if entry[1] not in dropped]
            if len(kept) != len(consumer._buffer):
                consumer._buffer.clear()
                consumer._buffer.extend(kept)

    def _give_back(self, tags: tuple[str, ...]) -> None:
        """Under the lock: NACK deliveries so the broker redelivers them."""
        connection = self.connection
        link = connection._link
        if link is None or not connection._machine.is_up:
            return  # the broker redelivers them to the new session anyway
        for tag in tags:
            subscription = self._tag_subscriptions.pop(tag, "")
            if subscription:
                with contextlib.suppress(HaFailoverError):
                    link.redeliver(subscription, tag)

    def commit(self) -> None:
        """Commit the transaction; TransactionRolledBackError if failover made it
        rollback-only (F9), TransactionOutcomeUnknownError if the reply was lost (F3)."""
        self._check_open()
        tx_rules = self._transacted_rules("commit")
        transaction = tx_rules.transaction
        connection = self.connection
        with connection._cond:
            # One lock hold from the decision to reading the work it covers: a failover
            # applied in between would roll the work back behind the commit's back.
            decision = transaction.begin_commit()
            # The commit belongs to this link: if a failover replaces it before the commit
            # is written, the transaction rules decide its fate (it never moves links).
            self._commit_link = getattr(connection._link, "serial", 0)
            if decision.action is CommitAction.ROLL_BACK_AND_RAISE:
                self._tx_sends = []
                received = tx_rules.received_in_transaction()
                tx_rules.transaction_ended()
                handle = self._take_tx()
            else:
                handle = self._tx
                received = tx_rules.received_in_transaction()
        if decision.action is CommitAction.ROLL_BACK_AND_RAISE:
            self._end_on_broker(handle, commit=False, received=received, quiet=True)
            raise TransactionRolledBackError(
                "the transaction was rolled back: a failover made it rollback-only; "
                "replay its work and commit again"
            )
        with connection._cond:
            stale = handle is not None and self._tx_link != getattr(
                connection._link, "serial", None
            )
            caught = transaction.phase is not TxPhase.COMMITTING
        if caught:
            # A failover applied since the decision caught the commit: it decided.
            self._end_interrupted_commit(tx_rules, None, received)
        with connection._cond:
            if (handle is None and not received) or stale:
                transaction.commit_finished()
                tx_rules.transaction_ended()
                self._tx = None
                if stale:
                    # The transaction's link is gone and no failover rule caught it: never
                    # report a commit that did not happen.
                    raise TransactionRolledBackError(
                        "the transaction was lost with its connection; replay its work"
                    )
                return
        try:
            if handle is None:
                # Only received so far: the acknowledges go in a transaction of their own.
                handle = self._ensure_tx()
            self._settle_transfers()
            self._end_on_broker(handle, commit=True, received=received, quiet=False)
        except (
            UnblockedError,
            TransactionOutcomeUnknownError,
            CallTimeoutError,
            DisconnectedError,
        ) as exc:
            # No answer came: the connection was lost (failed over or not, yet or for good)
            # or the call timed out. Only whether the commit was written says what may have
            # happened; never report as rolled back a commit the broker may have done.
            self._end_interrupted_commit(tx_rules, exc, received)
        except TransactionRolledBackError:
            raise  # a refused send of the transaction: rolled back already
        except RemoteError as exc:
            with connection._cond:
                transaction.commit_finished()
                tx_rules.transaction_ended()
                self._tx = None
            raise TransactionRolledBackError(f"the broker refused the commit: {exc}") from exc
        with connection._cond:
            transaction.commit_finished()
            tx_rules.transaction_ended()
            self._tx = None

    def _end_interrupted_commit(
        self, tx_rules: TransactedAckRules, exc: BaseException | None, received: tuple[str, ...]
    ) -> NoReturn:
        """End a commit that got no answer and raise what may have happened. A commit never
        written on a link that lives on (it timed out, or a reattach kept the transaction)
        is rolled back on the broker too, or the broker keeps its batch."""
        transaction = tx_rules.transaction
        with self.connection._cond:
            timed_out = isinstance(exc, CallTimeoutError)
            unwritten = transaction.phase is TxPhase.COMMITTING
            fate = transaction.commit_interrupted()
            undo = (timed_out and unwritten) or fate.rollback_on_broker
            handle = self._take_tx() if undo else None
            error = self._interrupted_error(fate, exc)
            tx_rules.transaction_ended()
            self._tx = None
            if undo:
                # Given back below: the broker delivers them anew, under new ids. A copy a
                # reattach resent under the old ids is stale: never hand it out.
                self._drop_buffered(received)
        if undo:
            self._end_on_broker(handle, commit=False, received=received, quiet=True)
        raise error from None

    @staticmethod
    def _interrupted_error(fate: CommitDecision, exc: BaseException | None) -> HaFailoverError:
        """What an interrupted commit raises: rolled back (never written), outcome unknown,
        or, once the connection is lost for good, DisconnectedError (F2) saying which."""
        rolled_back = fate.code is ErrorCode.TRANSACTION_ROLLED_BACK
        timed_out = isinstance(exc, CallTimeoutError)
        if isinstance(exc, DisconnectedError):
            outcome = (
                "the transaction was rolled back"
                if rolled_back
                else "the commit was sent and may or may not have happened"
            )
            return DisconnectedError(f"{exc}; {outcome}")
        if rolled_back:
            why = "timed out" if timed_out else "lost its connection"
            return TransactionRolledBackError(
                f"the commit {why} before it reached the broker; the transaction was rolled back"
            )
        why = "timed out" if timed_out else "its connection was lost"
        return TransactionOutcomeUnknownError(
            f"the commit was sent but {why} before the broker answered; it may or may "
            "not have happened (retry with the same duplicate ids to be safe)"
        )

    def rollback(self) -> None:
        """Roll the transaction back; always succeeds and cleans the session (F9)."""
        self._check_open()
        tx_rules = self._transacted_rules("rollback")
        connection = self.connection
        with connection._cond:
            decision = tx_rules.transaction.rollback()
            handle, received = self._end_transaction_locked(
                tx_rules, on_broker=decision.rollback_on_broker
            )
        self._end_on_broker(handle, commit=False, received=received, quiet=True)

    def _end_transaction_locked(
        self, tx_rules: TransactedAckRules, *, on_broker: bool
    ) -> tuple[object, tuple[str, ...]]:
        """Under the lock, for a rollback: forget the transaction's work and prefetched
        messages; return the broker's transaction to roll back (None: nothing to send)
        and the deliveries to give back."""
        self._tx_sends = []
        received = tx_rules.received_in_transaction()
        tx_rules.transaction_ended()
        handle = self._take_tx() if on_broker else None
        for consumer in self._consumers.values():
            consumer._drop_buffer(give_back=True)
        return handle, received

    def _settle_transfers(self) -> None:
        """AMQP: every transfer of the transaction settled by the broker before the
        discharge; a refused one fails the commit (the transaction is rolled back)."""
        sends, self._tx_sends = self._tx_sends, []
        for completion in sends:
            try:
                completion.result()
            except UnblockedError:
                raise
            except RemoteError as exc:
                # The commit is abandoned before its discharge: roll back, as rollback()
                # would (which refuses to run while a commit is running).
                tx_rules = self._transacted_rules("commit")
                with self.connection._cond:
                    tx_rules.transaction.commit_finished()
                    handle, received = self._end_transaction_locked(tx_rules, on_broker=True)
                self._end_on_broker(handle, commit=False, received=received, quiet=True)
                raise TransactionRolledBackError(
                    f"the broker refused a send of the transaction, which was rolled back: {exc}"
                ) from exc

    def _take_tx(self) -> object:
        handle, self._tx = self._tx, None
        if self._tx_link != getattr(self.connection._link, "serial", None):
            return None  # the transaction died with its link
        return handle

    def _end_on_broker(
        self, handle: object, *, commit: bool, received: tuple[str, ...], quiet: bool
    ) -> None:
        """Acknowledge what was received inside the transaction, then commit or roll back."""
        connection = self.connection
        if handle is None:
            if not commit:
                with connection._cond:
                    self._give_back(received)
            return
        completion = SendCompletion(connection, None)
        with connection._cond:
            link = connection._admit(connection._failover_deadline())
            if self._tx_link != link.serial or (commit and link.serial != self._commit_link):
                # The transaction died with its link while this call waited for the
                # failover: a commit learns its fate from the transaction rules (F3, F9).
                if commit:
                    raise UnblockedError("the transaction's connection failed over")
                self._give_back(received)
                return
            settled: list[SendCompletion] = []
            if commit:
                for tag in received:
                    ack_token = None
                    if link.settles_transacted_work:
                        # The discharge must not overtake these dispositions.
                        ack = SendCompletion(connection, None)
                        ack_token = connection._register(_Pending(_KIND_CALL, ack, self, -1))
                        settled.append(ack)
                    link.acknowledge(
                        self._tag_subscriptions.get(tag, ""), tag, tx=handle, token=ack_token
                    )
            token = connection._register(_Pending(_KIND_CALL, completion, self, -1))
            connection._pending[token].command_id = (
                connection._window.next_id if link.windowed else -1
            )
            self._committing = commit
            blocking = link.calls_block
            if not blocking:
                try:
                    link.end(handle, commit=commit, token=token)
                except HaFailoverError as exc:
                    connection._io_failed(link, exc)
                if commit:
                    self.rules.transaction.commit_written()  # type: ignore[attr-defined]
        try:
            if blocking:
                for ack in settled:
                    ack.result()
                if commit:
                    with connection._cond:
                        self.rules.transaction.commit_written()  # type: ignore[attr-defined]
                link.end(handle, commit=commit, token=token)
            completion.result()
        except HaFailoverError:
            if quiet:
                return
            raise
        finally:
            with connection._cond:
                self._committing = False
                if not commit:
                    self._give_back(received)
                else:
                    for tag in received:
                        self._tag_subscriptions.pop(tag, None)

    def _transacted_rules(self, what: str) -> TransactedAckRules:
        if not isinstance(self.rules, TransactedAckRules):
            raise IllegalStateError(
                f"{what}() needs a transacted session; this one is {self.ack_mode.value}"
            )
        return self.rules

    def _ensure_tx(self) -> object:
        """The broker transaction for the current work, begun on first use."""
        connection = self.connection
        deadline = connection._failover_deadline()
        while True:
            with connection._cond:
                link = connection._admit(deadline)
                if self._tx is not None and self._tx_link == link.serial:
                    return self._tx
                if not link.calls_block:
                    try:
                        self._tx = link.begin()
                    except (NotConnectedError, UnblockedError) as exc:
                        connection._io_failed(link, exc)
                        continue  # F1: wait for the failover; its rules decide the work's fate
                    self._tx_link = link.serial
                    return self._tx
            try:
                handle = link.begin()  # AMQP declare waits for the broker: outside the lock
            except (NotConnectedError, UnblockedError) as exc:
                connection._io_failed(link, exc)
                continue
            with connection._cond:
                if self._tx is None or self._tx_link != link.serial:
                    self._tx = handle
                    self._tx_link = link.serial
                return self._tx

    # --- failover ---------------------------------------------------------------------------

    def _failed_over(
        self,
        *,
        reattached: bool,
        commit_received: bool | None,
        replayed: tuple[int, ...] = (),
        resent: tuple[str, ...] = (),
        in_doubt: tuple[str, ...] = (),
    ) -> SessionFailover:
        """Under the lock: the ack-mode and transaction rules of F6-F9 for this session."""
        rules = self.rules
        rolled_back = False
        if isinstance(rules, TransactedAckRules):
            phase_before = rules.transaction.phase
            outcome = rules.failover(reattached=reattached)
            if commit_received is not None:
                # failover() above decided with commit_received unknown; a reattach tells more.
                pass
            rolled_back = outcome.dirty and phase_before.value != "clean"
            if not reattached:
                self._tx = None
                self._tx_sends = []
        else:
            outcome = rules.failover(reattached=reattached)
        if outcome.discard_prefetched:
            for consumer in self._consumers.values():
                consumer._drop_buffer(give_back=False)
            self._tag_subscriptions.clear()
        if not reattached:
            for browser in self._browsers:
                browser._invalidate()
        return SessionFailover(
            session_id=self.session_id,
            replayed=replayed,
            resent=resent,
            in_doubt=in_doubt,
            stale_acks=outcome.stale,
            rolled_back=rolled_back,
            dirty=outcome.dirty,
        )

    def _wake_browsers(self) -> None:
        for browser in self._browsers:
            browser._invalidate()

    # --- listener dispatch ------------------------------------------------------------------

    def _start_dispatcher(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(
                target=self._dispatch_loop,
                name=f"hafailover-session-{self.session_id}",
                daemon=True,
            )
            self._dispatcher.start()

    def _dispatch_loop(self) -> None:
        connection = self.connection
        while True:
            with connection._cond:
                item = None
                while item is None:
                    if self._closed:
                        return
                    if connection._started and connection._machine.is_up:
                        for consumer in self._consumers.values():
                            if consumer._listener is not None and consumer._buffer:
                                item = (consumer, consumer._take())
                                if item[1] is not None:
                                    break
                                item = None
                    if item is None:
                        connection._cond.wait(0.5)
            try:
                self._confirm_last_ack()
            except HaFailoverError as exc:
                connection._notify_all(None, exc)
            consumer, message = item
            listener = consumer._listener
            assert message is not None
            assert listener is not None
            try:
                listener(message)
            except Exception:
                log.exception("a message listener raised; the message counts as delivered")
            try:
                consumer._after_delivery(message)
            except HaFailoverError as exc:
                connection._notify_all(None, exc)  # F6: a listener's ack failure is reported

    def _confirm_last_ack(self) -> None:
        """AUTO: the previous delivery's acknowledge must be confirmed before the next one."""
        completion, self._auto_ack = self._auto_ack, None
        if completion is None:
            return
        try:
            completion.result()
        except (UnblockedError, NotConnectedError, CallTimeoutError) as exc:
            raise AcknowledgeFailedError(
                f"the acknowledge of the previous message was not confirmed ({exc}); "
                "that message may be delivered again"
            ) from exc

    def _join(self) -> None:
        thread = self._dispatcher
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)

    def close(self) -> None:
        """Close the session: its consumers stop, an open transaction rolls back."""
        connection = self.connection
        with connection._cond:
            if self._closed:
                return
            transacted_work = isinstance(self.rules, TransactedAckRules) and self._tx is not None
        if transacted_work and not connection._closing:
            with contextlib.suppress(HaFailoverError):
                self.rollback()
        for consumer in list(self._consumers.values()):
            with contextlib.suppress(HaFailoverError):
                consumer.close()
        with connection._cond:
            self._closed = True
            connection._sessions.pop(self.session_id, None)
            connection._cond.notify_all()
        self._join()


# --- producers -----------------------------------------------------------------------------


class Producer:
    """Sends messages; pipelined through the confirmation window."""

    def __init__(self, session: Session, destination: Destination | None, confirm: bool) -> None:
        self.session = session
        self.destination = destination
        self.confirm = confirm
        self._outstanding = 0

    def send(
        self,
        message: Message | bytes | str,
        *,
        destination: str | Destination | None = None,
        headers: Mapping[str, PropertyValue] | None = None,
        persistent: bool | None = None,
        priority: int | None = None,
        time_to_live: float | None = None,
    ) -> Message:
        """Send and, for a persistent message, wait until the broker has it (F1, F3)."""
        completion = self._send(
            message, destination, headers, persistent, priority, time_to_live, receipt=True
        )
        completion.result()
        assert completion.message is not None
        return completion.message

    def send_async(
        self,
        message: Message | bytes | str,
        *,
        destination: str | Destination | None = None,
        headers: Mapping[str, PropertyValue] | None = None,
        persistent: bool | None = None,
        priority: int | None = None,
        time_to_live: float | None = None,
    ) -> SendCompletion:
        """Send without waiting; the completion tells when the broker confirmed it."""
        return self._send(
            message, destination, headers, persistent, priority, time_to_live, receipt=False
        )

    def _send(
        self,
        message: Message | bytes | str,
        destination: str | Destination | None,
        headers: Mapping[str, PropertyValue] | None,
        persistent: bool | None,
        priority: int | None,
        time_to_live: float | None,
        *,
        receipt: bool,
    ) -> SendCompletion:
        session = self.session
        session._check_open()
        target = self.destination if destination is None else parse_destination(destination)
        if target is None:
            raise IllegalStateError("this producer has no destination: pass destination=")
        msg = _as_message(message, headers, persistent, priority, time_to_live)
        size = msg.size()
        if size > MAX_MESSAGE_BYTES:
            raise MessageTooLargeError(
                f"a message of {size} bytes is larger than the {MAX_MESSAGE_BYTES} bytes allowed"
            )
        connection = session.connection
        transacted = session.transacted
        tx = session._ensure_tx() if transacted else None
        confirm = self.confirm and msg.persistent and not transacted
        completion = SendCompletion(connection, msg)
        with connection._cond:
            while True:
                link = connection._wait_window_room(size, connection._failover_deadline())
                if transacted:
                    rules = session.rules
                    assert isinstance(rules, TransactedAckRules)
                    if rules.transaction.rollback_only:
                        # F9: the transaction is doomed; commit() will roll back and raise.
                        rules.transaction.work()
                        completion._finish(None)
                        return completion
                    if session._tx_link != link.serial:
                        # A failover replaced the link after this send's transaction was
                        # begun, before any of its work was written (else it would be
                        # rollback-only): begin it again on the new link and send there.
                        connection._cond.release()
                        try:
                            tx = session._ensure_tx()
                        finally:
                            connection._cond.acquire()
                        continue
                    rules.transaction.work()
                token = None
                transfer: SendCompletion | None = None
                if confirm:
                    token = connection._register(
                        _Pending(
                            _KIND_SEND,
                            completion,
                            session,
                            -1,
                            destination=target,
                            producer=self,
                            resendable=connection.policy.duplicate_detection,
                            size=0 if link.windowed else size,
                        )
                    )
                    self._outstanding += 1
                    if not link.windowed:
                        connection._unconfirmed_bytes += size
                elif transacted and link.settles_transacted_work:
                    # The broker settles each transactional transfer; the discharge
                    # must wait for them, or it can overtake transfers still waiting for
                    # a new sender link's credit (and commit without them). The send itself
                    # completes at once, as every transacted send does: commit() waits.
                    transfer = SendCompletion(connection, msg)
                    token = connection._register(
                        _Pending(_KIND_CALL, transfer, session, -1, destination=target)
                    )
                    session._tx_sends.append(transfer)
                cumulative = token is not None and link.windowed
                ask = not cumulative or receipt or connection._unreceipted >= RECEIPT_EVERY - 1
                try:
                    command_id = link.send(target, msg, tx=tx, token=token if ask else None)
                except HaFailoverError as exc:
                    if not isinstance(exc, NotConnectedError | UnblockedError):
                        # Not the link's fault (a message this protocol cannot carry):
                        # nothing was sent, the connection is fine, the caller hears why.
                        if token is not None:
                            connection._finish_locked(token, exc)
                        if transfer is not None:
                            session._tx_sends.remove(transfer)
                        raise
                    connection._io_failed(link, exc)
                    if transacted:
                        # The transaction is doomed by the failover (F9): commit() says so.
                        completion._finish(None)
                        return completion
                    if token is not None:
                        # The pending send stays: the failover resends it or releases it.
                        return completion
                    continue  # unconfirmed: send again on the next link (stop the world)
                connection._sent += 1
                if token is not None:
                    pending = connection._pending.get(token)
                    if pending is not None:
                        pending.command_id = command_id
                        if cumulative:
                            pending.cumulative = True
                            connection._receipt_order.append(token)
                            connection._unreceipted = 0 if ask else connection._unreceipted + 1
                if not confirm:
                    completion._finish(None)
                return completion

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every send_async of this producer has completed."""
        self.session.connection._wait_until(
            lambda: self._outstanding <= 0,
            timeout,
            lambda: f"{self._outstanding} send(s) still unconfirmed after the timeout",
        )

    def close(self) -> None:
        self.flush()


def _as_message(
    message: Message | bytes | str,
    headers: Mapping[str, PropertyValue] | None,
    persistent: bool | None,
    priority: int | None,
    time_to_live: float | None,
) -> Message:
    if isinstance(message, Message):
        if headers is not None:
            message.properties = {**message.properties, **headers}
        if persistent is not None:
            message.persistent = persistent
        if priority is not None:
            message.priority = priority
        if time_to_live is not None:
            message.time_to_live = time_to_live
        attrs.validate(message)
        return message
    if headers is None and priority is None and time_to_live is None:
        return Message.of_body(message, persistent=True if persistent is None else persistent)
    if not isinstance(message, bytes | str):
        raise ConfigurationError(
            f"a message body must be bytes or str (or a Message), not {type(message).__name__}"
        )
    return Message(
        body=message,
        properties=dict(headers or {}),
        persistent=True if persistent is None else persistent,
        priority=4 if priority is None else priority,
        time_to_live=time_to_live,
    )


# --- consumers -----------------------------------------------------------------------------


class Consumer:
    """Receives from one destination, with receive() or a message listener."""

    def __init__(
        self,
        session: Session,
        subscription: str,
        destination: Destination,
        prefetch: int,
        selector: str | None = None,
    ) -> None:
        self.session = session
        self.selector = selector
        self.subscription = subscription
        self.destination = destination
        self.prefetch = prefetch
        self._buffer: collections.deque[tuple[int, str, Message]] = collections.deque()
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._listener: Callable[[Message], None] | None = None
        self._closed = False
        self._on_link = 0  # serial of the link this consumer is subscribed on
        self._subscribed: SendCompletion | None = None  # the broker's answer to subscribing

    @property
    def _acknowledged(self) -> bool:
        return self.session.ack_mode is not AckMode.NO_ACKNOWLEDGE

    def _subscribe_on(self, link: Link) -> None:
        """Under the lock for STOMP; AMQP's subscribe blocks, so it is called without it.

        Once per link: a consumer created during a failover is subscribed either by the
        failover's recreation or by its own creation, whichever comes first."""
        if self._on_link == link.serial:
            return
        self._on_link = link.serial
        try:
            self._subscribe_now(link)
        except BaseException:
            self._on_link = 0
            raise

    def _subscribe_now(self, link: Link) -> None:
        connection = self.session.connection
        completion = SendCompletion(connection, None)
        token = connection._register(
            _Pending(_KIND_CALL, completion, self.session, -1, consumer=self)
        )
        self._subscribed = completion
        if link.calls_block:
            self.session.connection._cond.release()
            try:
                link.subscribe(
                    self.subscription,
                    self.destination,
                    acknowledged=self._acknowledged,
                    prefetch=self.prefetch,
                    selector=self.selector,
                    token=token,
                )
            finally:
                self.session.connection._cond.acquire()
            return
        # Its place in the confirmation window: a reattach whose server got the SUBSCRIBE
        # completes it even when the receipt was lost with the connection.
        connection._pending[token].command_id = connection._window.next_id if link.windowed else -1
        link.subscribe(
            self.subscription,
            self.destination,
            acknowledged=self._acknowledged,
            prefetch=self.prefetch,
            selector=self.selector,
            token=token,
        )

    def _arrived(self, tag: str, message: Message) -> None:
        """Under the lock, from the transport: buffer a delivery (dropping reattach repeats)."""
        if self._closed:
            return
        seen = self._seen
        if tag in seen:
            return  # resent after a reattach while we still hold it
        seen[tag] = None
        if len(seen) > 4 * self.prefetch + 1000:
            seen.popitem(last=False)
        self._buffer.append((self.session.rules.generation, tag, message))
        connection = self.session.connection
        connection._cond.notify_all()

    def _take(self) -> Message | None:
        """Under the lock: the next deliverable message, registered with the ack rules."""
        session = self.session
        rules = session.rules
        while self._buffer:
            generation, tag, message = self._buffer.popleft()
            if generation != rules.generation:
                continue  # prefetched before a reconnect: the broker sends it again
            message.delivery = rules.delivered(tag)
            message._acknowledger = session._acknowledge_message
            session._tag_subscriptions[tag] = self.subscription
            session.connection._received += 1
            return message
        return None

    def _after_delivery(self, message: Message) -> None:
        """The automatic acknowledge of AUTO / DUPS_OK (F6, F7)."""
        session = self.session
        connection = session.connection
        with connection._cond:
            decision = session.rules.after_delivery(message.delivery)
            if decision.action is AckAction.SEND:
                link = connection._link
                if link is None or not connection._machine.is_up:
                    # Given up: if a reattach brings it again, it is delivered again.
                    session._forget_seen(decision.tags)
                    if session.ack_mode is AckMode.DUPS_OK:
                        return  # F7: silent; the broker may deliver it again
                    raise AcknowledgeFailedError(
                        "the acknowledge could not be sent: the connection is failing over; "
                        "the message may be delivered again"
                    )
                # AUTO confirms each acknowledge before the next delivery (F6: only the
                # last delivered message may come again); DUPS_OK does not wait (F7).
                confirm = session.ack_mode is AckMode.AUTO
                for tag in decision.tags:
                    subscription = session._tag_subscriptions.pop(tag, self.subscription)
                    token = None
                    if confirm:
                        completion = SendCompletion(connection, None)
                        token = connection._register(_Pending(_KIND_CALL, completion, session, -1))
                        connection._pending[token].command_id = (
                            connection._window.next_id if link.windowed else -1
                        )
                        session._auto_ack = completion
                    try:
                        link.acknowledge(subscription, tag, tx=None, token=token)
                    except HaFailoverError as exc:
                        connection._io_failed(link, exc)
                        session._forget_seen(decision.tags)
                        if session.ack_mode is AckMode.DUPS_OK:
                            return  # F7: silent
                        raise AcknowledgeFailedError(
                            f"the acknowledge could not be sent ({exc}); the message may be "
                            "delivered again"
                        ) from exc
                    self._seen.pop(tag, None)
            elif decision.action is AckAction.RAISE:
                assert decision.code is not None
                raise _error_for(
                    decision.code,
                    "the message was delivered before a failover and its acknowledge could "
                    "not be sent; it may be delivered again",
                )

    def _drop_buffer(self, *, give_back: bool) -> None:
        """Under the lock: forget prefetched messages (and NACK them if the link lives)."""
        buffered = [tag for _, tag, _ in self._buffer]
        self._buffer.clear()
        if give_back and buffered:
            session = self.session
            for tag in buffered:
                session._tag_subscriptions[tag] = self.subscription
            session._give_back(tuple(buffered))
        self._seen.clear()

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (None: forever); None when
        none came. Waits through failover (F1)."""
        session = self.session
        session._check_open()
        if self._listener is not None:
            raise IllegalStateError(
                "this consumer has a message listener; receive() is not allowed"
            )
        connection = session.connection
        deadline = None if timeout is None else time.monotonic() + timeout
        session._confirm_last_ack()
        with connection._cond:
            while True:
                if self._closed or session._closed:
                    raise ConnectionClosedError("the consumer is closed")
                admission, code = connection._machine.admit()
                if admission is Admission.RAISE and not self._buffer:
                    assert code is not None
                    raise _error_for(code, f"the connection is {connection._machine.state.value}")
                if connection._started and self._buffer and connection._machine.is_up:
                    message = self._take()
                    if message is not None:
                        break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                connection._cond.wait(remaining if remaining is not None else 1.0)
        self._after_delivery(message)
        return message

    def receive_no_wait(self) -> Message | None:
        return self.receive(0)

    def set_message_listener(self, listener: Callable[[Message], None] | None) -> None:
        """Deliver messages to ``listener`` on the session's thread instead of receive()."""
        with self.session.connection._cond:
            self._listener = listener
            if listener is not None:
                self.session._start_dispatcher()

    def close(self) -> None:
        """Stop the subscription; prefetched messages go back to the broker."""
        session = self.session
        connection = session.connection
        with connection._cond:
            if self._closed:
                return
            self._closed = True
            self._drop_buffer(give_back=True)
            session._consumers.pop(self.subscription, None)
            link = connection._link
            if link is not None and connection._machine.is_up:
                with contextlib.suppress(HaFailoverError):
                    link.unsubscribe(self.subscription)
            connection._cond.notify_all()

    def __iter__(self) -> Iterator[Message]:
        """Messages as they come, forever (use receive() for a timeout)."""
        while True:
            message = self.receive()
            if message is not None:
                yield message


# --- browsers ------------------------------------------------------------------------------


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
