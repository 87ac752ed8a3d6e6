"""STOMP frames pipelined behind CONNECT wait for the password check, within a bound.

The check runs off the event loop (reference_broker.users.LoginGuard), so a client's frames
can arrive before its CONNECTED is sent: they are handled, in order, once it is; a client
that piles more than a bounded amount on top of an unanswered CONNECT is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hafailover.protocols.stomp.frame import Frame, encode
from reference_broker.pair import BrokerPair
from tests.broker.stomp_wire import WireClient

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


def connect_frame(password: str) -> bytes:
    headers = {"accept-version": "1.2", "host": "localhost", "login": "admin"}
    headers["passcode"] = password
    return encode(Frame("CONNECT", tuple(headers.items())))


def send_frame(body: bytes, receipt: str) -> bytes:
    headers = {"destination": "/queue/pipelined", "persistent": "true", "receipt": receipt}
    return encode(Frame("SEND", tuple(headers.items()), body))


def test_frames_behind_connect_are_handled_in_order_once_it_is_answered(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", start_backup=False) as pair:
        client = WireClient(pair.live.stomp_port)
        try:
            client.send_raw(
                connect_frame("admin") + send_frame(b"one", "r1") + send_frame(b"two", "r2")
            )
            frames = [client.receive(10) for _ in range(3)]
        finally:
            client.sock.close()
    assert [f.command for f in frames] == ["CONNECTED", "RECEIPT", "RECEIPT"]
    assert [f.get("receipt-id") for f in frames[1:]] == ["r1", "r2"]


def test_too_much_behind_an_unanswered_connect_is_refused(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", start_backup=False) as pair:
        client = WireClient(pair.live.stomp_port)
        try:
            client.send_raw(connect_frame("wrong") + send_frame(b"x" * (2 * 1024 * 1024), "r"))
            frame = client.receive(10)
            assert frame.command == "ERROR"
            assert "bytes sent before CONNECTED" in (frame.get("message") or "")
            assert client.closed()
        finally:
            client.sock.close()
