"""A writer stuck in ``sendall`` never stops the reader (issue 17: decide under the lock, do
I/O outside it).

Between the client and the live a small proxy with small socket buffers stops, on command,
reading what the client writes (a peer that stops reading: its buffers fill, and a large
send blocks in the kernel) while it still forwards everything the broker sends. With a
producer's thread stuck in such a send, a consumer on the same connection must still get
what the broker sends it; then the client's heart-beats no longer reach the broker, which
hangs up, and the connection must fail over within a bound and release the stuck send as
its rule says (F4 replayed on a reattach, F13 resent on a reconnect, or F3 UNBLOCKED).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hafailover
from hafailover import AckMode, FailoverCompleted, FailureDetected, HaFailoverError, Message
from reference_broker import BrokerPair

from .support import single_url, wait_until

pytestmark = pytest.mark.timeout(120)

# Small buffers on the proxy's side: the client's writes pile up in its own send buffer
# (at most the kernel's tcp_wmem maximum, 4 MiB by default) and then block.
_BUFFER = 4096
_READ = 4096
# Larger than the client's send buffer can ever hold, well under the broker's 64 MiB limit.
BIG = 8 * 1024 * 1024
# Room for it in the confirmation window: the send is written, not held back for room.
WINDOW = "64MiB"
# The client's heart-beat, and the pair's: each side hangs up after about two silent
# periods, so a send stays stuck for about fifteen seconds before the connection is lost
# (and a reader that works has time to show it, even on a loaded machine).
HEARTBEAT = 8.0
BROKER_HEARTBEAT = 16.0
# From the broker's hang-up to the stuck send released: loss noticed, reconnected, replayed.
FAILOVER_BOUND = 60.0


class StallingProxy:
    """Forwards 127.0.0.1:<port> to a target. ``stop_reading()``: from then on nothing
    more is read from the clients connected now (what they write piles up until their
    writes block), while what the broker sends them is still forwarded; a connection ends
    when the broker ends it (or at ``close()``). Later connections are forwarded normally."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Set before listen: every accepted socket inherits the small receive buffer.
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        self._server = server
        self.port = server.getsockname()[1]
        self._lock = threading.Lock()
        self._connections: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._start(self._accept)

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
            stalled = threading.Event()
            with self._lock:
                self._connections.append((client, upstream, stalled))
            self._start(self._pump, client, upstream, stalled)
            self._start(self._pump, upstream, client, None)

    def _pump(
        self, source: socket.socket, sink: socket.socket, stalled: threading.Event | None
    ) -> None:
        with contextlib.suppress(OSError):
            while True:
                if stalled is not None and stalled.is_set():
                    # A peer that stops reading: wait until the connection is gone.
                    while not self._closed.wait(0.1):
                        if source.fileno() < 0:
                            return
                    return
                data = source.recv(_READ)
                if not data:
                    break
                sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def stop_reading(self) -> None:
        with self._lock:
            for _, _, stalled in self._connections:
                stalled.set()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            connections, self._connections = self._connections, []
        for client, upstream, _ in connections:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
        for thread in self._threads:
            thread.join(5)


@contextlib.contextmanager
def stalling_proxy(target: tuple[str, int]) -> Iterator[StallingProxy]:
    proxy = StallingProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def patient_pair(tmp_path: Path) -> Iterator[BrokerPair]:
    """A pair that waits longer for a silent client than the bundled default."""
    with BrokerPair(
        tmp_path / "pair", user="app", password="secret", heartbeat_timeout=BROKER_HEARTBEAT
    ) as started:
        started.wait_synchronized(30)
        yield started


def _port(node: object, protocol: str) -> int:
    return int(getattr(node, f"{protocol}_port"))


def test_a_send_stuck_in_a_full_socket_stops_neither_deliveries_nor_the_failover(
    patient_pair: BrokerPair, protocol: str
) -> None:
    pair = patient_pair
    live, backup = pair.live, pair.backup
    options = {
        "heartbeat": f"{int(HEARTBEAT * 1000)}ms",
        "reconnect_attempts": -1,
        "confirmation_window_size": WINDOW,
    }
    direct = single_url(protocol, "127.0.0.1", _port(live, protocol), pair, **options)
    events: list[tuple[float, object]] = []
    with stalling_proxy(("127.0.0.1", _port(live, protocol))) as proxy:
        through = single_url(protocol, "127.0.0.1", proxy.port, pair, **options)
        backup_url = single_url(protocol, "127.0.0.1", _port(backup, protocol), pair, **options)
        url = (
            f"failover:({through.split('?')[0]},{backup_url.split('?')[0]})?"
            + (through.split("?")[1])
        )
        connection = hafailover.connect(url)
        other = hafailover.connect(direct)
        try:
            connection.add_event_listener(lambda e: events.append((time.monotonic(), e)))
            consumer = connection.create_session(AckMode.DUPS_OK).create_consumer(
                "queue://stuck-in"
            )
            producer = connection.create_session().create_producer("queue://stuck-out")
            connection.start()
            feeder = other.create_session().create_producer("queue://stuck-in")
            feeder.send("warm-up", headers={"seq": -1})
            warm = consumer.receive(10)
            assert warm is not None and int(str(warm.properties["seq"])) == -1

            proxy.stop_reading()
            outcome: list[object] = []

            def send_big() -> None:
                try:
                    outcome.append(producer.send(Message(body=b"x" * BIG, persistent=True)))
                except HaFailoverError as exc:
                    outcome.append(exc)
                outcome.append(time.monotonic())

            sender = threading.Thread(target=send_big, daemon=True)
            sender.start()
            time.sleep(1.0)
            assert sender.is_alive(), f"the large send was not stuck: {outcome}"

            # The broker still talks to the client: what it delivers must arrive while the
            # producer's thread is stuck in its write.
            received: list[int] = []

            def consume() -> None:
                deadline = time.monotonic() + 20
                while len(received) < 5 and time.monotonic() < deadline:
                    message = consumer.receive(0.5)
                    if message is not None:
                        received.append(int(str(message.properties["seq"])))

            reader = threading.Thread(target=consume, daemon=True)
            reader.start()
            for n in range(5):  # pipelined: a loaded broker confirms each slowly
                feeder.send_async("while stuck", headers={"seq": n})
            feeder.flush()
            reader.join(25)
            assert not reader.is_alive(), "receive() hung behind the stuck writer"
            assert received == [0, 1, 2, 3, 4]
            assert sender.is_alive(), "the stuck send ended before the deliveries were checked"
            assert not any(isinstance(e, FailureDetected) for _, e in events)

            # The client's heart-beats sit behind the stuck write: the broker hangs up; the
            # loss is noticed, the connection fails over and the send is released.
            stuck_at = time.monotonic()
            sender.join(FAILOVER_BOUND)
            assert not sender.is_alive(), f"the stuck send was not released in {FAILOVER_BOUND}s"
            result, ended_at = outcome
            assert isinstance(ended_at, float) and ended_at - stuck_at < FAILOVER_BOUND
            if isinstance(result, HaFailoverError):
                assert result.code.value == "UNBLOCKED", result  # F3: released, never hung
            else:
                assert isinstance(result, Message)  # replayed (F4) or resent (F13)
            wait_until(
                lambda: any(isinstance(e, FailoverCompleted) for _, e in events),
                FAILOVER_BOUND,
                "the failover",
            )
            # The connection works again, both ways.
            producer.send("after", headers={"seq": 100})
            feeder.send("after", headers={"seq": 101})
            wait_until(lambda: _received_seq(consumer, 101), 20, "a delivery after the failover")
        finally:
            with contextlib.suppress(HaFailoverError):
                other.close()
            proxy.close()  # releases a writer still stuck (on the code before the fix)
            with contextlib.suppress(HaFailoverError):
                connection.close()


def _received_seq(consumer: hafailover.Consumer, seq: int) -> bool:
    message = consumer.receive(0.5)
    return message is not None and int(str(message.properties["seq"])) == seq
