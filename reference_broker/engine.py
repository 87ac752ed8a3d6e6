"""The broker's messaging engine: queues, topics, consumers, acknowledgements, transactions,
duplicate detection and dead-lettering, independent of STOMP and AMQP.

This module owns the broker's messaging state and every rule about it. It must never do I/O,
start threads, read a clock or write a file: it is driven from one event loop, time comes in
as `now`, deliveries come out as values for the protocol layer to write, and what must
survive a crash comes out as records (`reference_broker.records`) for the caller to journal
and replicate.

Theory of operation
-------------------
Names. Addresses are canonical: `queue://name` (anycast: competing consumers, FIFO),
`topic://name` (multicast: each subscription is a queue of its own) and
`temp-queue://name` (a queue owned by one connection). A durable subscription is the queue
`topic://name::subscription`; a non-durable one is `topic://name::~<consumer id>`. Sending to
such a fully qualified name reaches that one subscription, as in Artemis. `::` is reserved.

Queues. A queue holds entries (a message plus its delivery state) in up to ten priority
levels, each a deque ordered by an engine-wide sequence number taken when the entry was
enqueued. Dispatch takes the head of the highest non-empty level. An entry handed to a
consumer leaves the deque; when it comes back (NACK, release, consumer closed, connection
dropped, transaction rolled back) it is put back at the position its sequence number gives
it, so the queue keeps its original order. A slow consumer costs nothing: an entry leaves its
queue only when a consumer has credit and window for it.

The protocol layer's loop:
    1. call `send`, `subscribe`, `ack`, `settle`, `commit`, ... as frames arrive;
    2. `drain_records()` and append them, in that order, to the journal; replicate them;
    3. once they are durable, confirm to clients (receipts, dispositions);
    4. `poll(now)` and write the returned deliveries.
Records are produced only for durable state: a persistent message in a durable queue, a
durable queue, a duplicate id of a persistent send, a committed transaction. Non-persistent
messages, temporary queues and non-durable subscriptions are never written; they are lost on
failover, as documented.

Acknowledgement. Each consumer has an ack mode: AUTO (settled when dispatched), CLIENT
(an ack settles every delivery of that consumer up to and including the tag) and
CLIENT_INDIVIDUAL (one delivery). Outcomes follow AMQP 1.0 so both protocols map onto them:
ACCEPTED removes the message; RELEASED puts it back without counting a failed attempt
(AMQP `released`); FAILED puts it back and counts one (STOMP NACK, AMQP
`modified(delivery-failed)`, consumer closed, connection dropped, rollback); REJECTED sends it
to the dead-letter queue at once. A message whose failed-attempt count reaches
`max_delivery_attempts` goes to the dead-letter queue instead of back to its queue.

Flow control. A consumer may be dispatched to while it has credit (AMQP link credit: spent by
each delivery, given back only by `set_credit`/`add_credit`) and while its unsettled
deliveries are fewer than its window (STOMP prefetch: reopened by acks). Either may be
unlimited (None). Consumers of a queue with capacity are served round-robin.

Transactions. A transaction belongs to a connection. Its sends are held, and its
settlements noted, until `commit`, which applies them in order and writes them as
TX_ADD/TX_ACK/TX_DUPLICATE_ID records followed by one TX_COMMIT: recovery applies all of a
transaction or none. `rollback`, and a dropped connection, drop the sends and return the
settled messages to their queues as failed deliveries. Nothing of an open transaction is
ever written, so an aborted one leaves no trace in the journal.

Duplicate detection (DESIGN F13). Each address has a cache of the duplicate ids of persistent
messages sent to it, oldest forgotten first. An id is forgotten only once it is both older
than `duplicate_id_retention` (by the wall clock, `EngineConfig.clock`) and beyond the newest
`duplicate_cache_size` ids of its address, or when the address's ids exceed
`duplicate_id_max_bytes` (logged once per address): a client's retry long after many later
sends is still found. Each id's time is journaled with it, so retention by time survives a
restart and a failover. A send whose id is in the cache is dropped and reported as
accepted (`send` returns None), so a client's retry after an unknown outcome is harmless.
Inside a transaction the id enters the cache at commit, and a duplicate met at commit is
dropped while the commit still succeeds: a retried transaction whose first attempt did
commit then commits once more without storing anything twice (Artemis instead marks such a
transaction rollback-only; dropping is friendlier to clients that retry on an unknown
outcome, and gives the same once-and-only-once effect). A non-persistent send is checked
against the cache but never enters it: it would not survive a failover, and entering it
would make the live's cache differ from the journal's.

Connections, reattach and reconnect. `disconnect` closes a connection's consumers and rolls
back its transactions. Its temporary queues are deleted, unless the server passes
`hold_temp_queues_until`: they are then kept, with their messages, until `tick(now)` passes
that time or a new connection claims them by name with `create_temp_queue` (a client
reconnecting within connection_ttl recreates its temporary queues under the same names,
DESIGN F5). To hold a whole session for reattach (F4), the server does not disconnect: it
calls `pause_connection`, and later `resume_connection` or `disconnect`.

A full disk. The engine reads no disk: the node tells it, through
`refuse_persistent_sends(reason)`, when its journal has no room for new data. Until told
otherwise a persistent send raises DiskFullError (code DISK_FULL, with the reason), unless it
is a duplicate already stored (that writes nothing), and a commit holding persistent sends is
rolled back and raises it. Everything else (acknowledgements, settlements, rollbacks,
non-persistent sends) goes on: those records are what the journal's reserve is for.

Address limits. Each address counts what its queues hold against its `AddressLimit` (bytes:
a message's body and headers plus MESSAGE_OVERHEAD; messages), per queue entry, from the
send (a transaction's sends are counted at their send and given back when it ends; its
commit then counts what it routes) until the entry is acknowledged, dead-lettered, expired
or deleted with its queue. A send to an address that holds its limit or more raises
AddressFullError (after the duplicate check: a retry of a stored message writes nothing);
under policy BLOCK the error says so, and the server holds the producer until
`drain_freed()` names the address: one that refused a send and has room again. Nothing
else is ever refused for a limit (dead-lettering, redelivery, a commit). Recovery counts
what it rebuilds, so a node that takes over is as full as the one it replaces.

Recovery. `Engine.recover(records)` rebuilds durable queues, their persistent messages in
order with their delivery counts, the dead-letter queue and the duplicate-id caches, applying
committed transactions only. The journal does not record deliveries, so every recovered
message is marked redelivered: it may have been in flight when the live failed.
`persistent_state()` is what recovery must reproduce; `checkpoint()` gives the shortest record
stream that rebuilds it. `take_checkpoint()` frames that stream with CHECKPOINT_BEGIN/END for
the journal: recovery then starts over from the checkpoint, so the node may delete every
journal segment before it (compaction). A checkpoint is consistent because it is copied in
one call on the engine's loop, after the records drained so far and before any later one;
an open transaction is no concern, as it has written nothing yet (its settled messages are
still in the checkpoint, where a later TX_ACK finds them).
"""

from __future__ import annotations

import enum
import logging
import sys
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from operator import attrgetter
from typing import Any, ClassVar, Final

import attrs

from reference_broker.message import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    NO_HEADERS,
    BrokerError,
    InvalidRequestError,
    Message,
    NotFoundError,
    ResourceLockedError,
)
from reference_broker.records import (
    CheckpointBegin,
    CheckpointEnd,
    DeadLetter,
    DeliveryCount,
    DuplicateId,
    IdWatermark,
    MessageAck,
    MessageAdd,
    QueueCreate,
    QueueDelete,
    Record,
    TxAck,
    TxAdd,
    TxCommit,
    TxDuplicateId,
    TxRollback,
)

__all__ = [
    "QUEUE_PREFIX",
    "TEMP_QUEUE_PREFIX",
    "TOPIC_PREFIX",
    "AckMode",
    "AddressFullError",
    "AddressFullPolicy",
    "AddressLimit",
    "Checkpoint",
    "ConsumerInfo",
    "Delivery",
    "DiskFullError",
    "DurableQueueState",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Outcome",
    "PersistentState",
    "QueueStats",
    "StoredMessage",
    "UnknownAddressError",
    "UnknownConnectionError",
    "UnknownConsumerError",
    "UnknownDeliveryError",
    "UnknownTransactionError",
    "dead_letter_copy",
]

QUEUE_PREFIX: Final = "queue://"
TOPIC_PREFIX: Final = "topic://"
TEMP_QUEUE_PREFIX: Final = "temp-queue://"
_SEPARATOR: Final = "::"
# The subscription name of a shared subscription that is not durable starts with this.
_SHARED_PREFIX: Final = "~shared."
_PREFIXES: Final = (QUEUE_PREFIX, TOPIC_PREFIX, TEMP_QUEUE_PREFIX)

# Names and duplicate ids are written as u16-length UTF-8 (records.py); a UTF-8 character
# takes at most 4 bytes, so this many characters always fit.
_MAX_NAME_CHARS: Final = 0xFFFF // 4

# "No limit" as an int keeps the dispatch test to two integer comparisons.
_UNLIMITED: Final = sys.maxsize

# Headers Artemis puts on a dead-lettered copy; clients and tools already know them.
ORIGINAL_ADDRESS_HEADER: Final = "_AMQ_ORIG_ADDRESS"
ORIGINAL_QUEUE_HEADER: Final = "_AMQ_ORIG_QUEUE"
ORIGINAL_MESSAGE_ID_HEADER: Final = "_AMQ_ORIG_MESSAGE_ID"


class DiskFullError(BrokerError):
    """The journal's disk has no room for new messages: persistent sends (and commits that
    hold them) are refused until space returns; everything else, acknowledgements included,
    goes on."""

    code: ClassVar[str] = "DISK_FULL"


class AddressFullError(BrokerError):
    """An address holds as much as its limit allows (`AddressLimit`): the send is refused
    (policy FAIL), or the server holds the producer until the address has room (BLOCK:
    `blocking` is True; the engine tells it through `drain_freed`). `address` is the
    address whose limit was reached (a topic for a subscription's queue)."""

    code: ClassVar[str] = "ADDRESS_FULL"

    def __init__(self, message: str, *, address: str, blocking: bool) -> None:
        super().__init__(message)
        self.address = address
        self.blocking = blocking


class UnknownAddressError(NotFoundError):
    code: ClassVar[str] = "ADDRESS_NOT_FOUND"


class UnknownConnectionError(NotFoundError):
    code: ClassVar[str] = "CONNECTION_NOT_FOUND"


class UnknownConsumerError(NotFoundError):
    code: ClassVar[str] = "CONSUMER_NOT_FOUND"


class UnknownDeliveryError(NotFoundError):
    code: ClassVar[str] = "DELIVERY_NOT_FOUND"


class UnknownTransactionError(NotFoundError):
    code: ClassVar[str] = "TRANSACTION_NOT_FOUND"


class AckMode(enum.Enum):
    """How a consumer's deliveries are settled (STOMP's `ack` header values)."""

    AUTO = "auto"
    CLIENT = "client"
    CLIENT_INDIVIDUAL = "client-individual"


class Outcome(enum.Enum):
    """How a delivery ends (AMQP 1.0 delivery states; STOMP ACK is ACCEPTED, NACK FAILED)."""

    ACCEPTED = "accepted"
    RELEASED = "released"
    FAILED = "failed"
    REJECTED = "rejected"


class AddressFullPolicy(enum.Enum):
    """What a send to a full address meets (Artemis's address-full-policy, less PAGE and
    DROP): FAIL refuses it with AddressFullError; BLOCK holds the producer until there is
    room (the protocol layer's flow control)."""

    FAIL = "FAIL"
    BLOCK = "BLOCK"


# What a message costs an address besides its body and headers: about what the node's memory
# holds for a stored message beyond them (measured ~450 bytes, docs/broker.md).
MESSAGE_OVERHEAD: Final = 512
DEFAULT_MAX_ADDRESS_BYTES: Final = 1024 * 1024 * 1024


def _check_limit(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be a whole number >= 0 (0: none), not {value!r}")


@attrs.frozen
class AddressLimit:
    """How much one address may hold: `max_bytes` (each message counted as its body, its
    headers and MESSAGE_OVERHEAD) and `max_messages`, 0 for no limit, over every queue of the
    address (a message in three subscriptions of a topic counts three times), from the
    moment it is sent (a transaction's sends from their send) until it is acknowledged,
    dead-lettered, expired or deleted. A send is refused or held once the address holds
    its limit or more: the message that reaches it goes in."""

    max_bytes: int = attrs.field(default=DEFAULT_MAX_ADDRESS_BYTES, validator=_check_limit)
    max_messages: int = attrs.field(default=0, validator=_check_limit)
    policy: AddressFullPolicy = AddressFullPolicy.FAIL


def _check_config_dlq(_: object, __: object, value: str | None) -> None:
    if value is not None:
        _check_name(value, QUEUE_PREFIX, "dead-letter queue")


def _check_positive_or_none(_: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value < 1:
        raise InvalidRequestError(f"{attribute.name} must be at least 1 or None, not {value}")


def _check_not_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise InvalidRequestError(f"{attribute.name} must not be negative, not {value}")


DEFAULT_DUPLICATE_ID_RETENTION: Final = 3600.0  # seconds
DEFAULT_MAX_DELIVERY_ATTEMPTS: Final = 10  # failed deliveries before the dead-letter queue
DEFAULT_DEAD_LETTER_QUEUE: Final = "queue://DLQ"
DEFAULT_DUPLICATE_ID_MAX_BYTES: Final = 64 * 1024 * 1024  # per address
DUPLICATE_ID_OVERHEAD: Final = 64  # bytes counted per id besides its UTF-8 length

log = logging.getLogger("reference_broker.engine")


def _check_retention(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e12:
        raise ValueError(f"{attribute.name} must be a number of seconds >= 0, not {value!r}")


def _check_positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a whole number above 0, not {value!r}")


def _check_node_id(_: object, __: object, value: str) -> None:
    if not value or _SEPARATOR in value:
        raise InvalidRequestError(f"node_id must be non-empty and free of '::', not {value!r}")


@attrs.frozen
class EngineConfig:
    """Engine settings.

    `first_message_id` lets a server keep message ids unique across failovers even for
    non-persistent messages the journal never saw (for example, activation sequence << 40).
    `duplicate_cache_size` 0 turns duplicate detection off. Otherwise an address's duplicate
    id is forgotten only when it is older than `duplicate_id_retention` seconds and beyond the
    newest `duplicate_cache_size` ids, or when the address's ids take more than
    `duplicate_id_max_bytes` (each id's UTF-8 length plus DUPLICATE_ID_OVERHEAD). `clock` is
    the wall clock the ages are measured by (it is journaled: a monotonic clock would not
    survive a restart).
    """

    max_delivery_attempts: int | None = attrs.field(
        default=DEFAULT_MAX_DELIVERY_ATTEMPTS, validator=_check_positive_or_none
    )
    dead_letter_queue: str | None = attrs.field(
        default=DEFAULT_DEAD_LETTER_QUEUE, validator=_check_config_dlq
    )
    duplicate_cache_size: int = attrs.field(default=20_000, validator=_check_not_negative)
    duplicate_id_retention: float = attrs.field(
        default=DEFAULT_DUPLICATE_ID_RETENTION, validator=_check_retention
    )
    duplicate_id_max_bytes: int = attrs.field(
        default=DEFAULT_DUPLICATE_ID_MAX_BYTES, validator=_check_positive_int
    )
    clock: Callable[[], float] = attrs.field(default=time.time, eq=False, repr=False)
    auto_create_queues: bool = True
    node_id: str = attrs.field(default="broker", validator=_check_node_id)
    first_message_id: int = attrs.field(default=1, validator=_check_not_negative)
    # Deliveries one queue hands out per `poll`: an auto-acknowledging consumer has no window
    # to stop it, and must not take a whole backlog into memory (and its connection's write
    # buffer) in one loop turn. The rest waits for the next poll; `dispatch_pending` says so.
    dispatch_per_poll: int | None = attrs.field(default=1000, validator=_check_positive_or_none)
    # How much each address may hold, and per-address exceptions by exact address.
    address_limit: AddressLimit = AddressLimit()
    address_limits: Mapping[str, AddressLimit] = attrs.field(factory=dict, hash=False)

    def limit_of(self, address: str) -> AddressLimit:
        return self.address_limits.get(address, self.address_limit)


@attrs.frozen
class Delivery:
    """One message handed to one consumer; the protocol layer writes it.

    `delivery_count` is the number of earlier failed attempts (AMQP header delivery-count);
    `redelivered` says the message may have been seen before (JMSRedelivered, AMQP
    first-acquirer negated). Settle it with `(consumer_id, tag)`.
    """

    consumer_id: int
    tag: int
    message: Message
    delivery_count: int
    redelivered: bool


@attrs.frozen
class ConsumerInfo:
    id: int
    connection_id: int
    queue: str
    ack_mode: AckMode
    credit: int | None
    window: int | None
    unacked: int
    paused: bool


@attrs.frozen
class QueueStats:
    name: str
    address: str
    durable: bool
    temporary: bool
    messages: int  # waiting to be delivered
    in_flight: int  # delivered, not yet settled (including settled inside an open transaction)
    consumers: int
    enqueued: int
    acknowledged: int
    dead_lettered: int
    expired: int


@attrs.frozen
class EngineStats:
    queues: tuple[QueueStats, ...]
    connections: int
    consumers: int
    transactions: int
    messages: int
    in_flight: int
    dead_lettered: int
    expired: int
    duplicates_dropped: int


@attrs.frozen
class StoredMessage:
    message: Message
    delivery_count: int


@attrs.frozen
class DurableQueueState:
    address: str
    messages: tuple[StoredMessage, ...]


@attrs.frozen
class PersistentState:
    """What survives a failover: durable queues with their persistent messages in delivery
    order (in-flight ones at the place they would return to) and the duplicate-id caches."""

    queues: Mapping[str, DurableQueueState] = attrs.field(hash=False)
    duplicate_ids: Mapping[str, tuple[str, ...]] = attrs.field(hash=False)


def dead_letter_copy(message: Message, queue: str, new_id: int, dead_letter_queue: str) -> Message:
    """The message the dead-letter queue receives in place of `message` from `queue`.

    A new id, because a topic may dead-letter the same message from several subscriptions;
    the origin in Artemis's headers; no expiration, so that an operator can still see why it
    failed. Deterministic, because recovery makes the same copy from a DEAD_LETTER record.
    """
    headers = dict(message.headers)
    headers[ORIGINAL_ADDRESS_HEADER] = message.address
    headers[ORIGINAL_QUEUE_HEADER] = queue
    headers[ORIGINAL_MESSAGE_ID_HEADER] = str(message.id)
    return Message(
        new_id, dead_letter_queue, message.body, headers, message.persistent, message.priority
    )


def _check_name(name: str, prefix: str | None, what: str) -> str:
    """Validate a canonical address and return its prefix (the kind of address)."""
    if not isinstance(name, str):
        raise InvalidRequestError(f"{what} must be a string, not {type(name).__name__}")
    for candidate in _PREFIXES:
        if name.startswith(candidate):
            break
    else:
        raise InvalidRequestError(
            f"{what} {name!r} must start with queue://, topic:// or temp-queue://"
        )
    if prefix is not None and candidate != prefix:
        raise InvalidRequestError(f"{what} {name!r} must start with {prefix}")
    rest = name[len(candidate) :]
    if not rest:
        raise InvalidRequestError(f"{what} {name!r} has no name after {candidate}")
    if _SEPARATOR in rest:
        raise InvalidRequestError(f"{what} {name!r} contains '::', which is reserved")
    if len(name) > _MAX_NAME_CHARS:
        raise InvalidRequestError(f"{what} is {len(name)} characters, over {_MAX_NAME_CHARS}")
    return candidate


# --- internal state ---------------------------------------------------------------------------


class _Entry:
    """A message's place in one queue: what the queue knows that the message does not."""

    __slots__ = ("delivery_count", "message", "redelivered", "seq", "size")

    def __init__(self, message: Message, seq: int, delivery_count: int, redelivered: bool) -> None:
        self.message = message
        self.seq = seq
        self.delivery_count = delivery_count
        self.redelivered = redelivered
        self.size = _message_size(message)  # what it counts against its address's limit


def _message_size(message: Message) -> int:
    size = len(message.body) + MESSAGE_OVERHEAD
    for name, value in message.headers.items():
        size += len(name) + len(value)
    return size


class _Usage:
    """What the queues of one address hold, against its limit."""

    __slots__ = ("address", "bytes", "limit", "messages", "refused")

    def __init__(self, address: str, limit: AddressLimit) -> None:
        self.address = address
        self.limit = limit
        self.bytes = 0
        self.messages = 0
        self.refused = False  # a send was refused or held since it last had room

    def full(self) -> bool:
        limit = self.limit
        return bool(
            (limit.max_bytes and self.bytes >= limit.max_bytes)
            or (limit.max_messages and self.messages >= limit.max_messages)
        )


_seq_of = attrgetter("seq")


class _Queue:
    __slots__ = (
        "acknowledged",
        "address",
        "consumers",
        "dead_lettered",
        "deleted",
        "durable",
        "enqueued",
        "expired",
        "held_bytes",
        "hold_until",
        "in_flight",
        "levels",
        "name",
        "names",
        "order",
        "owner",
        "route",
        "rr",
        "size",
        "subscriber",
        "temporary",
        "usage",
    )

    def __init__(
        self,
        name: str,
        address: str,
        *,
        durable: bool,
        temporary: bool = False,
        owner: int | None = None,
        subscriber: int | None = None,
        usage: _Usage,
    ) -> None:
        self.name = name
        self.address = address
        self.durable = durable
        self.temporary = temporary
        self.owner = owner  # the owning connection of a temporary queue; None while held
        self.subscriber = subscriber  # the consumer of a non-durable subscription
        self.hold_until: float | None = None
        self.levels: dict[int, deque[_Entry]] = {}
        self.order: list[deque[_Entry]] = []  # levels, highest priority first
        self.size = 0  # entries waiting in the levels
        self.in_flight = 0
        self.consumers: list[_Consumer] = []
        self.rr = 0  # round-robin position in consumers
        self.deleted = False
        # Built once: every send to this queue reuses them instead of allocating.
        self.route: tuple[_Queue, ...] = (self,)
        self.names: tuple[str, ...] = (name,)
        self.enqueued = 0
        self.acknowledged = 0
        self.dead_lettered = 0
        self.expired = 0
        self.usage = usage  # its address's, shared by every queue of the address
        self.held_bytes = 0  # the sizes of its entries, waiting and in flight

    def level(self, priority: int) -> deque[_Entry]:
        dq = self.levels.get(priority)
        if dq is None:
            dq = self.levels[priority] = deque()
            self.order = [self.levels[p] for p in sorted(self.levels, reverse=True)]
        return dq

    def waiting(self) -> list[_Entry]:
        """Entries waiting for delivery, in delivery order."""
        return [e for dq in self.order for e in dq]


class _Consumer:
    __slots__ = (
        "ack_mode",
        "auto",
        "connection",
        "credit",
        "id",
        "individual",
        "paused",
        "queue",
        "unacked",
        "window",
    )

    def __init__(
        self,
        consumer_id: int,
        connection: int,
        queue: _Queue,
        ack_mode: AckMode,
        credit: int,
        window: int,
    ) -> None:
        self.id = consumer_id
        self.connection = connection
        self.queue = queue
        self.ack_mode = ack_mode
        self.auto = ack_mode is AckMode.AUTO
        self.individual = ack_mode is AckMode.CLIENT_INDIVIDUAL
        self.credit = credit
        self.window = window
        self.paused = False
        # Tags rise monotonically, so insertion order is tag order: CLIENT's cumulative ack
        # walks it from the front.
        self.unacked: dict[int, _Entry] = {}


class _Transaction:
    __slots__ = ("connection", "id", "name", "sends", "settles")

    def __init__(self, tx_id: int, connection: int, name: str | None) -> None:
        self.id = tx_id
        self.connection = connection
        self.name = name
        self.sends: list[tuple[Message, tuple[_Queue, ...], str | None]] = []
        self.settles: list[tuple[_Queue, _Entry, Outcome]] = []


class _Connection:
    __slots__ = ("consumers", "id", "temp_queues", "transactions", "tx_names")

    def __init__(self, connection_id: int) -> None:
        self.id = connection_id
        # dicts used as ordered sets: closing happens in creation order
        self.consumers: dict[int, None] = {}
        self.temp_queues: dict[str, None] = {}
        self.transactions: dict[int, _Transaction] = {}
        self.tx_names: dict[str, int] = {}


class _DuplicateCache:
    """The duplicate ids of one address with the time each entered, oldest forgotten first."""

    __slots__ = ("address", "bytes", "config", "forced", "ids", "order")

    def __init__(self, address: str, config: EngineConfig) -> None:
        self.address = address
        self.config = config
        self.ids: dict[str, float] = {}  # id -> when it entered (wall clock)
        self.order: deque[str] = deque()
        self.bytes = 0
        self.forced = False  # the byte bound forgot an id in retention: logged once

    def add(self, duplicate_id: str, at: float) -> None:
        if duplicate_id in self.ids:
            return
        self.ids[duplicate_id] = at
        self.order.append(duplicate_id)
        self.bytes += _id_bytes(duplicate_id)
        config = self.config
        # Beyond the count and older than the retention: both, or a retry within the
        # retention after many later sends would be stored twice.
        horizon = at - config.duplicate_id_retention
        ids, order = self.ids, self.order
        while len(order) > config.duplicate_cache_size and ids[order[0]] <= horizon:
            self._forget()
        while self.bytes > config.duplicate_id_max_bytes and len(order) > 1:
            if not self.forced:
                self.forced = True
                log.warning(
                    "duplicate ids of %s exceed %d bytes: forgetting the oldest before their "
                    "retention (%.0f s) ends; a retry that late is stored twice",
                    self.address,
                    config.duplicate_id_max_bytes,
                    config.duplicate_id_retention,
                )
            self._forget()

    def _forget(self) -> None:
        oldest = self.order.popleft()
        del self.ids[oldest]
        self.bytes -= _id_bytes(oldest)


def _id_bytes(duplicate_id: str) -> int:
    return len(duplicate_id.encode("utf-8", "surrogatepass")) + DUPLICATE_ID_OVERHEAD


# --- the engine -------------------------------------------------------------------------------


class Engine:
    """The messaging engine. See the module's theory of operation."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self._config = config if config is not None else EngineConfig()
        self._max_attempts = self._config.max_delivery_attempts
        self._dlq_name = self._config.dead_letter_queue
        self._queues: dict[str, _Queue] = {}
        self._topics: dict[str, list[_Queue]] = {}  # topic address -> subscription queues
        self._connections: dict[int, _Connection] = {}
        self._consumers: dict[int, _Consumer] = {}
        self._transactions: dict[int, _Transaction] = {}
        self._duplicates: dict[str, _DuplicateCache] = {}
        self._held: dict[str, _Queue] = {}  # temporary queues of dropped connections
        self._dirty: set[_Queue] = set()  # queues that may be able to dispatch
        self._records: list[Record] = []
        self._next_message_id = self._config.first_message_id
        self._next_tx_id = 1
        self._next_checkpoint_id = 1
        self._torn_checkpoint = False
        self._next_connection_id = 1
        self._next_consumer_id = 1
        self._next_tag = 1
        self._next_seq = 1
        self._next_temp = 1
        self._dead_lettered = 0
        self._expired = 0
        self._duplicates_dropped = 0
        self._refusal: str | None = None  # why new persistent messages are refused, if they are
        self._exclusive: set[int] = set()  # consumers alone on their subscription by right
        self._usages: dict[str, _Usage] = {}  # address -> what its queues hold
        self._freed: list[str] = []  # full addresses that refused a send and now have room
        self._ever_expiring = False  # a message with an expiration entered a queue

    @property
    def config(self) -> EngineConfig:
        return self._config

    # --- records ----------------------------------------------------------------------------

    def drain_records(self) -> list[Record]:
        """Records produced since the last call, in the order they must be journaled."""
        records = self._records
        self._records = []
        return records

    # --- connections ------------------------------------------------------------------------

    def connect(self) -> int:
        """Open a connection; returns its id."""
        connection_id = self._next_connection_id
        self._next_connection_id += 1
        self._connections[connection_id] = _Connection(connection_id)
        return connection_id

    def disconnect(
        self, connection_id: int, *, hold_temp_queues_until: float | None = None
    ) -> list[str]:
        """Close a connection: roll back its transactions, close its consumers (their
        unsettled deliveries go back as failed attempts), and delete its temporary queues, or
        hold them until `hold_temp_queues_until` for a reconnecting client to claim.

        Returns the names of the held temporary queues.
        """
        connection = self._connection(connection_id)
        for transaction in list(connection.transactions.values()):
            self._end_transaction(transaction)
            self._rollback(transaction)
        for consumer_id in list(connection.consumers):
            self.close_consumer(consumer_id)
        held: list[str] = []
        for name in list(connection.temp_queues):
            queue = self._queues[name]
            if hold_temp_queues_until is None:
                self._delete_queue(queue)
            else:
                queue.owner = None
                queue.hold_until = hold_temp_queues_until
                self._held[name] = queue
                held.append(name)
        connection.temp_queues.clear()
        del self._connections[connection_id]
        return held

    def pause_connection(self, connection_id: int) -> None:
        """Stop dispatching to the connection's consumers (its socket is gone; the session is
        held for reattach). Their unsettled deliveries stay theirs."""
        for consumer_id in self._connection(connection_id).consumers:
            self._consumers[consumer_id].paused = True

    def resume_connection(self, connection_id: int) -> None:
        """Dispatch to the connection's consumers again (the client reattached)."""
        for consumer_id in self._connection(connection_id).consumers:
            consumer = self._consumers[consumer_id]
            consumer.paused = False
            self._dirty.add(consumer.queue)

    def tick(self, now: float) -> list[str]:
        """Delete held temporary queues whose hold has passed; returns their names."""
        ended = [
            name
            for name, q in self._held.items()
            if q.hold_until is not None and q.hold_until <= now
        ]
        for name in ended:
            self._delete_queue(self._held[name])
        return ended

    # --- addresses --------------------------------------------------------------------------

    def create_queue(self, name: str) -> None:
        """Create the durable queue `queue://...` if it does not exist."""
        if name not in self._queues:
            _check_name(name, QUEUE_PREFIX, "queue")
            self._create_queue(name, name, durable=True)

    def create_temp_queue(self, connection_id: int, name: str | None = None) -> str:
        """Create a temporary queue owned by the connection and return its name.

        With a name, a held queue of that name (its owner dropped) is claimed with its
        messages; a queue of another live connection is ResourceLockedError.
        """
        connection = self._connection(connection_id)
        if name is None:
            while True:
                name = f"{TEMP_QUEUE_PREFIX}{self._config.node_id}-{self._next_temp}"
                self._next_temp += 1
                if name not in self._queues:
                    break
        else:
            _check_name(name, TEMP_QUEUE_PREFIX, "temporary queue")
            queue = self._queues.get(name)
            if queue is not None:
                if queue.owner == connection_id:
                    return name
                if queue.owner is not None:
                    raise ResourceLockedError(
                        f"temporary queue {name} belongs to another connection"
                    )
                queue.owner = connection_id
                queue.hold_until = None
                del self._held[name]
                connection.temp_queues[name] = None
                self._dirty.add(queue)
                return name
        self._create_queue(name, name, durable=False, temporary=True, owner=connection_id)
        connection.temp_queues[name] = None
        return name

    def delete_queue(self, name: str) -> list[int]:
        """Delete a queue (or a subscription queue) and its messages; returns the ids of the
        consumers this closed, so that the server can tell their clients."""
        return self._delete_queue(self._queue(name))

    def delete_subscription(self, topic: str, subscription: str) -> None:
        """Delete a durable subscription; it must have no consumers."""
        name = f"{topic}{_SEPARATOR}{subscription}"
        queue = self._queues.get(name)
        if queue is None or queue.address != topic:
            raise UnknownAddressError(f"no durable subscription {subscription!r} on {topic}")
        if queue.consumers:
            raise ResourceLockedError(
                f"durable subscription {subscription!r} on {topic} has active consumers"
            )
        self._delete_queue(queue)

    def queues(self) -> list[str]:
        """Every queue's name: queues, subscriptions, temporary queues (held ones too)."""
        return list(self._queues)

    def browse(self, name: str) -> list[Message]:
        """The messages waiting in a queue, in delivery order (in-flight ones excluded)."""
        return [e.message for e in self._queue(name).waiting()]

    # --- sending ----------------------------------------------------------------------------

    def refuse_persistent_sends(self, reason: str | None) -> None:
        """Refuse new persistent messages with DiskFullError(reason) from now on; None: accept
        them again. The node calls it as its journal's disk fills and frees up."""
        self._refusal = reason

    @property
    def refusing_persistent_sends(self) -> str | None:
        return self._refusal

    def send(
        self,
        address: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        persistent: bool = False,
        priority: int = DEFAULT_PRIORITY,
        expiration: float | None = None,
        duplicate_id: str | None = None,
        tx: int | None = None,
    ) -> int | None:
        """Send a message; returns its id, or None when it was dropped as a duplicate (the
        send is still accepted: tell the client it succeeded).

        A `queue://` address is created on first use (auto_create_queues); a topic without
        subscriptions drops the message; an unknown temporary queue is UnknownAddressError.
        Inside a transaction the message is routed now but held until commit; an id already
        in the cache drops it at once, one that enters the cache before the commit drops it
        there (`commit` returns how many).
        """
        if not 0 <= priority <= MAX_PRIORITY:
            raise InvalidRequestError(f"priority must be 0-{MAX_PRIORITY}, not {priority}")
        if expiration is not None and expiration != expiration:
            raise InvalidRequestError("expiration must be a time, not NaN")
        transaction = None if tx is None else self._transaction(tx)
        targets = self._targets(address)
        if duplicate_id is not None:
            if len(duplicate_id) > _MAX_NAME_CHARS:
                raise InvalidRequestError(
                    f"duplicate id is {len(duplicate_id)} characters, over {_MAX_NAME_CHARS}"
                )
            cache = self._duplicates.get(address)
            if cache is not None and duplicate_id in cache.ids:
                self._duplicates_dropped += 1
                return None
        if persistent and self._refusal is not None:
            # After the duplicate check: a retry of a stored message writes nothing, so it is
            # still accepted.
            raise DiskFullError(f"persistent send to {address} refused: {self._refusal}")
        if targets and targets[0].usage.full():
            raise self._address_full(address, targets[0].usage)
        message_id = self._next_message_id
        self._next_message_id = message_id + 1
        message = Message(
            message_id,
            address,
            body,
            NO_HEADERS if headers is None else headers,
            persistent,
            priority,
            expiration,
        )
        if transaction is not None:
            routed = tuple(targets)
            transaction.sends.append((message, routed, duplicate_id))
            # Held until the commit, but counted now: a transaction cannot hold more than
            # the address may.
            size = _message_size(message)
            for queue in routed:
                queue.usage.bytes += size
                queue.usage.messages += 1
        else:
            self._route(message, targets, duplicate_id, None)
        return message_id

    def _address_full(self, address: str, usage: _Usage) -> AddressFullError:
        usage.refused = True
        limit = usage.limit
        limits = []
        if limit.max_bytes:
            limits.append(f"{limit.max_bytes} bytes (--max-address-bytes)")
        if limit.max_messages:
            limits.append(f"{limit.max_messages} messages (--max-address-messages)")
        blocking = limit.policy is AddressFullPolicy.BLOCK
        return AddressFullError(
            f"send to {address} {'held' if blocking else 'refused'}: address {usage.address} "
            f"is full: it holds {usage.messages} messages, {usage.bytes} bytes; its limit is "
            f"{' or '.join(limits)} (policy {limit.policy.value})",
            address=usage.address,
            blocking=blocking,
        )

    def drain_freed(self) -> list[str]:
        """Addresses that refused (or held) a send since they last had room and have room
        now: a server holding producers for them (BLOCK) lets them go on."""
        freed = self._freed
        self._freed = []
        return freed

    def address_usage(self, address: str) -> tuple[int, int]:
        """(messages, bytes) the queues of `address` hold against its limit."""
        usage = self._usages.get(address)
        return (0, 0) if usage is None else (usage.messages, usage.bytes)

    def _usage(self, address: str) -> _Usage:
        usage = self._usages.get(address)
        if usage is None:
            usage = self._usages[address] = _Usage(address, self._config.limit_of(address))
        return usage

    def _leave(self, queue: _Queue, size: int, count: int = 1) -> None:
        """Entries of `size` bytes in all left `queue`'s care."""
        queue.held_bytes -= size
        self._unreserve(queue.usage, size, count)

    def _unreserve(self, usage: _Usage, size: int, count: int) -> None:
        usage.bytes -= size
        usage.messages -= count
        if usage.refused and not usage.full():
            usage.refused = False
            self._freed.append(usage.address)

    def _targets(self, address: str) -> tuple[_Queue, ...] | list[_Queue]:
        queue = self._queues.get(address)
        if queue is not None:
            return queue.route
        subscriptions = self._topics.get(address)
        if subscriptions is not None:
            return subscriptions
        kind = _check_name(address, None, "address")
        if kind is TOPIC_PREFIX:
            return ()
        if kind is QUEUE_PREFIX and self._config.auto_create_queues:
            return self._create_queue(address, address, durable=True).route
        raise UnknownAddressError(f"address {address} does not exist")

    def _route(
        self,
        message: Message,
        targets: tuple[_Queue, ...] | list[_Queue],
        duplicate_id: str | None,
        tx: int | None,
    ) -> None:
        """Enqueue a message on its target queues and write what must survive."""
        if len(targets) == 1:
            queue = targets[0]
            self._push_new(queue, message)
            names = queue.names if queue.durable else ()
        else:
            durable: list[str] = []
            for queue in targets:
                self._push_new(queue, message)
                if queue.durable:
                    durable.append(queue.name)
            names = tuple(durable)
        if not message.persistent:
            return
        at: float | None = None
        if duplicate_id is not None and self._config.duplicate_cache_size:
            at = self._config.clock()
            self._remember(message.address, duplicate_id, at)
        else:
            duplicate_id = None
        if names:
            self._records.append(
                MessageAdd(names, message, duplicate_id, at)
                if tx is None
                else TxAdd(tx, names, message, duplicate_id, at)
            )
        elif duplicate_id is not None:
            self._records.append(
                DuplicateId(message.address, duplicate_id, at)
                if tx is None
                else TxDuplicateId(tx, message.address, duplicate_id, at)
            )

    def _push_new(self, queue: _Queue, message: Message) -> None:
        seq = self._next_seq
        self._next_seq = seq + 1
        dq = queue.levels.get(message.priority)
        if dq is None:
            dq = queue.level(message.priority)
        entry = _Entry(message, seq, 0, False)
        dq.append(entry)
        if message.expiration is not None:
            self._ever_expiring = True
        queue.held_bytes += entry.size
        usage = queue.usage
        usage.bytes += entry.size
        usage.messages += 1
        queue.size += 1
        queue.enqueued += 1
        if queue.consumers:
            self._dirty.add(queue)

    def _remember(self, address: str, duplicate_id: str, at: float) -> None:
        cache = self._duplicates.get(address)
        if cache is None:
            cache = self._duplicates[address] = _DuplicateCache(address, self._config)
        cache.add(duplicate_id, at)

    # --- consumers --------------------------------------------------------------------------

    def subscribe(
        self,
        connection_id: int,
        address: str,
        *,
        ack_mode: AckMode = AckMode.AUTO,
        credit: int | None = None,
        window: int | None = None,
        subscription: str | None = None,
        exclusive: bool = False,
        shared_name: str | None = None,
    ) -> int:
        """Create a consumer and return its id.

        On `queue://` (created if needed) and `temp-queue://` (owner only), the consumer
        competes with the queue's other consumers. On `topic://` it gets a subscription of its
        own, deleted when it closes, or with `subscription` the durable subscription of that
        name, created if needed and shared by every consumer that names it.
        `credit` is AMQP link credit (spent per delivery), `window` the most unsettled
        deliveries it may hold (STOMP prefetch); None is unlimited. `exclusive`: the
        consumer must be the subscription's only active one (a JMS durable subscription
        that is not shared), and no other may join it while it is. `shared_name`: on a
        topic, the shared subscription of that name that is not durable (never journaled,
        deleted with its last consumer).
        """
        self._connection(connection_id)
        if credit is not None and credit < 0:
            raise InvalidRequestError(f"credit must not be negative, not {credit}")
        if window is not None and window < 1:
            raise InvalidRequestError(f"window must be at least 1 or None, not {window}")
        consumer_id = self._next_consumer_id
        if shared_name is not None:
            queue = self._shared_subscription(address, shared_name, subscription)
        elif subscription is not None:
            _check_name(address, TOPIC_PREFIX, "durable subscription address")
            if not subscription or subscription.startswith("~"):
                raise InvalidRequestError(
                    f"subscription name {subscription!r} must be non-empty and not start with '~'"
                )
            name = f"{address}{_SEPARATOR}{subscription}"
            queue = self._queues.get(name)
            if queue is None:
                if len(name) > _MAX_NAME_CHARS:
                    raise InvalidRequestError(
                        f"subscription queue name is {len(name)} characters, over {_MAX_NAME_CHARS}"
                    )
                queue = self._create_queue(name, address, durable=True)
        else:
            found = self._queues.get(address)
            if found is not None:
                if found.subscriber is not None:
                    raise ResourceLockedError(
                        f"{address} is the private subscription of consumer {found.subscriber}"
                    )
                queue = found
            else:
                kind = _check_name(address, None, "address")
                if kind is TOPIC_PREFIX:
                    queue = self._create_queue(
                        f"{address}{_SEPARATOR}~{consumer_id}",
                        address,
                        durable=False,
                        subscriber=consumer_id,
                    )
                elif kind is QUEUE_PREFIX and self._config.auto_create_queues:
                    queue = self._create_queue(address, address, durable=True)
                else:
                    raise UnknownAddressError(f"address {address} does not exist")
        if queue.temporary and queue.owner != connection_id:
            raise ResourceLockedError(
                f"temporary queue {queue.name} can only be consumed by the connection that owns it"
            )
        self._check_exclusive(queue, exclusive=exclusive)
        self._next_consumer_id += 1
        consumer = _Consumer(
            consumer_id,
            connection_id,
            queue,
            ack_mode,
            _UNLIMITED if credit is None else credit,
            _UNLIMITED if window is None else window,
        )
        if exclusive:
            self._exclusive.add(consumer_id)
        queue.consumers.append(consumer)
        self._connections[connection_id].consumers[consumer_id] = None
        self._consumers[consumer_id] = consumer
        if queue.size:
            self._dirty.add(queue)
        return consumer_id

    # --- named subscriptions (JMS durable and shared) -----------------------------------------

    def _shared_subscription(self, address: str, name: str, durable_name: str | None) -> _Queue:
        """The queue of the shared subscription `name` that is not durable, created on first
        use as `<topic>::~shared.<name>`: a name no durable subscription can take (theirs
        may not start with '~')."""
        _check_name(address, TOPIC_PREFIX, "shared subscription address")
        if durable_name is not None:
            raise InvalidRequestError("a subscription is durable or shared-not-durable, not both")
        if not name or _SEPARATOR in name:
            raise InvalidRequestError(f"shared subscription name {name!r} must be non-empty")
        queue_name = f"{address}{_SEPARATOR}{_SHARED_PREFIX}{name}"
        queue = self._queues.get(queue_name)
        if queue is None:
            if len(queue_name) > _MAX_NAME_CHARS:
                raise InvalidRequestError(
                    f"subscription queue name is {len(queue_name)} characters, over "
                    f"{_MAX_NAME_CHARS}"
                )
            queue = self._create_queue(queue_name, address, durable=False)
        return queue

    def _last_of_shared(self, queue: _Queue) -> bool:
        """Whether `queue` is a shared subscription that is not durable and has just lost
        its last consumer (it goes, with what it held, as a non-durable one does)."""
        return (
            not queue.durable
            and not queue.consumers
            and queue.name.startswith(f"{queue.address}{_SEPARATOR}{_SHARED_PREFIX}")
        )

    def _check_exclusive(self, queue: _Queue, *, exclusive: bool) -> None:
        """JMS: a durable subscription that is not shared has one active consumer. Paused
        consumers (a session held for reattach) do not count: they get nothing."""
        active = [c for c in queue.consumers if not c.paused]
        if not active:
            return
        if exclusive or any(c.id in self._exclusive for c in active):
            raise ResourceLockedError(
                f"subscription {queue.name} already has an active consumer, and it is not shared"
            )

    def subscription_topic(self, name: str) -> str | None:
        """The topic of the durable subscription `name`, if there is one."""
        suffix = f"{_SEPARATOR}{name}"
        for queue_name, queue in self._queues.items():
            if queue.durable and queue_name == f"{queue.address}{suffix}":
                return queue.address
        return None

    def close_consumer(self, consumer_id: int) -> None:
        """Close a consumer; its unsettled deliveries go back to the queue as failed attempts
        (a non-durable subscription is deleted with them)."""
        consumer = self._consumer(consumer_id)
        del self._consumers[consumer_id]
        del self._connections[consumer.connection].consumers[consumer_id]
        queue = consumer.queue
        self._detach(queue, consumer)
        entries = list(consumer.unacked.values())
        consumer.unacked.clear()
        self._exclusive.discard(consumer_id)
        if queue.subscriber == consumer_id or self._last_of_shared(queue):
            self._delete_queue(queue)
        elif entries:
            self._finish(queue, entries, Outcome.FAILED)

    def set_credit(self, consumer_id: int, credit: int | None) -> None:
        """Set the consumer's credit (AMQP flow: link-credit); None is unlimited."""
        if credit is not None and credit < 0:
            raise InvalidRequestError(f"credit must not be negative, not {credit}")
        consumer = self._consumer(consumer_id)
        consumer.credit = _UNLIMITED if credit is None else credit
        self._dirty.add(consumer.queue)

    def add_credit(self, consumer_id: int, credit: int) -> None:
        """Give the consumer more credit (unlimited stays unlimited)."""
        if credit < 0:
            raise InvalidRequestError(f"credit to add must not be negative, not {credit}")
        consumer = self._consumer(consumer_id)
        if consumer.credit != _UNLIMITED:
            consumer.credit += credit
        self._dirty.add(consumer.queue)

    def drain(self, consumer_id: int) -> int:
        """Use up the consumer's remaining credit (AMQP drain, after `poll`); returns how much
        there was, for the flow frame's delivery-count."""
        consumer = self._consumer(consumer_id)
        if consumer.credit == _UNLIMITED:
            raise InvalidRequestError(f"consumer {consumer_id} has unlimited credit to drain")
        left = consumer.credit
        consumer.credit = 0
        return left

    def set_window(self, consumer_id: int, window: int | None) -> None:
        """Change how many unsettled deliveries the consumer may hold; None is unlimited."""
        if window is not None and window < 1:
            raise InvalidRequestError(f"window must be at least 1 or None, not {window}")
        consumer = self._consumer(consumer_id)
        consumer.window = _UNLIMITED if window is None else window
        self._dirty.add(consumer.queue)

    def consumer_info(self, consumer_id: int) -> ConsumerInfo:
        c = self._consumer(consumer_id)
        return ConsumerInfo(
            c.id,
            c.connection,
            c.queue.name,
            c.ack_mode,
            None if c.credit == _UNLIMITED else c.credit,
            None if c.window == _UNLIMITED else c.window,
            len(c.unacked),
            c.paused,
        )

    # --- dispatch ---------------------------------------------------------------------------

    def poll(self, now: float) -> list[Delivery]:
        """Dispatch every message that a consumer has room for; returns the deliveries for
        the protocol layer to write. Messages expired at `now` are dropped on the way."""
        out: list[Delivery] = []
        dirty = self._dirty
        capped: list[_Queue] = []
        while dirty:
            queue = dirty.pop()
            if self._dispatch(queue, now, out):
                capped.append(queue)
        dirty.update(capped)
        return out

    @property
    def dispatch_pending(self) -> bool:
        """A queue may dispatch more: poll again (on the next loop turn)."""
        return bool(self._dirty)

    def _dispatch(self, queue: _Queue, now: float, out: list[Delivery]) -> bool:
        """Dispatch from one queue; True if it stopped at the per-poll cap."""
        consumers = queue.consumers
        n = len(consumers)
        if not n or not queue.size:
            return False
        records = self._records
        durable = queue.durable
        i = queue.rr
        budget = self._config.dispatch_per_poll or _UNLIMITED
        while queue.size:
            if budget <= 0:
                queue.rr = i
                return True
            budget -= 1
            for _ in range(n):
                if i >= n:
                    i = 0
                consumer = consumers[i]
                i += 1
                if (
                    consumer.credit > 0
                    and len(consumer.unacked) < consumer.window
                    and not consumer.paused
                ):
                    break
            else:
                break  # nobody has room: an ack or more credit will mark the queue again
            entry = self._take(queue, now)
            if entry is None:
                break
            if consumer.credit != _UNLIMITED:
                consumer.credit -= 1
            tag = self._next_tag
            self._next_tag = tag + 1
            message = entry.message
            out.append(Delivery(consumer.id, tag, message, entry.delivery_count, entry.redelivered))
            if consumer.auto:
                queue.acknowledged += 1
                self._leave(queue, entry.size)
                if durable and message.persistent:
                    records.append(MessageAck(queue.name, message.id))
            else:
                consumer.unacked[tag] = entry
                queue.in_flight += 1
        queue.rr = i
        return False

    def _take(self, queue: _Queue, now: float) -> _Entry | None:
        """Pop the next deliverable entry, dropping expired ones on the way."""
        for dq in queue.order:
            while dq:
                entry = dq.popleft()
                queue.size -= 1
                expiration = entry.message.expiration
                if expiration is not None and expiration <= now:
                    self._expire(queue, entry)
                    continue
                return entry
        return None

    def _expire(self, queue: _Queue, entry: _Entry) -> None:
        queue.expired += 1
        self._leave(queue, entry.size)
        self._expired += 1
        if queue.durable and entry.message.persistent:
            self._records.append(MessageAck(queue.name, entry.message.id))

    def expire(self, now: float) -> int:
        """Drop every waiting message expired at `now` (dispatch drops them anyway; this
        frees the memory of queues nobody consumes). Returns how many were dropped."""
        dropped = 0
        if not self._ever_expiring:
            # No message with an expiration ever entered: nothing to walk. The server calls
            # this four times a second, and a walk of a million waiting messages takes the
            # loop longer than that.
            return dropped
        for queue in self._queues.values():
            for dq in queue.order:
                if not any(e.message.is_expired(now) for e in dq):
                    continue
                keep: list[_Entry] = []
                for entry in dq:
                    if entry.message.is_expired(now):
                        self._expire(queue, entry)
                    else:
                        keep.append(entry)
                dropped += len(dq) - len(keep)
                queue.size -= len(dq) - len(keep)
                dq.clear()
                dq.extend(keep)
        return dropped

    # --- settlement -------------------------------------------------------------------------

    def ack(self, consumer_id: int, tag: int, *, tx: int | None = None) -> int:
        """Acknowledge delivery `tag` (CLIENT: and every earlier one of the consumer);
        returns how many deliveries this settled."""
        if tx is None:
            # The common case, kept short: one individual ack outside a transaction.
            consumer = self._consumers.get(consumer_id)
            if consumer is not None and consumer.individual:
                entry = consumer.unacked.pop(tag, None)
                if entry is not None:
                    queue = consumer.queue
                    queue.in_flight -= 1
                    queue.acknowledged += 1
                    self._leave(queue, entry.size)
                    message = entry.message
                    if queue.durable and message.persistent:
                        self._records.append(MessageAck(queue.name, message.id))
                    if queue.size:
                        self._dirty.add(queue)
                    return 1
        return self.settle(consumer_id, tag, Outcome.ACCEPTED, tx=tx)

    def nack(self, consumer_id: int, tag: int, *, tx: int | None = None) -> int:
        """STOMP NACK: the delivery failed; the message goes back (or to the dead-letter
        queue after its last attempt)."""
        return self.settle(consumer_id, tag, Outcome.FAILED, tx=tx)

    def settle(self, consumer_id: int, tag: int, outcome: Outcome, *, tx: int | None = None) -> int:
        """End delivery `tag` (CLIENT: and every earlier one of the consumer) with `outcome`,
        now or, inside transaction `tx`, at its commit. Returns how many were settled."""
        consumer = self._consumer(consumer_id)
        transaction = None if tx is None else self._transaction(tx)
        if transaction is not None and transaction.connection != consumer.connection:
            raise InvalidRequestError(
                f"transaction {tx} and consumer {consumer_id} belong to different connections"
            )
        unacked = consumer.unacked
        if tag not in unacked:
            if consumer.auto:
                raise UnknownDeliveryError(
                    f"consumer {consumer_id} is in auto ack mode: its deliveries are settled "
                    "when sent"
                )
            raise UnknownDeliveryError(f"consumer {consumer_id} has no unsettled delivery {tag}")
        if consumer.individual:
            entries = [unacked.pop(tag)]
        else:
            tags: list[int] = []
            for t in unacked:
                if t > tag:
                    break
                tags.append(t)
            entries = [unacked.pop(t) for t in tags]
        queue = consumer.queue
        if transaction is not None:
            transaction.settles.extend((queue, e, outcome) for e in entries)
        else:
            self._finish(queue, entries, outcome)
        if queue.size:
            self._dirty.add(queue)  # the window reopened
        return len(entries)

    def _finish(self, queue: _Queue, entries: list[_Entry], outcome: Outcome) -> None:
        """Apply `outcome` to in-flight entries of `queue`."""
        queue.in_flight -= len(entries)
        records = self._records
        durable = queue.durable
        if outcome is Outcome.ACCEPTED:
            queue.acknowledged += len(entries)
            self._leave(queue, sum(e.size for e in entries), len(entries))
            if durable:
                records.extend(
                    MessageAck(queue.name, e.message.id) for e in entries if e.message.persistent
                )
            return
        is_dlq = queue.name == self._dlq_name
        if outcome is Outcome.REJECTED and not is_dlq:
            for entry in entries:
                self._dead_letter(queue, entry)
            return
        counted = outcome is not Outcome.RELEASED
        limit = self._max_attempts
        back: list[_Entry] = []
        for entry in entries:
            entry.redelivered = True
            if counted:
                entry.delivery_count += 1
                # The dead-letter queue itself keeps what fails in it: moving a message from
                # it to itself would only lose its place.
                if limit is not None and entry.delivery_count >= limit and not is_dlq:
                    self._dead_letter(queue, entry)
                    continue
                if durable and entry.message.persistent:
                    records.append(
                        DeliveryCount(queue.name, entry.message.id, entry.delivery_count)
                    )
            back.append(entry)
        if back:
            self._requeue(queue, back)

    def _requeue(self, queue: _Queue, entries: list[_Entry]) -> None:
        """Put entries back where their sequence numbers say they belong."""
        entries.sort(key=_seq_of, reverse=True)
        for entry in entries:
            dq = queue.level(entry.message.priority)
            if not dq or entry.seq < dq[0].seq:
                dq.appendleft(entry)  # the usual case: back at the head
            else:
                dq.insert(bisect_left(dq, entry.seq, key=_seq_of), entry)
        queue.size += len(entries)
        if queue.consumers:
            self._dirty.add(queue)

    def _dead_letter(self, queue: _Queue, entry: _Entry) -> None:
        """Move an entry that left `queue` to the dead-letter queue (or drop it, if none)."""
        queue.dead_lettered += 1
        self._leave(queue, entry.size)
        self._dead_lettered += 1
        message = entry.message
        dlq_name = self._dlq_name
        if dlq_name is None:
            if queue.durable and message.persistent:
                self._records.append(MessageAck(queue.name, message.id))
            return
        dlq = self._queues.get(dlq_name)
        if dlq is None:
            dlq = self._create_queue(dlq_name, dlq_name, durable=True)
        new_id = self._next_message_id
        self._next_message_id = new_id + 1
        copy = dead_letter_copy(message, queue.name, new_id, dlq_name)
        if message.persistent:
            if queue.durable:
                self._records.append(DeadLetter(queue.name, message.id, dlq_name, new_id))
            else:
                self._records.append(MessageAdd(dlq.names, copy))
        self._push_new(dlq, copy)

    # --- transactions -----------------------------------------------------------------------

    def begin(self, connection_id: int, name: str | None = None) -> int:
        """Start a transaction on the connection; returns its id. `name` is the client's
        name for it (STOMP), unique on the connection while it is open."""
        connection = self._connection(connection_id)
        if name is not None and name in connection.tx_names:
            raise InvalidRequestError(f"transaction {name!r} is already open on this connection")
        tx_id = self._next_tx_id
        self._next_tx_id += 1
        transaction = _Transaction(tx_id, connection_id, name)
        self._transactions[tx_id] = transaction
        connection.transactions[tx_id] = transaction
        if name is not None:
            connection.tx_names[name] = tx_id
        return tx_id

    def transaction_id(self, connection_id: int, name: str) -> int:
        """The id of the open transaction the client named `name` on this connection."""
        tx_id = self._connection(connection_id).tx_names.get(name)
        if tx_id is None:
            raise UnknownTransactionError(f"no open transaction {name!r} on this connection")
        return tx_id

    def commit(self, tx: int) -> int:
        """Commit: route the held sends (dropping duplicates) and apply the settlements, as one
        atomic group of records. Returns how many sends were dropped as duplicates."""
        transaction = self._transaction(tx)
        if self._refusal is not None and any(m.persistent for m, _, _ in transaction.sends):
            self._end_transaction(transaction)
            self._rollback(transaction)
            raise DiskFullError(
                f"transaction rolled back: its persistent sends are refused: {self._refusal}"
            )
        self._end_transaction(transaction)
        records = self._records
        mark = len(records)
        dropped = 0
        for message, targets, duplicate_id in transaction.sends:
            if duplicate_id is not None:
                cache = self._duplicates.get(message.address)
                if cache is not None and duplicate_id in cache.ids:
                    dropped += 1
                    continue
            self._route(message, [q for q in targets if not q.deleted], duplicate_id, tx)
        self._duplicates_dropped += dropped
        later: list[tuple[_Queue, _Entry, Outcome]] = []
        for queue, entry, outcome in transaction.settles:
            if queue.deleted:
                continue
            if outcome is Outcome.ACCEPTED:
                queue.in_flight -= 1
                queue.acknowledged += 1
                self._leave(queue, entry.size)
                if queue.durable and entry.message.persistent:
                    records.append(TxAck(tx, queue.name, entry.message.id))
            else:
                later.append((queue, entry, outcome))
        if len(records) > mark:
            records.append(TxCommit(tx))
        # Requeues and dead-letter moves are not part of the atomic group: losing one in a
        # crash only loses a delivery count, never a message.
        for queue, entry, outcome in later:
            self._finish(queue, [entry], outcome)
        return dropped

    def rollback(self, tx: int) -> None:
        """Abort: drop the held sends; settled messages go back as failed deliveries."""
        transaction = self._transaction(tx)
        self._end_transaction(transaction)
        self._rollback(transaction)

    def _end_transaction(self, transaction: _Transaction) -> None:
        for message, targets, _ in transaction.sends:
            size = _message_size(message)
            for queue in targets:
                self._unreserve(queue.usage, size, 1)  # a commit counts what it routes
        del self._transactions[transaction.id]
        connection = self._connections[transaction.connection]
        del connection.transactions[transaction.id]
        if transaction.name is not None:
            del connection.tx_names[transaction.name]

    def _rollback(self, transaction: _Transaction) -> None:
        by_queue: dict[_Queue, list[_Entry]] = {}
        for queue, entry, _ in transaction.settles:
            if not queue.deleted:
                by_queue.setdefault(queue, []).append(entry)
        for queue, entries in by_queue.items():
            self._finish(queue, entries, Outcome.FAILED)

    # --- lookups ----------------------------------------------------------------------------

    def _connection(self, connection_id: int) -> _Connection:
        connection = self._connections.get(connection_id)
        if connection is None:
            raise UnknownConnectionError(f"connection {connection_id} is not open")
        return connection

    def _consumer(self, consumer_id: int) -> _Consumer:
        consumer = self._consumers.get(consumer_id)
        if consumer is None:
            raise UnknownConsumerError(f"consumer {consumer_id} does not exist")
        return consumer

    def _transaction(self, tx: int) -> _Transaction:
        transaction = self._transactions.get(tx)
        if transaction is None:
            raise UnknownTransactionError(f"transaction {tx} is not open")
        return transaction

    def _queue(self, name: str) -> _Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise UnknownAddressError(f"queue {name} does not exist")
        return queue

    # --- queue lifecycle --------------------------------------------------------------------

    def _create_queue(
        self,
        name: str,
        address: str,
        *,
        durable: bool,
        temporary: bool = False,
        owner: int | None = None,
        subscriber: int | None = None,
        record: bool = True,
    ) -> _Queue:
        queue = _Queue(
            name,
            address,
            durable=durable,
            temporary=temporary,
            owner=owner,
            subscriber=subscriber,
            usage=self._usage(address),
        )
        self._queues[name] = queue
        if address != name:
            self._topics.setdefault(address, []).append(queue)
        if durable and record:
            self._records.append(QueueCreate(name, address))
        return queue

    def _delete_queue(self, queue: _Queue) -> list[int]:
        closed = [c.id for c in queue.consumers]
        for consumer in list(queue.consumers):
            # Its in-flight messages go with the queue: there is nowhere to return them.
            del self._consumers[consumer.id]
            del self._connections[consumer.connection].consumers[consumer.id]
        queue.consumers.clear()
        queue.deleted = True
        # Its messages, waiting and in flight, go with it.
        self._leave(queue, queue.held_bytes, queue.size + queue.in_flight)
        del self._queues[queue.name]
        self._held.pop(queue.name, None)
        self._dirty.discard(queue)
        if queue.owner is not None:
            self._connections[queue.owner].temp_queues.pop(queue.name, None)
        if queue.address != queue.name:
            subscriptions = self._topics[queue.address]
            subscriptions.remove(queue)
            if not subscriptions:
                del self._topics[queue.address]
        address = queue.address
        usage = queue.usage
        if (
            not usage.messages
            and address not in self._queues
            and address not in self._topics
            and self._usages.get(address) is usage
        ):
            del self._usages[address]  # the last queue of the address: forget it
        if queue.durable:
            self._records.append(QueueDelete(queue.name))
        return closed

    @staticmethod
    def _detach(queue: _Queue, consumer: _Consumer) -> None:
        index = queue.consumers.index(consumer)
        del queue.consumers[index]
        if index < queue.rr:
            queue.rr -= 1  # keep the round-robin turn on the same next consumer

    # --- status -----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        queues = tuple(
            QueueStats(
                q.name,
                q.address,
                q.durable,
                q.temporary,
                q.size,
                q.in_flight,
                len(q.consumers),
                q.enqueued,
                q.acknowledged,
                q.dead_lettered,
                q.expired,
            )
            for q in self._queues.values()
        )
        return EngineStats(
            queues,
            len(self._connections),
            len(self._consumers),
            len(self._transactions),
            sum(q.messages for q in queues),
            sum(q.in_flight for q in queues),
            self._dead_lettered,
            self._expired,
            self._duplicates_dropped,
        )

    # --- persistence ------------------------------------------------------------------------

    def _stored_entries(self, queue: _Queue) -> list[_Entry]:
        """Every entry of a queue, in flight or not, in the order recovery would give it."""
        entries = queue.waiting()  # already in that order
        extra = len(entries)
        for consumer in queue.consumers:
            entries.extend(consumer.unacked.values())
        for transaction in self._transactions.values():
            entries.extend(e for q, e, _ in transaction.settles if q is queue)
        if len(entries) > extra:
            entries.sort(key=lambda e: (-e.message.priority, e.seq))
        return entries

    def persistent_state(self) -> PersistentState:
        """What a recovery from this engine's records must rebuild."""
        queues = {
            q.name: DurableQueueState(
                q.address,
                tuple(
                    StoredMessage(e.message, e.delivery_count)
                    for e in self._stored_entries(q)
                    if e.message.persistent
                ),
            )
            for q in self._queues.values()
            if q.durable
        }
        duplicate_ids = {a: tuple(c.order) for a, c in self._duplicates.items() if c.order}
        return PersistentState(queues, duplicate_ids)

    def checkpoint(self) -> list[Record]:
        """The shortest record stream that rebuilds this engine's persistent state."""
        return list(self._copy_state(0).body())

    def take_checkpoint(self) -> Checkpoint:
        """A checkpoint with a new id, to be journaled right after the records drained so far.

        Its effect on recovery (see `records`): once its CHECKPOINT_END is read, everything
        journaled before its CHECKPOINT_BEGIN is moot. Records not yet drained belong before
        it, but it already covers their effect, so they must be drained (and journaled) first.
        Copying the state is quick; turning it into records is left to `Checkpoint`.
        """
        if self._records:
            raise InvalidRequestError(
                f"{len(self._records)} records not drained: journal them before a checkpoint"
            )
        checkpoint_id = self._next_checkpoint_id
        self._next_checkpoint_id = checkpoint_id + 1
        self._torn_checkpoint = False
        return self._copy_state(checkpoint_id)

    @property
    def torn_checkpoint(self) -> bool:
        """Recovery ended inside a checkpoint whose CHECKPOINT_END never reached the journal.

        Recovery would read whatever is appended after such a tail as part of that checkpoint,
        until a newer CHECKPOINT_BEGIN supersedes it: the first thing journaled after this
        recovery must be a new checkpoint (`take_checkpoint`, which clears this flag).
        """
        return self._torn_checkpoint

    def _copy_state(self, checkpoint_id: int) -> Checkpoint:
        # Lists of messages that exist already, not a tuple per message: allocating hundreds
        # of thousands of objects in one go sets off garbage collections over the whole heap,
        # which cost ten times the copy.
        queues: list[_QueueCopy] = []
        for queue in self._queues.values():
            if queue.durable:
                entries = [e for e in self._stored_entries(queue) if e.message.persistent]
                counts = {e.message.id: e.delivery_count for e in entries if e.delivery_count}
                messages = [e.message for e in entries]
                queues.append((queue.name, queue.address, queue.names, messages, counts))
        duplicates = tuple(
            (address, tuple((i, cache.ids[i]) for i in cache.order))
            for address, cache in self._duplicates.items()
        )
        return Checkpoint(
            checkpoint_id, self._next_message_id, self._next_tx_id, tuple(queues), duplicates
        )

    @classmethod
    def recover(cls, records: Iterable[Record], config: EngineConfig | None = None) -> Engine:
        """Build an engine from a record stream (a journal, in order): durable queues, their
        persistent messages (all marked redelivered), the dead-letter queue and the
        duplicate-id caches, with committed transactions only.

        A complete checkpoint (CHECKPOINT_BEGIN, its records, CHECKPOINT_END) replaces the
        state rebuilt so far with the one it holds; one without its END is ignored with what
        follows it (see `torn_checkpoint`). Ids never go back: message and transaction ids
        stay above every one the stream used, discarded parts included.

        Records that refer to something already gone (which a consistent journal never
        holds) are skipped rather than refused, so that one bad record cannot keep a backup
        from taking over.
        """
        return _Recovery(lambda: cls(config)).replay(records)


# One durable queue in a checkpoint: name, address, the names its MESSAGE_ADDs carry, its
# persistent messages in queue order, and the failed-delivery counts that are not 0 by id.
_QueueCopy = tuple[str, str, tuple[str, ...], list[Message], dict[int, int]]


@attrs.frozen(eq=False)
class Checkpoint:
    """A copy of an engine's persistent state, taken at one instant of its event loop.

    It holds only immutable values (messages, names, counts), so `records()` and `encode()`
    may run later and on another thread: the store encodes a large checkpoint on its
    journal thread rather than holding up the event loop.
    """

    checkpoint_id: int
    next_message_id: int
    next_tx_id: int
    queues: tuple[_QueueCopy, ...]
    duplicate_ids: tuple[tuple[str, tuple[tuple[str, float], ...]], ...]  # (id, time)

    def body(self) -> Iterator[Record]:
        """The state as the shortest record stream that rebuilds it (`Engine.checkpoint`)."""
        yield IdWatermark(self.next_message_id, self.next_tx_id)
        for name, address, names, messages, counts in self.queues:
            yield QueueCreate(name, address)
            for message in messages:
                yield MessageAdd(names, message)
                delivery_count = counts.get(message.id)
                if delivery_count:
                    yield DeliveryCount(name, message.id, delivery_count)
        for address, ids in self.duplicate_ids:
            for duplicate_id, at in ids:
                yield DuplicateId(address, duplicate_id, at)

    def records(self) -> Iterator[Record]:
        """The checkpoint as journaled: CHECKPOINT_BEGIN, `body()`, CHECKPOINT_END."""
        yield CheckpointBegin(self.checkpoint_id)
        yield from self.body()
        yield CheckpointEnd(self.checkpoint_id)

    def encode(self) -> list[tuple[int, bytes]]:
        """`records()`, encoded for the journal."""
        return [record.encode() for record in self.records()]


class _Recovery:
    """Replays a record stream: the state so far, and a checkpoint being read beside it.

    Records outside checkpoints go to the state so far. A CHECKPOINT_BEGIN starts a fresh
    replay that gets every record after it; its CHECKPOINT_END makes that replay the state
    so far. A newer BEGIN drops an unfinished one; the end of the stream drops it too.
    """

    def __init__(self, new_engine: Callable[[], Engine]) -> None:
        self.new_engine = new_engine
        self.state = _Replay(new_engine(), self)
        self.open: tuple[int, _Replay] | None = None  # the checkpoint being read
        self.next_message_id = self.state.engine._next_message_id
        self.next_tx_id = 1
        self.next_checkpoint_id = 1

    def replay(self, records: Iterable[Record]) -> Engine:
        target = self.state
        for record in records:
            kind = type(record)
            if kind is CheckpointBegin or kind is CheckpointEnd:
                target = self._frame(record)
            else:
                target.apply(record)
        engine = self.state.finish()
        engine._next_message_id = self.next_message_id
        engine._next_tx_id = self.next_tx_id
        engine._next_checkpoint_id = self.next_checkpoint_id
        engine._torn_checkpoint = self.open is not None
        return engine

    def _frame(self, record: Record) -> _Replay:
        """Apply a checkpoint's BEGIN or END; return where the next records go."""
        assert isinstance(record, CheckpointBegin | CheckpointEnd)
        checkpoint_id = record.checkpoint_id
        self.next_checkpoint_id = max(self.next_checkpoint_id, checkpoint_id + 1)
        if isinstance(record, CheckpointBegin):
            self.open = (checkpoint_id, _Replay(self.new_engine(), self))
        elif self.open is not None and self.open[0] == checkpoint_id:
            self.state = self.open[1]
            self.open = None
        # An END without its BEGIN is skipped like any record about something gone.
        return self.state if self.open is None else self.open[1]


class _Replay:
    """Applies records to a fresh engine.

    While replaying, each queue's messages live in a dict keyed by message id (insertion
    order is queue order), so an ack anywhere in a long queue costs O(1); the queues' deques
    are built once at the end.
    """

    def __init__(self, engine: Engine, ids: _Recovery) -> None:
        self.engine = engine
        self.ids = ids  # the id watermarks, shared by every replay of one stream
        self.staged: dict[str, dict[int, _Entry]] = {}
        self.pending: dict[int, list[Record]] = {}
        self.recovered_at = engine.config.clock()

    def finish(self) -> Engine:
        engine = self.engine
        seq = engine._next_seq
        for name, entries in self.staged.items():
            queue = engine._queues[name]
            for entry in entries.values():
                entry.seq = seq
                seq += 1
                queue.level(entry.message.priority).append(entry)
            queue.size = len(entries)
            queue.enqueued = len(entries)
            if any(entry.message.expiration is not None for entry in entries.values()):
                engine._ever_expiring = True
            held = sum(entry.size for entry in entries.values())
            queue.held_bytes = held
            queue.usage.bytes += held
            queue.usage.messages += len(entries)
        engine._next_seq = seq
        engine._records.clear()
        return engine

    def apply(self, record: Record) -> None:
        engine = self.engine
        if isinstance(record, MessageAdd):
            self._add(record.queues, record.message, record.duplicate_id, record.duplicate_time)
        elif isinstance(record, MessageAck):
            staged = self.staged.get(record.queue)
            if staged is not None:
                staged.pop(record.message_id, None)
        elif isinstance(record, DeliveryCount):
            entry = self.staged.get(record.queue, {}).get(record.message_id)
            if entry is not None:
                entry.delivery_count = record.count
        elif isinstance(record, DeadLetter):
            self._dead_letter(record)
        elif isinstance(record, DuplicateId):
            if engine._config.duplicate_cache_size:
                engine._remember(record.address, record.duplicate_id, self._time(record.time))
        elif isinstance(record, TxAdd | TxAck | TxDuplicateId):
            # Held until the transaction's TX_COMMIT; never applied without one.
            self._see_tx(record.tx)
            if isinstance(record, TxAdd):
                self._see_message(record.message.id)
            self.pending.setdefault(record.tx, []).append(record)
        elif isinstance(record, TxCommit):
            self._see_tx(record.tx)
            for held in self.pending.pop(record.tx, ()):
                if isinstance(held, TxAdd):
                    self._add(held.queues, held.message, held.duplicate_id, held.duplicate_time)
                elif isinstance(held, TxAck):
                    self.apply(MessageAck(held.queue, held.message_id))
                elif isinstance(held, TxDuplicateId):
                    self.apply(DuplicateId(held.address, held.duplicate_id, held.time))
        elif isinstance(record, TxRollback):
            self._see_tx(record.tx)
            self.pending.pop(record.tx, None)
        elif isinstance(record, QueueCreate):
            if record.queue not in engine._queues:
                engine._create_queue(record.queue, record.address, durable=True, record=False)
                self.staged[record.queue] = {}
        elif isinstance(record, QueueDelete):
            queue = engine._queues.get(record.queue)
            if queue is not None:
                engine._delete_queue(queue)
                self.staged.pop(record.queue, None)
        elif isinstance(record, IdWatermark):
            ids = self.ids
            ids.next_message_id = max(ids.next_message_id, record.next_message_id)
            ids.next_tx_id = max(ids.next_tx_id, record.next_tx_id)

    def _see_tx(self, tx: int) -> None:
        # Ids of transactions that never committed are burnt too: reusing one would attach
        # its orphaned records to a new transaction's commit.
        if tx >= self.ids.next_tx_id:
            self.ids.next_tx_id = tx + 1

    def _see_message(self, message_id: int) -> None:
        if message_id >= self.ids.next_message_id:
            self.ids.next_message_id = message_id + 1

    def _time(self, at: float | None) -> float:
        # A record from before times were journaled: count the id from its recovery, which
        # keeps it at least as long as the retention promises.
        return self.recovered_at if at is None else at

    def _add(
        self,
        queues: tuple[str, ...],
        message: Message,
        duplicate_id: str | None,
        duplicate_time: float | None,
    ) -> None:
        self._see_message(message.id)
        for name in queues:
            staged = self.staged.get(name)
            if staged is not None:
                staged[message.id] = _Entry(message, 0, 0, True)
        if duplicate_id is not None and self.engine._config.duplicate_cache_size:
            self.engine._remember(message.address, duplicate_id, self._time(duplicate_time))

    def _dead_letter(self, record: DeadLetter) -> None:
        self._see_message(record.new_message_id)
        entry = self.staged.get(record.queue, {}).pop(record.message_id, None)
        target = self.staged.get(record.dead_letter_queue)
        if entry is None or target is None:
            return
        copy = dead_letter_copy(
            entry.message, record.queue, record.new_message_id, record.dead_letter_queue
        )
        target[copy.id] = _Entry(copy, 0, 0, True)
