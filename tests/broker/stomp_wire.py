"""A raw STOMP 1.2 client over a socket, for tests that need exact control of the wire."""

from __future__ import annotations

import socket
import time

from hafailover.protocols.stomp.frame import Frame, FrameParser, Heartbeat, Side, encode


class WireClient:
    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.parser = FrameParser(Side.CLIENT)
        self.pending: list[Frame] = []

    def send(self, command: str, headers: dict[str, str] | None = None, body: bytes = b"") -> None:
        self.sock.sendall(encode(Frame(command, tuple((headers or {}).items()), body)))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self, timeout: float = 5.0) -> Frame:
        deadline = time.monotonic() + timeout
        while not self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no frame")
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("connection closed by the broker")
            self.pending.extend(e for e in self.parser.feed(data) if not isinstance(e, Heartbeat))
        return self.pending.pop(0)

    def receive_until(self, command: str, timeout: float = 5.0) -> list[Frame]:
        frames = []
        while True:
            frame = self.receive(timeout)
            frames.append(frame)
            if frame.command == command:
                return frames

    def connect(self, user: str = "admin", password: str = "admin", **headers: str) -> Frame:
        all_headers = {
            "accept-version": "1.2",
            "host": "localhost",
            "login": user,
            "passcode": password,
        }
        all_headers.update({k.replace("_", "-"): v for k, v in headers.items()})
        self.send("CONNECT", all_headers)
        return self.receive()

    def closed(self, timeout: float = 2.0) -> bool:
        """Whether the broker closes the connection within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (TimeoutError, OSError) as exc:
            return not isinstance(exc, TimeoutError)

    def close(self) -> None:
        self.sock.close()
