"""What both protocols share: the ``Link`` the driver drives, the value an open returns and
the topology announcement.

A link is one connection to one broker as the driver sees it (``stomp.link.StompLink``,
``amqp.link.AmqpLink``): it turns the driver's operations (send, subscribe, acknowledge,
transactions, temporary queues) into that protocol's frames or calls, through the protocol's
transport (``stomp.transport``, ``amqp.transport``). It owns no failover logic: it never
retries, never waits for a lost connection, and says nothing about what a failure means.
Events come back to the driver through ``LinkEvents``, tagged with the link so that a late
event of a link the driver has replaced is ignored there. Calls marked *blocking* wait for
the broker and must be made without the driver's lock held (the AMQP reader thread calls back
into the driver). The others never write to the socket: they queue bytes in the link's
outbox and ask the driver, through ``LinkEvents.link_output``, to flush it once its lock is
released.

Pure: no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Final, Protocol

import attrs

from hafailover.core.subscriptions import NamedSubscription
from hafailover.core.window import ConfirmationWindow
from hafailover.destination import Destination
from hafailover.errors import ProtocolError, RemoteError
from hafailover.message import Message
from hafailover.url import BrokerAddress, FailoverPolicy

__all__ = [
    "LINK_SERIALS",
    "Link",
    "LinkEvents",
    "LinkFactory",
    "Opened",
    "TlsOptions",
    "detects_duplicates",
    "parse_failover_server_list",
    "parse_topology",
]

# Brokers known to drop a message whose duplicate id they have stored (DESIGN F13), by the
# prefix of the name they give in STOMP's CONNECTED ``server`` header or AMQP's ``product``
# open property. Any other broker is taken not to: a retry could store twice there.
_DETECTS_DUPLICATES: Final = (
    "hafailover-reference-broker",
    "activemq-artemis",
    "apache-activemq-artemis",
)


@attrs.frozen
class TlsOptions:
    """How a TLS link checks the broker and shows itself (the URL's ssl_* options)."""

    ca_file: str | None = None  # the CAs that verify the broker; None: the system's
    cert_file: str | None = None  # a client certificate, for mutual TLS
    key_file: str | None = None
    verify: bool = True  # the broker's certificate and host name are checked

    @classmethod
    def of(cls, policy: FailoverPolicy) -> TlsOptions:
        return cls(policy.ssl_ca_file, policy.ssl_cert_file, policy.ssl_key_file, policy.ssl_verify)


@attrs.frozen
class Opened:
    """What the broker said when the connection opened."""

    broker: BrokerAddress
    session_id: str | None  # for a later reattach; None when the broker lacks the extension
    resumed: bool  # the broker still held the session asked for (reattach)
    last_received: int  # with resumed: the last command id the broker received
    topology: tuple[tuple[str, int], ...]  # announced client addresses, empty if none
    reattach_refused: bool = False  # a reattach was asked for and the session is gone
    detects_duplicates: bool = False  # the broker drops a copy by its duplicate id (F13)
    product: str = ""  # what the broker calls itself (STOMP ``server``, AMQP ``product``)


def parse_topology(value: str | None) -> tuple[tuple[str, int], ...]:
    """The (host, port) pairs of a topology announcement: "h1:p1,[::1]:p2"."""
    endpoints: list[tuple[str, int]] = []
    for item in (value or "").split(","):
        host, _, port = item.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if host and port.isdigit():
            endpoints.append((host, int(port)))
    return tuple(endpoints)


def parse_failover_server_list(value: object) -> tuple[tuple[str, int], ...]:
    """The (host, port) pairs of an AMQP ``failover-server-list`` (the standard
    announcement of ActiveMQ Artemis, read by Qpid JMS): a list of maps whose keys are
    symbols or strings, ``network-host`` (else ``hostname``) and ``port`` (5672, or 5671 for
    the ``amqps`` scheme, when absent). Entries without a host are skipped."""
    if not isinstance(value, list | tuple):
        return ()
    endpoints: list[tuple[str, int]] = []
    for entry in value:
        if not isinstance(entry, dict):
            continue
        fields = {str(key): item for key, item in entry.items()}
        host = fields.get("network-host") or fields.get("hostname")
        if not isinstance(host, str) or not host:
            continue
        default = 5671 if str(fields.get("scheme", "")).lower() == "amqps" else 5672
        port = fields.get("port", default)
        if isinstance(port, bool) or not isinstance(port, int | str) or not str(port).isdigit():
            continue
        endpoints.append((host.strip("[]"), int(port)))
    return tuple(endpoints)


def parse_redirect(info: object) -> tuple[str, int | None] | None:
    """Where an AMQP ``amqp:connection:redirect`` sends the client: the info map's
    ``network-host`` (else ``hostname``) and ``port`` (None when absent: the scheme's
    default). None when it names no usable host or port."""
    if not isinstance(info, dict):
        return None
    fields = {str(key): item for key, item in info.items()}
    host = fields.get("network-host") or fields.get("hostname")
    if not isinstance(host, str) or not host.strip("[]"):
        return None
    port = fields.get("port")
    if port is None:
        return host.strip("[]"), None
    if isinstance(port, bool) or not isinstance(port, int | str) or not str(port).isdigit():
        return None
    if not 1 <= int(port) <= 65535:
        return None
    return host.strip("[]"), int(port)


def detects_duplicates(product: str) -> bool:
    """Whether a broker that names itself ``product`` has duplicate detection."""
    name = product.strip().lower()
    return any(name.startswith(known) for known in _DETECTS_DUPLICATES)


class LinkEvents(Protocol):
    """What the driver hears from a link (on the transport's thread; must not block)."""

    def link_message(self, link: Link, subscription: str, tag: str, message: Message) -> None: ...

    def link_completed(self, link: Link, token: int, error: RemoteError | None) -> None: ...

    def link_confirmed(self, link: Link, upto: int) -> None: ...

    def link_error(self, link: Link, error: ProtocolError) -> None: ...

    def link_browse_end(self, link: Link, subscription: str) -> None: ...

    def link_lost(self, link: Link, reason: str) -> None: ...

    def link_redirected(self, link: Link, host: str, port: int | None) -> None:
        """The broker sent the client to another broker (AMQP ``amqp:connection:redirect``;
        ``port`` None: the scheme's); the link's loss follows."""
        ...

    def link_output(self, link: Link, flush: Callable[[], None]) -> None:
        """The link queued bytes in its outbox (``protocols/outbox.py``); ``flush`` writes
        them and must be called once the calling thread holds no lock: at once if it holds
        none, else when it lets go of the driver's (called on the thread that queued)."""
        ...


class Link(Protocol):
    """One open connection to one broker.

    What a link can do is said by its capabilities, never by its class: the driver asks
    ``windowed`` (frames numbered for the confirmation window and receipts in frame order,
    so one receipt confirms every frame before it, and ``sync`` may be called),
    ``calls_block`` (subscribe, browse and begin wait for the broker: call them without
    the driver's lock; ``end`` never waits, its answer completes its token) and
    ``settles_transacted_work`` (the broker settles each transacted transfer and
    acknowledge, and a commit must wait for those settlements)."""

    broker: BrokerAddress
    serial: int
    windowed: bool
    calls_block: bool
    settles_transacted_work: bool

    def open(self, broker: BrokerAddress, *, resume: str | None) -> Opened:
        """Connect and log in (blocking)."""
        ...

    def send(
        self, destination: Destination, message: Message, *, tx: object, token: int | None
    ) -> int:
        """Send a message; with a token the broker's confirmation completes it. Returns the
        command id (STOMP with the window on) or -1."""
        ...

    def subscribe(
        self,
        subscription: str,
        destination: Destination,
        *,
        acknowledged: bool,
        prefetch: int,
        selector: str | None = None,
        token: int | None = None,
        named: NamedSubscription | None = None,
    ) -> None:
        """Start a subscription (blocking on AMQP); a token is completed once the broker
        has it, or failed with the broker's refusal. ``named``: a durable or shared topic
        subscription, resumed by that name."""
        ...

    def remove_subscription(self, name: str, *, token: int) -> None:
        """Delete the durable subscription the broker knows as ``name`` (blocking on AMQP);
        the token completes once the broker has, or fails with its refusal."""
        ...

    def pull(self, subscription: str) -> None:
        """A receive of a zero-prefetch consumer waits: ask for one message (a link that
        cannot is never asked: ``core/pull.py`` refuses prefetch=0 on its protocol)."""
        ...

    def drain(self, subscription: str) -> None:
        """That receive ended without one: take the request back; returns once the broker
        has sent the message or given the request back (blocking)."""
        ...

    def unsubscribe(self, subscription: str) -> None: ...

    def browse(self, subscription: str, queue: Destination) -> None:
        """Copy a queue's waiting messages (blocking on AMQP); ``link_browse_end`` follows."""
        ...

    def acknowledge(self, subscription: str, tag: str, *, tx: object, token: int | None) -> None:
        """Accept one delivery (inside ``tx`` when given)."""
        ...

    def redeliver(self, subscription: str, tag: str) -> None:
        """Give one delivery back for redelivery, counted as a failed attempt."""
        ...

    def reject(self, subscription: str, tag: str) -> None:
        """Refuse one delivery for good: the broker moves it to its dead-letter address."""
        ...

    def begin(self) -> object:
        """Start a transaction; returns its handle (blocking on AMQP)."""
        ...

    def end(self, tx: object, *, commit: bool, token: int) -> None:
        """Commit or roll back (never blocking); completion arrives as
        ``link_completed(token)``."""
        ...

    def temporary_queue(self, wanted: Destination | None) -> Destination:
        """Create a temporary queue; ``wanted`` recreates one under the same name (F5)."""
        ...

    def replay(self, payload: object) -> None:
        """Write a command kept by the confirmation window again (reattach)."""
        ...

    def sync(self, token: int) -> None:
        """Windowed links only: a frame that asks for nothing but a receipt, which then
        confirms every frame written before it."""
        ...

    def resend(self, payload: object) -> int:
        """Windowed links only: write a command a previous link's window kept (a send
        stamped with a duplicate id) as a new command of this one; returns its id."""
        ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


LinkFactory = Callable[[LinkEvents, FailoverPolicy, ConfirmationWindow[Any]], Link]

# Every link of the process has its own serial, whatever its protocol.
LINK_SERIALS: Final = itertools.count(1)
