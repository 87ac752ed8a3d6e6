"""The serving core of an active node, shared by the STOMP and AMQP servers.

It owns what both protocols need from one running node: the engine, the store, the users,
the routing of the engine's deliveries to the connection that owns each consumer, the
sessions held for reattach (F4) and the topology announced to clients (F12). Everything
here runs on the node's one asyncio event loop, so nothing is locked: a protocol handler
calls the engine, then ``kick()``; at the end of the loop turn the core dispatches what
the engine has for consumers and hands new records to the store in one group commit.

Clocks: the engine's ``now`` is wall-clock time (``time.time()``), because message
expiration is an absolute time that clients set (STOMP ``expires``, AMQP
absolute-expiry-time). Held sessions expire by the monotonic clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

import attrs

from reference_broker.engine import Delivery, Engine
from reference_broker.store import Store
from reference_broker.users import UsersFile, login_guard

__all__ = ["BrokerCore", "DeliveryTarget", "HeldSession", "ServeConfig"]

log = logging.getLogger(__name__)


class DeliveryTarget(Protocol):
    """A connection that writes deliveries for the consumers it opened."""

    def deliver(self, delivery: Delivery) -> None: ...


class HeldSession(Protocol):
    """A session whose connection dropped, kept for a reattach until its TTL passes."""

    def expire(self) -> None:
        """The TTL passed: end the session for good."""


# The same as the client's MAX_MESSAGE_BYTES: what a hafailover producer lets through (its
# measure counts headers too, so it is the stricter), a default broker accepts.
DEFAULT_MAX_MESSAGE_SIZE: Final = 64 * 1024 * 1024
# Well under what a node's file descriptors allow once raised from the usual 1024.
DEFAULT_MAX_CONNECTIONS: Final = 10_000


@attrs.frozen
class ServeConfig:
    node_id: str = "live"
    # Client addresses announced to clients, this node first: {"stomp": ("h:p", ...), ...}.
    topology: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    # Announce the topology with hafailover's own keys too, beside the standard AMQP
    # failover-server-list (docs/protocol-topology.md); off only to test other clients' view.
    topology_extension: bool = True
    # Heart-beat the server offers and wants, in seconds (STOMP heart-beat, AMQP idle-timeout).
    heartbeat: float = 1.0
    # Longest a dropped session is held for reattach, whatever the client asks.
    max_connection_ttl: float = 300.0
    allow_anonymous: bool = False
    # AMQP: a durable message's message-id is its duplicate id when it has no _AMQ_DUPL_ID
    # (off: producers that reuse message-ids would lose messages; docs/security.md).
    amqp_message_id_duplicates: bool = False
    # The largest message body a client may send on either protocol (--max-message-size).
    max_body_size: int = DEFAULT_MAX_MESSAGE_SIZE
    # Client connections the node serves at once (0: no cap): in all, every accepted socket,
    # logged in or not; per user, the logged-in ones. One more is refused with the cap
    # named (--max-connections, --max-connections-per-user).
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_user: int = 0
    # Unsettled deliveries a client-acknowledge consumer may hold unless it asks otherwise.
    default_prefetch: int = 1000


def _log_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("a batch was not confirmed: %s", future.exception())


class BrokerCore:
    """One active node's engine, store, users and connections."""

    def __init__(
        self,
        engine: Engine,
        store: Store,
        users: UsersFile,
        config: ServeConfig,
        *,
        may_serve: Callable[[], bool] = lambda: True,
    ) -> None:
        self.engine = engine
        self.store = store
        self.users = users
        self.config = config
        self.may_serve = may_serve
        self._targets: dict[int, DeliveryTarget] = {}
        self._held: dict[str, tuple[float, HeldSession]] = {}
        self._kicked = False
        self._ticker: asyncio.Task[None] | None = None
        self._next_session = 0
        self._sockets: set[object] = set()  # accepted client connections, logged in or not
        self._admitted: dict[object, str | None] = {}  # logged-in connection -> its user
        self._at_cap = False  # refusing at --max-connections (logged once each time)
        self.refused_connections = 0
        self._blocked: dict[str, list[asyncio.Future[None]]] = {}  # address -> held producers
        self._per_user: dict[str | None, int] = {}

    # --- connection caps -------------------------------------------------------------------

    def accept(self, connection: object) -> str | None:
        """A socket was accepted: count it against --max-connections from now on, logged in
        or not, so that a flood of sockets that never log in is bounded too. None, or why
        it is refused (the server says so and closes it)."""
        config = self.config
        if config.max_connections and len(self._sockets) >= config.max_connections:
            self.refused_connections += 1
            if not self._at_cap:
                self._at_cap = True
                log.warning(
                    "%d client connections (--max-connections): refusing new ones",
                    config.max_connections,
                )
            return (
                f"too many connections: this node serves at most {config.max_connections} "
                "(--max-connections)"
            )
        self._sockets.add(connection)
        return None

    def admit(self, connection: object, user: str | None) -> str | None:
        """``connection`` logged in as ``user``: count it against the per-user cap. None, or
        why it is refused."""
        if connection not in self._sockets:
            refused = self.accept(connection)  # a connection the listener did not count
            if refused is not None:
                return refused
        config = self.config
        per_user = self._per_user.get(user, 0)
        if config.max_connections_per_user and per_user >= config.max_connections_per_user:
            return (
                f"too many connections for user {user!r}: at most "
                f"{config.max_connections_per_user} each (--max-connections-per-user)"
            )
        self._admitted[connection] = user
        self._per_user[user] = per_user + 1
        return None

    def release(self, connection: object) -> None:
        """``connection`` ended, or is being closed: it no longer counts (nothing if it
        never did; a second call does nothing)."""
        self._sockets.discard(connection)
        if self._at_cap and len(self._sockets) < self.config.max_connections:
            self._at_cap = False
        if connection not in self._admitted:
            return
        user = self._admitted.pop(connection)
        left = self._per_user[user] - 1
        if left:
            self._per_user[user] = left
        else:
            del self._per_user[user]

    @property
    def connections(self) -> int:
        """Client connections counted against --max-connections: every socket accepted and
        not yet closed, logged in or not."""
        return len(self._sockets)

    # --- the loop turn ---------------------------------------------------------------------

    def kick(self) -> None:
        """Something changed in the engine: dispatch and persist at the end of this turn."""
        if not self._kicked:
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self._kicked = False
        self.dispatch()
        self._wake_blocked()
        if self.engine.dispatch_pending:
            self.kick()  # the rest after the loop has written (and read) what is due
        records = self.engine.drain_records()
        if records:
            # Nobody waits on this batch (receipts wait on durable()), but a failure must
            # still be looked at, or asyncio reports it as never retrieved.
            future = self.store.persist([r.encode() for r in records])
            future.add_done_callback(_log_failure)

    # --- producers held by a full address (policy BLOCK) ------------------------------------

    def wait_for_room(self, address: str) -> asyncio.Future[None]:
        """A future that resolves once ``address``, which held a send back, has room again
        (acknowledgements, expiry or a deletion made it); cancel it to stop waiting."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = [f for f in self._blocked.get(address, ()) if not f.done()]  # drop the ended
        waiting.append(future)
        self._blocked[address] = waiting
        return future

    def _wake_blocked(self) -> None:
        for address in self.engine.drain_freed():
            for future in self._blocked.pop(address, ()):
                if not future.done():
                    future.set_result(None)

    def dispatch(self) -> None:
        targets = self._targets
        for delivery in self.engine.poll(time.time()):
            target = targets.get(delivery.consumer_id)
            if target is not None:
                target.deliver(delivery)
            else:  # pragma: no cover - a consumer is registered before it can receive
                log.error("delivery for unknown consumer %d dropped", delivery.consumer_id)

    def durable(self) -> asyncio.Future[None]:
        """A future that resolves when everything the engine did so far is durable."""
        records = self.engine.drain_records()
        return self.store.persist([r.encode() for r in records])

    # --- consumers -------------------------------------------------------------------------

    def add_target(self, consumer_id: int, target: DeliveryTarget) -> None:
        self._targets[consumer_id] = target

    def remove_target(self, consumer_id: int) -> None:
        self._targets.pop(consumer_id, None)

    # --- security --------------------------------------------------------------------------

    async def authenticate(self, user: str | None, password: str | None, peer: str) -> bool:
        """A client's login, the one path for both protocols: through the node's login guard
        (reference_broker.users.LoginGuard: off the loop, throttled), anonymous only with
        allow_anonymous. A refusal is logged there with the user and ``peer``."""
        return await login_guard(self.users).authenticate(
            user, password, peer, allow_anonymous=self.config.allow_anonymous
        )

    # --- sessions held for reattach --------------------------------------------------------

    def new_session_id(self) -> str:
        self._next_session += 1
        return f"{self.config.node_id}-{time.time_ns():x}-{self._next_session}"

    def hold_session(self, session_id: str, session: HeldSession, ttl: float) -> None:
        ttl = min(ttl, self.config.max_connection_ttl)
        self._held[session_id] = (time.monotonic() + ttl, session)
        self._ensure_ticker()

    def claim_session(self, session_id: str) -> HeldSession | None:
        held = self._held.pop(session_id, None)
        return None if held is None else held[1]

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.tick()

    def tick(self) -> None:
        """Expire held sessions, held temporary queues and expired messages."""
        now = time.monotonic()
        for session_id, (deadline, session) in list(self._held.items()):
            if deadline <= now:
                del self._held[session_id]
                session.expire()
        wall = time.time()
        self.engine.tick(wall)
        if self.engine.expire(wall):
            self.kick()
        self.kick()

    def start(self) -> None:
        self._ensure_ticker()

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
