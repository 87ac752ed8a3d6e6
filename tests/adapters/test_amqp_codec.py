"""encode_message writes an AMQP 1.0 message directly: byte for byte what proton writes for
the same message, over every field a send sets, at the lengths where an encoding changes
width (255/256 bytes), and for what it leaves to proton (an id that is not a string, an
integer beyond 64 bits, a string that is not UTF-8)."""

from __future__ import annotations

import enum
import uuid
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.message import Message, PropertyValue, plain_property, stamps_duplicate_id
from hafailover.protocols.amqp import codec
from hafailover.protocols.amqp.codec import (
    DUPLICATE_ID,
    _encode_with_proton,
    decode_message,
    encode_message,
)


class Level(enum.IntEnum):
    LOW = -3
    HIGH = 300


class Colour(enum.StrEnum):
    RED = "red"


class Shade(str, enum.Enum):  # noqa: UP042 - users write it; str() is "Shade.DARK", not "dark"
    DARK = "dark"


# Texts around the widths that change an encoding: a string or binary of 255 bytes has a
# one-byte length, one of 256 a four-byte one; a list of up to 254 bytes of fields is a
# list8.
_lengths = st.sampled_from([0, 1, 100, 250, 251, 252, 253, 254, 255, 256, 257, 300, 70_000])
_texts = st.one_of(
    st.text(max_size=40),
    st.builds(lambda n, c: c * n, _lengths, st.sampled_from(["a", "é", "☃", "𝄞", "\x00"])),
)
# Addresses come from destinations, which refuse NUL (proton would cut a C string there).
_addresses = _texts.filter(lambda text: "\x00" not in text)
_values: st.SearchStrategy[PropertyValue] = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([-129, -128, 127, 128, 0, -1]),
    st.floats(),
    st.sampled_from([Level.LOW, Level.HIGH, Colour.RED, Shade.DARK, float("inf"), -0.0]),
    _addresses,  # a property may not hold NUL (Message refuses it)
)
_messages = st.builds(
    Message,
    body=st.one_of(_texts, st.binary(max_size=40), st.builds(bytes, _lengths)),
    properties=st.dictionaries(
        _texts.filter(lambda name: bool(name) and not any(c in name for c in "\x00\n\r")),
        _values,
        max_size=6,
    ),
    persistent=st.booleans(),
    priority=st.integers(min_value=0, max_value=9),
    time_to_live=st.one_of(
        st.none(),
        st.sampled_from([0.0001, 0.001, 0.1, 0.2541, 0.2551, 0.2561, 1.5, 4_294_967.295]),
        st.floats(min_value=0.0001, max_value=4_000_000),
    ),
    correlation_id=st.one_of(st.none(), _texts),
    message_id=st.one_of(st.none(), _texts.filter(bool)),
)


def directly(
    message: Message, address: str, *, reply_to: str | None, duplicate_detection: bool
) -> bytes:
    """encode_message without its way through proton: a value it should have taken and
    handed to proton instead fails here."""
    with mock.patch.object(codec, "_encode_with_proton", side_effect=AssertionError("proton")):
        return encode_message(
            message, address, reply_to=reply_to, duplicate_detection=duplicate_detection
        )


def through_proton(
    message: Message, address: str, *, reply_to: str | None, duplicate_detection: bool
) -> bytes:
    """The reference: the same message set field by field on a proton.Message."""
    message_id = message.ensure_message_id()
    properties = {str(k): plain_property(v) for k, v in message.properties.items()}
    if stamps_duplicate_id(persistent=message.persistent, duplicate_detection=duplicate_detection):
        properties[DUPLICATE_ID] = message_id
    return _encode_with_proton(message, message_id, address, reply_to, properties)


@given(
    message=_messages,
    address=_addresses,
    reply_to=st.one_of(st.none(), _addresses),
    duplicate_detection=st.booleans(),
)
def test_the_direct_encoding_is_protons_byte_for_byte(
    message: Message, address: str, reply_to: str | None, duplicate_detection: bool
) -> None:
    direct = directly(message, address, reply_to=reply_to, duplicate_detection=duplicate_detection)
    expected = through_proton(
        message, address, reply_to=reply_to, duplicate_detection=duplicate_detection
    )
    assert direct == expected
    received = decode_message(direct)
    assert received.body == message.body
    assert received.persistent == message.persistent
    assert received.priority == message.priority


def test_a_celery_task_message_is_protons_byte_for_byte() -> None:
    """The send this encoding was written for: a kombu envelope of ~700 characters."""
    envelope = '{"headers": {"lang": "py", "task": "noop", "argsrepr": "(1,)"}, ' + "x" * 650 + "}"
    message = Message(
        b'[[1], {}, {"callbacks": null}]',
        properties={"kombu": envelope},
        correlation_id="c0ffee",
        message_id="8d3f-task",
    )
    for detection in (True, False):
        direct = directly(message, "bench", reply_to=None, duplicate_detection=detection)
        assert direct == through_proton(
            message, "bench", reply_to=None, duplicate_detection=detection
        )


@pytest.mark.parametrize("fields_size", [253, 254, 255, 256])
@pytest.mark.parametrize("time_to_live", [None, 0.2541, 0.2551, 0.2561])
def test_at_the_widths_where_the_encoding_changes(
    fields_size: int, time_to_live: float | None
) -> None:
    """The properties section's fields (message-id, a null, the address) of 253 to 256
    bytes: a list8 holds at most 254 (its size byte counts the count byte); a ttl of 254 to
    256 ms: a smalluint holds at most 255."""
    message_id = "m" * (fields_size - 5)  # str8 (2 + n), a null (1), an empty address (2)
    message = Message("x", message_id=message_id, time_to_live=time_to_live)
    for detection in (True, False):
        direct = directly(message, "", reply_to=None, duplicate_detection=detection)
        assert direct == through_proton(message, "", reply_to=None, duplicate_detection=detection)


@pytest.mark.parametrize(
    ("properties", "error"),
    [({"big": 2**64}, OverflowError), ({"lone": "\ud800"}, UnicodeEncodeError)],
)
def test_what_the_direct_encoding_does_not_take_goes_through_proton(
    properties: dict[str, PropertyValue], error: type[Exception]
) -> None:
    """proton refuses these too, with its own error: the caller sees the same either way."""
    message = Message("x", properties=properties, message_id="id")
    with pytest.raises(error):
        through_proton(message, "q", reply_to=None, duplicate_detection=False)
    with pytest.raises(error):
        encode_message(message, "q", reply_to=None, duplicate_detection=False)


def test_an_enum_property_travels_as_its_value_either_way() -> None:
    """A str, int or float subclass (an enum) is sent as its value, not as its str(): by
    the direct encoding and through proton alike."""
    properties: dict[str, PropertyValue] = {"shade": Shade.DARK, "level": Level.HIGH}
    message = Message("x", properties=properties, message_id="id")
    for encoded in (
        directly(message, "q", reply_to=None, duplicate_detection=False),
        through_proton(message, "q", reply_to=None, duplicate_detection=False),
    ):
        received = decode_message(encoded).properties
        assert received == {"shade": "dark", "level": 300}
        assert type(received["shade"]) is str


def test_a_ttl_beyond_32_bits_goes_through_proton() -> None:
    message = Message("x", time_to_live=5_000_000.0, message_id="id")
    try:
        expected: bytes | type[Exception] = through_proton(
            message, "q", reply_to=None, duplicate_detection=False
        )
    except Exception as exc:  # noqa: BLE001 - whatever proton does, the direct path does too
        expected = type(exc)
    if isinstance(expected, bytes):
        assert encode_message(message, "q", reply_to=None, duplicate_detection=False) == expected
    else:
        with pytest.raises(expected):
            encode_message(message, "q", reply_to=None, duplicate_detection=False)


@pytest.mark.parametrize(
    ("message_id", "correlation_id"),
    [(7, None), (uuid.UUID(int=5), None), (b"\x01\x02", None), ("id", 9), ("id", uuid.UUID(int=1))],
)
def test_an_id_that_is_not_a_string_is_written_as_proton_writes_it(
    message_id: Any, correlation_id: Any
) -> None:
    """Message's ids are meant to be strings but are not checked: proton writes an integer,
    a UUID or bytes as their AMQP types, and so does encode_message (through proton)."""
    message = Message("x", message_id=message_id, correlation_id=correlation_id)
    direct = encode_message(message, "q", reply_to=None, duplicate_detection=True)
    assert direct == through_proton(message, "q", reply_to=None, duplicate_detection=True)
