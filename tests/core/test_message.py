"""The application's message value: validation, ids, sizes."""

from __future__ import annotations

import pytest

from hafailover.destination import Destination
from hafailover.errors import ConfigurationError, IllegalStateError
from hafailover.message import FRAME_OVERHEAD, Message


def test_defaults_follow_jms() -> None:
    message = Message(b"x")
    assert message.persistent is True
    assert message.priority == 4
    assert message.time_to_live is None
    assert message.message_id is None


def test_text_and_bytes_bodies() -> None:
    assert Message("héllo").body_bytes == "héllo".encode()
    assert Message(b"\x00\x01").text == "\x00\x01"


def test_message_id_is_given_once_and_kept() -> None:
    """F13: re-sending the same object re-uses its id, so a broker can drop the copy."""
    message = Message(b"x")
    first = message.ensure_message_id()
    assert first.startswith("ID-")
    assert message.ensure_message_id() == first
    assert Message(b"y").ensure_message_id() != first


def test_reply_to_accepts_text() -> None:
    assert Message(b"x", reply_to="/queue/replies").reply_to == Destination.queue("replies")


def test_size_counts_body_and_properties() -> None:
    message = Message(b"12345", properties={"seq": 7})
    assert message.size() == 5 + FRAME_OVERHEAD + len("seq") + len("7") + 2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"body": 3}, "bytes or str, not int"),
        ({"priority": 10}, "0 to 9"),
        ({"priority": True}, "0 to 9"),
        ({"time_to_live": 0}, "positive"),
        ({"time_to_live": float("nan")}, "positive"),
        ({"time_to_live": "soon"}, "seconds"),
        ({"properties": {"": "x"}}, "non-empty"),
        ({"properties": {"a\nb": "x"}}, "line breaks"),
        ({"properties": {"k": [1]}}, "list value"),
        ({"properties": {"k": "a\x00b"}}, "NUL"),
        ({"reply_to": "http://x"}, "unknown destination form"),
    ],
)
def test_bad_messages_are_refused_naming_the_problem(
    kwargs: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        Message(**kwargs)  # type: ignore[arg-type]


def test_acknowledging_a_message_that_was_not_received_is_misuse() -> None:
    with pytest.raises(IllegalStateError, match="not received"):
        Message(b"x").acknowledge()


def test_of_body_equals_the_validated_constructor() -> None:
    """The send path's shortcut makes the same message the constructor makes."""
    import attrs

    for body, persistent in ((b"x", True), ("text", False), (b"", True)):
        fast = Message.of_body(body, persistent=persistent)
        assert attrs.asdict(fast) == attrs.asdict(Message(body=body, persistent=persistent))
        fast.properties["k"] = "v"  # its own dict
        assert Message.of_body(body).properties == {}
    with pytest.raises(ConfigurationError):
        Message.of_body(12)  # type: ignore[arg-type]
