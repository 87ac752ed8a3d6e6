"""Records: every record survives encode/decode unchanged, the encoding is stable, and bytes
that are not a record are refused with RecordError and nothing else."""

from __future__ import annotations

import contextlib
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from reference_broker.message import BrokerError, Message
from reference_broker.records import (
    ENGINE_RECORD_TYPES,
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
    RecordError,
    RecordType,
    TxAck,
    TxAdd,
    TxCommit,
    TxDuplicateId,
    TxRollback,
    decode,
)

U64 = st.integers(min_value=0, max_value=2**64 - 1)
U32 = st.integers(min_value=0, max_value=2**32 - 1)
# Any str at all, lone surrogates included: the encoding must carry what Python can hold.
TEXT = st.text(max_size=20)
NAMES = st.text(min_size=1, max_size=30)

messages = st.builds(
    Message,
    id=U64,
    address=NAMES,
    body=st.binary(max_size=200),
    headers=st.dictionaries(TEXT, TEXT, max_size=5),
    persistent=st.booleans(),
    priority=st.integers(min_value=0, max_value=9),
    expiration=st.none() | st.floats(allow_nan=False),
)
queue_lists = st.lists(NAMES, max_size=4).map(tuple)
duplicate_ids = st.none() | TEXT

records: st.SearchStrategy[Record] = st.one_of(
    st.builds(QueueCreate, NAMES, NAMES),
    st.builds(QueueDelete, NAMES),
    st.builds(MessageAdd, queue_lists, messages, duplicate_ids),
    st.builds(MessageAck, NAMES, U64),
    st.builds(DeliveryCount, NAMES, U64, U32),
    st.builds(DeadLetter, NAMES, U64, NAMES, U64),
    st.builds(DuplicateId, NAMES, TEXT),
    st.builds(TxAdd, U64, queue_lists, messages, duplicate_ids),
    st.builds(TxAck, U64, NAMES, U64),
    st.builds(TxDuplicateId, U64, NAMES, TEXT),
    st.builds(TxCommit, U64),
    st.builds(TxRollback, U64),
    st.builds(IdWatermark, U64, U64),
    st.builds(CheckpointBegin, U64),
    st.builds(CheckpointEnd, U64),
)


@given(records)
@example(MessageAdd(("q\ud800",), Message(0, "a", b"", {"\udfff": ""}, expiration=-0.0), ""))
def test_every_record_round_trips(record: Record) -> None:
    record_type, payload = record.encode()
    assert record_type == record.TYPE
    assert record_type in ENGINE_RECORD_TYPES
    assert decode(record_type, payload) == record
    assert decode(record_type, memoryview(payload)) == record
    assert decode(record_type, bytearray(payload)) == record


@given(records)
def test_a_record_is_exactly_its_bytes(record: Record) -> None:
    # The format is self-delimiting: a torn payload or one with a byte too many never
    # passes for a record.
    record_type, payload = record.encode()
    for cut in {0, len(payload) // 2, len(payload) - 1} - {len(payload)}:
        if cut < len(payload):
            with pytest.raises(RecordError):
                decode(record_type, payload[:cut])
    with pytest.raises(RecordError):
        decode(record_type, payload + b"\x00")


@given(st.integers(min_value=0, max_value=255), st.binary(max_size=300))
def test_garbage_is_refused_with_record_error_only(record_type: int, payload: bytes) -> None:
    try:
        record = decode(record_type, payload)
    except RecordError:
        return
    # Whatever decodes must be a record that encodes back to the same bytes.
    assert record.encode() == (record_type, payload)


@given(records, st.data())
def test_corrupted_records_decode_cleanly_or_raise_record_error(
    record: Record, data: st.DataObject
) -> None:
    record_type, payload = record.encode()
    if not payload:
        return
    corrupt = bytearray(payload)
    index = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    corrupt[index] ^= data.draw(st.integers(min_value=1, max_value=255))
    # Either a clean RecordError or a (different) valid record; never another exception.
    with contextlib.suppress(RecordError):
        decode(record_type, bytes(corrupt))


def test_record_error_is_a_broker_error_and_a_value_error() -> None:
    assert issubclass(RecordError, BrokerError)
    assert issubclass(RecordError, ValueError)
    assert RecordError.code == "CORRUPT_RECORD"


@pytest.mark.parametrize(
    ("record_type", "payload", "words"),
    [
        (0x00, b"", "unknown record type 0x00"),
        (0xFF, b"", "unknown record type 0xff"),
        (RecordType.TX_COMMIT, b"\x01", "corrupt TX_COMMIT record"),
        (RecordType.QUEUE_DELETE, b"\x05\x00ab", "queue name needs 5 bytes"),
        (RecordType.QUEUE_DELETE, b"\x01\x00\xff", "corrupt QUEUE_DELETE record"),
        (RecordType.TX_ROLLBACK, b"\x00" * 9, "1 unexpected bytes after the record"),
        (RecordType.CHECKPOINT_BEGIN, b"\x01", "corrupt CHECKPOINT_BEGIN record"),
        (RecordType.CHECKPOINT_END, b"", "checkpoint id needs 8 bytes"),
    ],
)
def test_decode_errors_say_what_was_wrong(record_type: int, payload: bytes, words: str) -> None:
    with pytest.raises(RecordError, match=words):
        decode(record_type, payload)


def test_decode_refuses_non_bytes_and_non_int_types() -> None:
    with pytest.raises(RecordError, match="must be an int"):
        decode("0x20", b"")  # type: ignore[arg-type]
    with pytest.raises(RecordError):
        decode(RecordType.TX_COMMIT, "12345678")  # type: ignore[arg-type]


def _message_add_payload(flags: int, priority: int, expiration: float) -> bytes:
    import struct

    head = struct.pack("<QBBdI", 7, flags, priority, expiration, 0)
    return b"\x00\x00" + head + b"\x01\x00a" + b"\x00\x00\x00\x00"


@pytest.mark.parametrize(
    ("flags", "priority", "expiration", "words"),
    [
        (0x10, 4, 0.0, "unknown message flags"),
        (0x01, 10, 0.0, "priority 10 is outside 0-9"),
        (0x03, 4, math.nan, "NaN"),
        (0x01, 4, 5.0, "without expiration carries an expiration"),
    ],
)
def test_decode_checks_message_fields(
    flags: int, priority: int, expiration: float, words: str
) -> None:
    payload = _message_add_payload(flags, priority, expiration)
    with pytest.raises(RecordError, match=words):
        decode(RecordType.MESSAGE_ADD, payload)


def test_a_valid_hand_built_payload_decodes() -> None:
    record = decode(RecordType.MESSAGE_ADD, _message_add_payload(0x03, 9, 12.5))
    assert record == MessageAdd((), Message(7, "a", b"", {}, True, 9, 12.5))


def test_a_corrupt_header_count_fails_fast() -> None:
    import struct

    head = struct.pack("<QBBdI", 1, 0, 4, 0.0, 2**32 - 1)
    with pytest.raises(RecordError, match="header count 4294967295 does not fit"):
        decode(RecordType.MESSAGE_ADD, b"\x00\x00" + head + b"\x01\x00a")


def test_encoding_is_stable() -> None:
    # Golden bytes: a live and a backup of different versions must read each other's journal.
    message = Message(5, "queue://q", b"hi", {"k": "v"}, True, 4, None)
    assert MessageAdd(("queue://q",), message, "d1").encode() == (
        0x22,
        b"\x01\x00\x09\x00queue://q"
        b"\x05\x00\x00\x00\x00\x00\x00\x00\x05\x04\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00"
        b"\x09\x00queue://q"
        b"\x02\x00d1"
        b"\x01\x00\x00\x00k\x01\x00\x00\x00v"
        b"\x02\x00\x00\x00hi",
    )
    assert MessageAck("q", 258).encode() == (0x23, b"\x01\x00q\x02\x01\x00\x00\x00\x00\x00\x00")
    assert TxCommit(1).encode() == (0x2A, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    assert CheckpointBegin(3).encode() == (0x2D, b"\x03\x00\x00\x00\x00\x00\x00\x00")
    assert CheckpointEnd(2**40 + 258).encode() == (0x2E, b"\x02\x01\x00\x00\x00\x01\x00\x00")
    assert decode(0x2E, b"\x02\x01\x00\x00\x00\x01\x00\x00") == CheckpointEnd(2**40 + 258)


@pytest.mark.parametrize(
    "record",
    [
        QueueDelete("q" * 70_000),
        DuplicateId("queue://q", "d" * 70_000),
        MessageAck("q", -1),
        MessageAck("q", 2**64),
        DeliveryCount("q", 1, 2**32),
        TxCommit(-5),
        CheckpointBegin(-1),
        CheckpointEnd(2**64),
        MessageAdd(("q",), Message(1, "q", b"", priority=10)),
        TxAdd(1, ("q",), Message(1, "q", b"", expiration=math.nan)),
    ],
)
def test_unencodable_values_raise_record_error(record: Record) -> None:
    with pytest.raises(RecordError):
        record.encode()


def test_record_types_use_the_engine_range() -> None:
    assert all(0x20 <= t <= 0x3F for t in ENGINE_RECORD_TYPES)
    assert len(ENGINE_RECORD_TYPES) == len(RecordType)


def _slow_decode(record_type: int, payload: bytes) -> Record:
    """The validating decoder alone, bypassing decode()'s MESSAGE_ADD fast path."""
    return decode(record_type, memoryview(payload))


@given(st.builds(MessageAdd, queue_lists, messages, duplicate_ids), st.data())
def test_the_message_add_fast_path_agrees_with_the_validating_decoder(
    record: MessageAdd, data: st.DataObject
) -> None:
    record_type, payload = record.encode()
    assert decode(record_type, payload) == _slow_decode(record_type, payload) == record
    # Corrupted payloads: the fast path never accepts what the validating decoder refuses,
    # and never decodes to something different.
    corrupt = bytearray(payload)
    index = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    corrupt[index] ^= data.draw(st.integers(min_value=1, max_value=255))
    try:
        slow = _slow_decode(record_type, bytes(corrupt))
    except RecordError:
        with pytest.raises(RecordError):
            decode(record_type, bytes(corrupt))
    else:
        assert decode(record_type, bytes(corrupt)) == slow
