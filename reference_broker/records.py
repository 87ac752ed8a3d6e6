"""Persistent record types of the messaging engine and their binary encoding.

This module owns the vocabulary of what survives a crash or a failover: every state change
the engine must not forget is one of the small frozen values below. The journal stores them
as opaque `(type, payload)` pairs; `Record.encode()` produces that pair and `decode()` turns
it back into the value. The engine produces records and `Engine.recover` consumes them; this
module must never touch files, sockets or the engine's state.

Theory of operation
-------------------
- A queue exists from its QUEUE_CREATE to its QUEUE_DELETE (durable queues only; temporary
  queues and non-durable subscriptions are never written).
- A persistent message enters durable queues with MESSAGE_ADD (one record names every durable
  queue it was routed to, so a topic fan-out stores the body once) and leaves a queue with
  MESSAGE_ACK (acknowledged or expired) or DEAD_LETTER (moved to the dead-letter queue under a
  new id). DELIVERY_COUNT keeps the failed-delivery count across a requeue. The order of
  MESSAGE_ADD and DEAD_LETTER records is the order of every queue.
- DUPLICATE_ID enters an id in an address's duplicate-id cache; MESSAGE_ADD carries the id of
  the message it adds, so a stamped send costs one record, not two. Each carries the time
  (wall clock, seconds) the id entered the cache, so that the retention by time survives a
  restart and a failover; records written before times were kept have none (None), and the
  engine then counts the id from when it recovers it.
- A transaction is written only when it commits: its TX_ADD, TX_ACK and TX_DUPLICATE_ID
  records, then TX_COMMIT. Recovery applies a transaction at its TX_COMMIT and ignores one
  whose TX_COMMIT never reached the journal (a torn tail), so a commit is all or nothing.
  TX_ROLLBACK discards a transaction's records; the engine never needs to write it (an
  aborted transaction has written nothing) but recovery honours it.
- ID_WATERMARK keeps message and transaction ids from being reused after a journal has been
  rebuilt from a checkpoint that no longer holds the highest ids.
- CHECKPOINT_BEGIN and CHECKPOINT_END (same id) frame a checkpoint: the shortest record
  stream that rebuilds the whole persistent state (ID_WATERMARK, QUEUE_CREATE, MESSAGE_ADD,
  DELIVERY_COUNT, DUPLICATE_ID), journaled as one batch after every record before it. Once
  recovery reads the END, the state is what the framed records rebuild, and every record
  before the BEGIN is moot: that is what lets the journal delete the segments before it. A
  BEGIN whose END never reached the journal (a torn tail) is ignored with what follows it,
  until the next BEGIN, which supersedes it; so the first thing a node journals after
  recovering such a tail is a new checkpoint.

Encoding (all integers little-endian)
-------------------------------------
- name: u16 byte length + UTF-8 (queue names, addresses, duplicate ids).
- text: u32 byte length + UTF-8 (header names and values); blob: u32 length + bytes (body).
- UTF-8 uses "surrogatepass" so that every Python str round-trips.
- A message: u64 id, u8 flags (1 persistent, 2 has expiration, 4 has duplicate id, 8 has
  duplicate time, only with 4), u8 priority, f64 expiration (0.0 when none), u32 header
  count, name address, [name duplicate id, [f64 duplicate time]], header count x (text name,
  text value), blob body.
- DUPLICATE_ID: name address, name duplicate id, [f64 time].  TX_DUPLICATE_ID: u64 tx, then
  the same.
- MESSAGE_ADD: u16 queue count, that many names, then a message.  TX_ADD: u64 tx, then the same.
- CHECKPOINT_BEGIN, CHECKPOINT_END: u64 checkpoint id.

This encoding is RECORD_FORMAT: the journal writes it into every segment and replication
compares it at SYNC_BEGIN, so that a node never reads records another encoding wrote. Raise it
with any change older code cannot decode; the decoder of format 1 also reads every record
written before formats were recorded (duplicate times are optional).
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Final

import attrs

from reference_broker.message import BrokerError, Message

__all__ = [
    "ENGINE_RECORD_TYPES",
    "RECORD_FORMAT",
    "CheckpointBegin",
    "CheckpointEnd",
    "DeadLetter",
    "DeliveryCount",
    "DuplicateId",
    "IdWatermark",
    "MessageAck",
    "MessageAdd",
    "QueueCreate",
    "QueueDelete",
    "Record",
    "RecordError",
    "RecordType",
    "TxAck",
    "TxAdd",
    "TxCommit",
    "TxDuplicateId",
    "TxRollback",
    "decode",
    "encode_all",
]


# The version of the encoding below (see the module's docstring).
RECORD_FORMAT: Final = 1


class RecordError(BrokerError, ValueError):
    """A record that cannot be encoded, or bytes that are not a valid record."""

    code: ClassVar[str] = "CORRUPT_RECORD"


class RecordType(enum.IntEnum):
    """The journal's type byte for each engine record.

    The engine uses 0x20-0x3F so that the server may keep records of its own (activation
    sequence, topology) in the same journal under other type bytes.
    """

    QUEUE_CREATE = 0x20
    QUEUE_DELETE = 0x21
    MESSAGE_ADD = 0x22
    MESSAGE_ACK = 0x23
    DELIVERY_COUNT = 0x24
    DEAD_LETTER = 0x25
    DUPLICATE_ID = 0x26
    TX_ADD = 0x27
    TX_ACK = 0x28
    TX_DUPLICATE_ID = 0x29
    TX_COMMIT = 0x2A
    TX_ROLLBACK = 0x2B
    ID_WATERMARK = 0x2C
    CHECKPOINT_BEGIN = 0x2D
    CHECKPOINT_END = 0x2E


ENGINE_RECORD_TYPES: Final = frozenset(int(t) for t in RecordType)

_FLAG_PERSISTENT: Final = 1
_FLAG_EXPIRES: Final = 2
_FLAG_DUPLICATE_ID: Final = 4
_FLAG_DUPLICATE_TIME: Final = 8
_KNOWN_FLAGS: Final = _FLAG_PERSISTENT | _FLAG_EXPIRES | _FLAG_DUPLICATE_ID | _FLAG_DUPLICATE_TIME

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U64_U64 = struct.Struct("<QQ")
_U64_U32 = struct.Struct("<QI")
_F64 = struct.Struct("<d")
_MESSAGE_HEAD = struct.Struct("<QBBdI")  # id, flags, priority, expiration, header count

_MAX_NAME_BYTES: Final = 0xFFFF
_MAX_U32: Final = 0xFFFFFFFF
_MAX_U64: Final = 0xFFFFFFFFFFFFFFFF


# --- encoding -----------------------------------------------------------------------------


def _name(value: str, what: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    if len(data) > _MAX_NAME_BYTES:
        raise RecordError(f"{what} is {len(data)} bytes long, the limit is {_MAX_NAME_BYTES}")
    return _U16.pack(len(data)) + data


def _u64(value: int, what: str) -> bytes:
    if not 0 <= value <= _MAX_U64:
        raise RecordError(f"{what} {value} does not fit in 64 unsigned bits")
    return _U64.pack(value)


def _time(value: float, what: str) -> bytes:
    if value != value or value in (math.inf, -math.inf):
        raise RecordError(f"{what} must be a finite time, not {value!r}")
    return _F64.pack(value)


def _encode_message(
    message: Message, duplicate_id: str | None, duplicate_time: float | None, parts: list[bytes]
) -> None:
    flags = 0
    if message.persistent:
        flags = _FLAG_PERSISTENT
    expiration = message.expiration
    if expiration is not None:
        if expiration != expiration:  # NaN: decode() would refuse it
            raise RecordError(f"message {message.id} expiration is NaN")
        flags |= _FLAG_EXPIRES
    if duplicate_id is not None:
        flags |= _FLAG_DUPLICATE_ID
        if duplicate_time is not None:
            flags |= _FLAG_DUPLICATE_TIME
    headers = message.headers
    if not 0 <= message.priority <= 9:
        # decode() would refuse it: never write what cannot be read back.
        raise RecordError(f"message {message.id} priority {message.priority} is outside 0-9")
    try:
        parts.append(
            _MESSAGE_HEAD.pack(
                message.id,
                flags,
                message.priority,
                0.0 if expiration is None else expiration,
                len(headers),
            )
        )
    except struct.error as exc:
        raise RecordError(f"message {message.id!r} cannot be encoded: {exc}") from exc
    parts.append(_name(message.address, "address"))
    if duplicate_id is not None:
        parts.append(_name(duplicate_id, "duplicate id"))
        if duplicate_time is not None:
            parts.append(_time(duplicate_time, "duplicate time"))
    pack_u32 = _U32.pack
    for key, value in headers.items():
        k = key.encode("utf-8", "surrogatepass")
        v = value.encode("utf-8", "surrogatepass")
        parts.append(pack_u32(len(k)))
        parts.append(k)
        parts.append(pack_u32(len(v)))
        parts.append(v)
    body = message.body
    if len(body) > _MAX_U32:
        raise RecordError(f"message {message.id} body is {len(body)} bytes, over 4 GiB")
    parts.append(pack_u32(len(body)))
    parts.append(body)


def _encode_queues(queues: tuple[str, ...], parts: list[bytes]) -> None:
    if len(queues) > 0xFFFF:
        raise RecordError(f"a message routed to {len(queues)} queues cannot be encoded")
    parts.append(_U16.pack(len(queues)))
    parts.extend(_name(q, "queue name") for q in queues)


# --- the records ----------------------------------------------------------------------------


@attrs.frozen
class QueueCreate:
    """A durable queue: `address` is the address it is bound to (itself for a queue, the
    topic for a durable subscription)."""

    TYPE: ClassVar[RecordType] = RecordType.QUEUE_CREATE
    queue: str
    address: str

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, _name(self.queue, "queue name") + _name(self.address, "address")


@attrs.frozen
class QueueDelete:
    """A durable queue and every message in it are gone."""

    TYPE: ClassVar[RecordType] = RecordType.QUEUE_DELETE
    queue: str

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, _name(self.queue, "queue name")


@attrs.frozen
class MessageAdd:
    """A persistent message appended to the durable queues it was routed to; its duplicate
    id, if any, enters the cache of `message.address`."""

    TYPE: ClassVar[RecordType] = RecordType.MESSAGE_ADD
    queues: tuple[str, ...]
    message: Message
    duplicate_id: str | None = None
    duplicate_time: float | None = None  # when the id entered the cache (wall clock)

    def encode(self) -> tuple[int, bytes]:
        parts: list[bytes] = []
        _encode_queues(self.queues, parts)
        _encode_message(self.message, self.duplicate_id, self.duplicate_time, parts)
        return self.TYPE, b"".join(parts)


@attrs.frozen
class MessageAck:
    """A message left a queue for good: acknowledged, expired, or dropped after its last
    delivery attempt when no dead-letter queue is configured."""

    TYPE: ClassVar[RecordType] = RecordType.MESSAGE_ACK
    queue: str
    message_id: int

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, _name(self.queue, "queue name") + _u64(self.message_id, "message id")


@attrs.frozen
class DeliveryCount:
    """A message went back to its queue after `count` failed delivery attempts."""

    TYPE: ClassVar[RecordType] = RecordType.DELIVERY_COUNT
    queue: str
    message_id: int
    count: int

    def encode(self) -> tuple[int, bytes]:
        if not 0 <= self.count <= _MAX_U32:
            raise RecordError(f"delivery count {self.count} does not fit in 32 unsigned bits")
        _u64(self.message_id, "message id")
        return self.TYPE, _name(self.queue, "queue name") + _U64_U32.pack(
            self.message_id, self.count
        )


@attrs.frozen
class DeadLetter:
    """A message moved from `queue` to the tail of `dead_letter_queue` as a new message with
    id `new_message_id` (see `engine.dead_letter_copy` for how the copy is made)."""

    TYPE: ClassVar[RecordType] = RecordType.DEAD_LETTER
    queue: str
    message_id: int
    dead_letter_queue: str
    new_message_id: int

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, b"".join(
            (
                _name(self.queue, "queue name"),
                _u64(self.message_id, "message id"),
                _name(self.dead_letter_queue, "dead-letter queue name"),
                _u64(self.new_message_id, "message id"),
            )
        )


@attrs.frozen
class DuplicateId:
    """A duplicate id entered the cache of `address` without a MESSAGE_ADD to carry it (the
    message went to no durable queue)."""

    TYPE: ClassVar[RecordType] = RecordType.DUPLICATE_ID
    address: str
    duplicate_id: str
    time: float | None = None  # when the id entered the cache (wall clock)

    def encode(self) -> tuple[int, bytes]:
        payload = _name(self.address, "address") + _name(self.duplicate_id, "duplicate id")
        if self.time is not None:
            payload += _time(self.time, "duplicate time")
        return self.TYPE, payload


@attrs.frozen
class TxAdd:
    """MESSAGE_ADD inside transaction `tx`: applied at its TX_COMMIT."""

    TYPE: ClassVar[RecordType] = RecordType.TX_ADD
    tx: int
    queues: tuple[str, ...]
    message: Message
    duplicate_id: str | None = None
    duplicate_time: float | None = None

    def encode(self) -> tuple[int, bytes]:
        parts = [_u64(self.tx, "transaction id")]
        _encode_queues(self.queues, parts)
        _encode_message(self.message, self.duplicate_id, self.duplicate_time, parts)
        return self.TYPE, b"".join(parts)


@attrs.frozen
class TxAck:
    """MESSAGE_ACK inside transaction `tx`: applied at its TX_COMMIT."""

    TYPE: ClassVar[RecordType] = RecordType.TX_ACK
    tx: int
    queue: str
    message_id: int

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, b"".join(
            (
                _u64(self.tx, "transaction id"),
                _name(self.queue, "queue name"),
                _u64(self.message_id, "message id"),
            )
        )


@attrs.frozen
class TxDuplicateId:
    """DUPLICATE_ID inside transaction `tx`: applied at its TX_COMMIT."""

    TYPE: ClassVar[RecordType] = RecordType.TX_DUPLICATE_ID
    tx: int
    address: str
    duplicate_id: str
    time: float | None = None

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, b"".join(
            (
                _u64(self.tx, "transaction id"),
                _name(self.address, "address"),
                _name(self.duplicate_id, "duplicate id"),
                b"" if self.time is None else _time(self.time, "duplicate time"),
            )
        )


@attrs.frozen
class TxCommit:
    """Apply every record of transaction `tx`, in their order, now."""

    TYPE: ClassVar[RecordType] = RecordType.TX_COMMIT
    tx: int

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, _u64(self.tx, "transaction id")


@attrs.frozen
class TxRollback:
    """Forget every record of transaction `tx`."""

    TYPE: ClassVar[RecordType] = RecordType.TX_ROLLBACK
    tx: int

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, _u64(self.tx, "transaction id")


@attrs.frozen
class IdWatermark:
    """Ids below these were used: recovery never hands them out again."""

    TYPE: ClassVar[RecordType] = RecordType.ID_WATERMARK
    next_message_id: int
    next_tx_id: int

    def encode(self) -> tuple[int, bytes]:
        _u64(self.next_message_id, "message id")
        _u64(self.next_tx_id, "transaction id")
        return self.TYPE, _U64_U64.pack(self.next_message_id, self.next_tx_id)


@attrs.frozen
class CheckpointBegin:
    """A checkpoint starts: the records up to CHECKPOINT_END with the same id rebuild the
    whole persistent state."""

    TYPE: ClassVar[RecordType] = RecordType.CHECKPOINT_BEGIN
    checkpoint_id: int

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, _u64(self.checkpoint_id, "checkpoint id")


@attrs.frozen
class CheckpointEnd:
    """Checkpoint `checkpoint_id` is complete: it replaces everything before its BEGIN."""

    TYPE: ClassVar[RecordType] = RecordType.CHECKPOINT_END
    checkpoint_id: int

    def encode(self) -> tuple[int, bytes]:
        return self.TYPE, _u64(self.checkpoint_id, "checkpoint id")


Record = (
    QueueCreate
    | QueueDelete
    | MessageAdd
    | MessageAck
    | DeliveryCount
    | DeadLetter
    | DuplicateId
    | TxAdd
    | TxAck
    | TxDuplicateId
    | TxCommit
    | TxRollback
    | IdWatermark
    | CheckpointBegin
    | CheckpointEnd
)


# --- decoding -------------------------------------------------------------------------------


class _Reader:
    """Bounds-checked reads from one payload; any short read raises RecordError."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, payload: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(payload).cast("B")
        self.end = len(self.buf)
        self.pos = 0

    def _take(self, n: int, what: str) -> int:
        start = self.pos
        stop = start + n
        if stop > self.end:
            raise RecordError(
                f"{what} needs {n} bytes at offset {start}, only {self.end - start} left"
            )
        self.pos = stop
        return start

    def unpack(self, fmt: struct.Struct, what: str) -> tuple[Any, ...]:
        return fmt.unpack_from(self.buf, self._take(fmt.size, what))

    def u16(self, what: str) -> int:
        (value,) = _U16.unpack_from(self.buf, self._take(2, what))
        return int(value)

    def u32(self, what: str) -> int:
        (value,) = _U32.unpack_from(self.buf, self._take(4, what))
        return int(value)

    def u64(self, what: str) -> int:
        (value,) = _U64.unpack_from(self.buf, self._take(8, what))
        return int(value)

    def name(self, what: str) -> str:
        n = self.u16(what)
        start = self._take(n, what)
        return str(self.buf[start : start + n], "utf-8", "surrogatepass")

    def text(self, what: str) -> str:
        n = self.u32(what)
        start = self._take(n, what)
        return str(self.buf[start : start + n], "utf-8", "surrogatepass")

    def blob(self, what: str) -> bytes:
        n = self.u32(what)
        start = self._take(n, what)
        return bytes(self.buf[start : start + n])

    def count(self, n: int, min_item_size: int, what: str) -> int:
        # Refuse a count that the rest of the payload cannot hold before looping over it,
        # so that a corrupt count costs nothing.
        if n * min_item_size > self.end - self.pos:
            raise RecordError(
                f"{what} count {n} does not fit in the {self.end - self.pos} bytes left"
            )
        return n

    def time(self, what: str) -> float:
        (value,) = _F64.unpack_from(self.buf, self._take(8, what))
        if not math.isfinite(value):
            raise RecordError(f"{what} is {value!r}, not a finite time")
        return float(value)

    def optional_time(self, what: str) -> float | None:
        return None if self.pos == self.end else self.time(what)

    def finish(self) -> None:
        if self.pos != self.end:
            raise RecordError(f"{self.end - self.pos} unexpected bytes after the record")


def _decode_message(r: _Reader) -> tuple[Message, str | None, float | None]:
    message_id, flags, priority, expiration, n_headers = r.unpack(_MESSAGE_HEAD, "message head")
    if flags & ~_KNOWN_FLAGS:
        raise RecordError(f"unknown message flags {flags:#04x}")
    if priority > 9:
        raise RecordError(f"message priority {priority} is outside 0-9")
    if math.isnan(expiration):
        raise RecordError("message expiration is NaN")
    if not flags & _FLAG_EXPIRES and expiration != 0.0:
        raise RecordError("message without expiration carries an expiration time")
    address = r.name("address")
    duplicate_id = r.name("duplicate id") if flags & _FLAG_DUPLICATE_ID else None
    duplicate_time = None
    if flags & _FLAG_DUPLICATE_TIME:
        if duplicate_id is None:
            raise RecordError("a duplicate time without a duplicate id")
        duplicate_time = r.time("duplicate time")
    headers: dict[str, str] = {}
    for _ in range(r.count(n_headers, 8, "header")):
        key = r.text("header name")
        headers[key] = r.text("header value")
    if len(headers) != n_headers:
        raise RecordError("a header name appears twice")
    body = r.blob("body")
    message = Message(
        message_id,
        address,
        body,
        headers,
        bool(flags & _FLAG_PERSISTENT),
        priority,
        expiration if flags & _FLAG_EXPIRES else None,
    )
    return message, duplicate_id, duplicate_time


def _decode_queues(r: _Reader) -> tuple[str, ...]:
    n = r.count(r.u16("queue count"), 2, "queue")
    return tuple(r.name("queue name") for _ in range(n))


def _queue_create(r: _Reader) -> Record:
    return QueueCreate(r.name("queue name"), r.name("address"))


def _queue_delete(r: _Reader) -> Record:
    return QueueDelete(r.name("queue name"))


def _message_add(r: _Reader) -> Record:
    queues = _decode_queues(r)
    message, duplicate_id, duplicate_time = _decode_message(r)
    return MessageAdd(queues, message, duplicate_id, duplicate_time)


def _message_ack(r: _Reader) -> Record:
    return MessageAck(r.name("queue name"), r.u64("message id"))


def _delivery_count(r: _Reader) -> Record:
    return DeliveryCount(r.name("queue name"), r.u64("message id"), r.u32("delivery count"))


def _dead_letter(r: _Reader) -> Record:
    return DeadLetter(
        r.name("queue name"),
        r.u64("message id"),
        r.name("dead-letter queue name"),
        r.u64("message id"),
    )


def _duplicate_id(r: _Reader) -> Record:
    return DuplicateId(r.name("address"), r.name("duplicate id"), r.optional_time("duplicate time"))


def _tx_add(r: _Reader) -> Record:
    tx = r.u64("transaction id")
    queues = _decode_queues(r)
    message, duplicate_id, duplicate_time = _decode_message(r)
    return TxAdd(tx, queues, message, duplicate_id, duplicate_time)


def _tx_ack(r: _Reader) -> Record:
    return TxAck(r.u64("transaction id"), r.name("queue name"), r.u64("message id"))


def _tx_duplicate_id(r: _Reader) -> Record:
    return TxDuplicateId(
        r.u64("transaction id"),
        r.name("address"),
        r.name("duplicate id"),
        r.optional_time("duplicate time"),
    )


def _tx_commit(r: _Reader) -> Record:
    return TxCommit(r.u64("transaction id"))


def _tx_rollback(r: _Reader) -> Record:
    return TxRollback(r.u64("transaction id"))


def _id_watermark(r: _Reader) -> Record:
    return IdWatermark(r.u64("message id"), r.u64("transaction id"))


def _checkpoint_begin(r: _Reader) -> Record:
    return CheckpointBegin(r.u64("checkpoint id"))


def _checkpoint_end(r: _Reader) -> Record:
    return CheckpointEnd(r.u64("checkpoint id"))


_DECODERS: Final[dict[int, Callable[[_Reader], Record]]] = {
    RecordType.QUEUE_CREATE: _queue_create,
    RecordType.QUEUE_DELETE: _queue_delete,
    RecordType.MESSAGE_ADD: _message_add,
    RecordType.MESSAGE_ACK: _message_ack,
    RecordType.DELIVERY_COUNT: _delivery_count,
    RecordType.DEAD_LETTER: _dead_letter,
    RecordType.DUPLICATE_ID: _duplicate_id,
    RecordType.TX_ADD: _tx_add,
    RecordType.TX_ACK: _tx_ack,
    RecordType.TX_DUPLICATE_ID: _tx_duplicate_id,
    RecordType.TX_COMMIT: _tx_commit,
    RecordType.TX_ROLLBACK: _tx_rollback,
    RecordType.ID_WATERMARK: _id_watermark,
    RecordType.CHECKPOINT_BEGIN: _checkpoint_begin,
    RecordType.CHECKPOINT_END: _checkpoint_end,
}


_U16_AT: Final = _U16.unpack_from
_U32_AT: Final = _U32.unpack_from
_HEAD_AT: Final = _MESSAGE_HEAD.unpack_from
_F64_AT: Final = _F64.unpack_from


def _fast_message_add(payload: bytes) -> Record | None:
    """MESSAGE_ADD without the bounds-checked reader: recovery decodes one per message.

    It accepts only what the validating decoder accepts, and returns None for anything
    unusual (short reads, unknown flags, surplus bytes, bad UTF-8, a repeated header),
    which then goes through the validating decoder for its exact error. A record it does
    return is equal to the one that decoder would build.
    """
    try:
        end = len(payload)
        (count,) = _U16_AT(payload, 0)
        pos = 2
        queues = []
        for _ in range(count):
            (n,) = _U16_AT(payload, pos)
            pos += 2
            if pos + n > end:
                return None
            queues.append(payload[pos : pos + n].decode("utf-8", "surrogatepass"))
            pos += n
        message_id, flags, priority, expiration, n_headers = _HEAD_AT(payload, pos)
        pos += _MESSAGE_HEAD.size
        if flags & ~_KNOWN_FLAGS or priority > 9 or expiration != expiration:
            return None
        has_expiration = flags & _FLAG_EXPIRES
        if not has_expiration and expiration != 0.0:
            return None
        (n,) = _U16_AT(payload, pos)
        pos += 2
        if pos + n > end:
            return None
        address = payload[pos : pos + n].decode("utf-8", "surrogatepass")
        pos += n
        duplicate_id = None
        duplicate_time = None
        if flags & _FLAG_DUPLICATE_ID:
            (n,) = _U16_AT(payload, pos)
            pos += 2
            if pos + n > end:
                return None
            duplicate_id = payload[pos : pos + n].decode("utf-8", "surrogatepass")
            pos += n
            if flags & _FLAG_DUPLICATE_TIME:
                (duplicate_time,) = _F64_AT(payload, pos)
                pos += 8
                if not math.isfinite(duplicate_time):
                    return None
        elif flags & _FLAG_DUPLICATE_TIME:
            return None
        headers: dict[str, str] = {}
        for _ in range(n_headers):
            (n,) = _U32_AT(payload, pos)
            pos += 4
            if pos + n > end:
                return None
            key = payload[pos : pos + n].decode("utf-8", "surrogatepass")
            pos += n
            (n,) = _U32_AT(payload, pos)
            pos += 4
            if pos + n > end:
                return None
            headers[key] = payload[pos : pos + n].decode("utf-8", "surrogatepass")
            pos += n
        if len(headers) != n_headers:
            return None
        (n,) = _U32_AT(payload, pos)
        pos += 4
        if pos + n != end:
            return None
        body = payload[pos:end]
    except (struct.error, UnicodeDecodeError):
        return None
    message = Message(
        message_id,
        address,
        body,
        headers,
        bool(flags & _FLAG_PERSISTENT),
        priority,
        expiration if has_expiration else None,
    )
    return MessageAdd(tuple(queues), message, duplicate_id, duplicate_time)


def decode(record_type: int, payload: bytes | bytearray | memoryview) -> Record:
    """Turn one journal entry back into its record.

    Raises RecordError (a ValueError) for an unknown type byte or a payload that is not
    exactly one valid record of that type, and for nothing else.
    """
    if record_type == RecordType.MESSAGE_ADD and type(payload) is bytes:
        fast = _fast_message_add(payload)
        if fast is not None:
            return fast
    if not isinstance(record_type, int):
        raise RecordError(f"record type must be an int, not {type(record_type).__name__}")
    decoder = _DECODERS.get(record_type)
    if decoder is None:
        raise RecordError(f"unknown record type {record_type:#04x}")
    try:
        reader = _Reader(payload)
        record = decoder(reader)
        reader.finish()
    except RecordError as exc:
        raise RecordError(f"corrupt {RecordType(record_type).name} record: {exc}") from None
    except (struct.error, TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"corrupt {RecordType(record_type).name} record: {exc}") from exc
    return record


def encode_all(records: Iterable[Record]) -> list[tuple[int, bytes]]:
    """Encode records in order (a convenience for tests and checkpoints)."""
    return [record.encode() for record in records]
