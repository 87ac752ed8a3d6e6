"""A send never changes the application's Message; the same object keeps one id (F13)."""

from __future__ import annotations

import threading

import pytest

from hafailover import Message
from hafailover.driver.producer import _as_message, sent_id
from hafailover.errors import ConfigurationError


def test_a_send_copies_the_message_and_leaves_the_original_as_it_was() -> None:
    original = Message(body="order", properties={"seq": 1})
    sent = _as_message(original, {"extra": "x"}, False, 7, 30.0)
    assert sent is not original
    assert sent.properties == {"seq": 1, "extra": "x"}
    assert (sent.persistent, sent.priority, sent.time_to_live) == (False, 7, 30.0)
    assert original.properties == {"seq": 1}
    assert (original.persistent, original.priority, original.time_to_live) == (True, 4, None)
    assert original.message_id is None
    assert sent.message_id is not None


def test_the_same_object_is_sent_with_the_same_id_and_another_with_another() -> None:
    message = Message(body="again")
    first = _as_message(message, None, None, None, None)
    second = _as_message(message, {"retry": True}, None, None, None)
    assert first.message_id == second.message_id == sent_id(message)
    assert _as_message(Message(body="again"), None, None, None, None).message_id != (
        first.message_id
    )


def test_an_id_the_application_chose_is_kept() -> None:
    message = Message(body="mine", message_id="order-17")
    assert _as_message(message, None, None, None, None).message_id == "order-17"


def test_threads_sending_one_object_agree_on_its_id() -> None:
    message = Message(body="shared")
    ids: list[str] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        ids.append(
            _as_message(message, {"t": threading.get_ident()}, None, None, None).message_id or ""
        )

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert len(ids) == 8 and len(set(ids)) == 1
    assert message.properties == {}


def test_a_bad_option_is_refused_and_the_original_is_untouched() -> None:
    message = Message(body="x")
    with pytest.raises(ConfigurationError, match="priority"):
        _as_message(message, None, None, 12, None)
    assert message.priority == 4


def test_a_received_message_sent_on_carries_no_delivery_of_its_session() -> None:
    received = Message(body="in", message_id="ID-1", delivery=object(), acknowledger=print)
    forwarded = _as_message(received, None, None, None, None)
    assert forwarded.delivery is None
    assert forwarded.message_id == "ID-1"
    assert received.delivery is not None
