"""AMQP broker redirects and the announced failover list, against a scripted AMQP peer on a
real socket: the peer logs the client in (the bundled broker's SASL machine, PLAIN), opens
with the properties a test gives it, and on demand closes the connection with
``amqp:connection:redirect``. The client follows a redirect as a failover to the broker it
names (here the bundled pair's live, named nowhere in the URL), and treats the announced
list as failover_server_list says."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from proton import Collector, Condition, Connection, Event, Transport, symbol

import hafailover
from hafailover import FailoverNotice, HaFailoverError
from reference_broker import BrokerPair
from reference_broker.amqp.sasl import SaslInitReceived, SaslServer

from .support import FAST, drain, seqs, single_url, wait_until

pytestmark = pytest.mark.timeout(90)


class ScriptedPeer:
    """One AMQP connection at a time, answered as a broker would, until told otherwise."""

    def __init__(self, properties: dict[Any, Any] | None = None) -> None:
        self.properties = properties or {}
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._redirect: dict[Any, Any] | None = None
        self._stop = threading.Event()
        self._dropping = False
        self._redirect_at_open: dict[Any, Any] | None = None
        self.opened = threading.Event()
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def redirect(self, host: str, port: int) -> None:
        """Close the client's connection with a redirect to host:port."""
        self._redirect = {symbol("network-host"): host, symbol("port"): port}

    def redirect_opens(self, host: str, port: int) -> None:
        """Drop the client's connection without a word, and answer every later open with
        a redirect to host:port."""
        self._redirect_at_open = {symbol("network-host"): host, symbol("port"): port}
        self._dropping = True

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        self._thread.join(10)

    def _serve(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([self._server], [], [], 0.05)
            if not readable:
                continue
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self.connections += 1
            with client:
                self._converse(client)

    def _converse(self, client: socket.socket) -> None:
        sasl = SaslServer(["PLAIN", "ANONYMOUS"])
        connection = Connection()
        collector = Collector()
        connection.collect(collector)
        transport: Transport | None = None
        redirected = False
        opened_here = False
        while not self._stop.is_set():
            readable, _, _ = select.select([client], [], [], 0.02)
            data = b""
            if readable:
                data = client.recv(65536)
                if not data:
                    return
            if transport is None:
                if data:
                    events = sasl.receive(data)
                    after = b""
                    for event in events:
                        if isinstance(event, SaslInitReceived):
                            after = sasl.accept()
                    client.sendall(sasl.data_to_send())
                    if any(isinstance(e, SaslInitReceived) for e in events):
                        transport = Transport(Transport.SERVER)
                        transport.bind(connection)
                        if after:
                            transport.push(after)
                continue
            if self._dropping:
                self._dropping = False
                return
            if data:
                transport.push(data)
            transport.tick(time.monotonic())
            while (event := collector.peek()) is not None:
                if event.type == Event.CONNECTION_REMOTE_OPEN:
                    connection.properties = self.properties
                    connection.open()
                    opened_here = True
                    if self._redirect_at_open is not None:
                        self._redirect = self._redirect_at_open
                    else:
                        self.opened.set()
                elif event.type == Event.SESSION_REMOTE_OPEN and event.session is not None:
                    event.session.open()
                elif event.type == Event.LINK_REMOTE_OPEN and event.link is not None:
                    event.link.source.copy(event.link.remote_source)
                    event.link.target.copy(event.link.remote_target)
                    event.link.open()
                collector.pop()
            if self._redirect is not None and not redirected and opened_here:
                redirected = True
                connection.condition = Condition(
                    "amqp:connection:redirect", "moved for a test", self._redirect
                )
                connection.close()
            pending = transport.pending()
            if pending > 0:
                client.sendall(transport.peek(pending) or b"")
                transport.pop(pending)
            elif redirected:
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
                return


@pytest.fixture
def peer() -> Iterator[ScriptedPeer]:
    scripted = ScriptedPeer()
    try:
        yield scripted
    finally:
        scripted.close()


@pytest.fixture
def live(tmp_path: Any) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path / "pair", user="app", password="secret", start_backup=False) as pair:
        pair.wait_active(30)
        yield pair


def peer_url(port: int, **options: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in {**FAST, **options}.items())
    return f"amqp://app:secret@127.0.0.1:{port}?{query}"


def test_a_redirect_fails_over_to_the_broker_it_names(peer: ScriptedPeer, live: BrokerPair) -> None:
    notices: list[HaFailoverError] = []
    url = peer_url(peer.port, use_topology="false")
    with hafailover.connect(url, exception_listener=notices.append) as connection:
        producer = connection.create_session().create_producer("queue://redirected")
        peer.redirect("127.0.0.1", live.live.amqp_port)
        wait_until(lambda: notices, 20, "the failover the redirect makes")
        (notice,) = notices
        assert isinstance(notice, FailoverNotice)
        assert str(live.live.amqp_port) in (notice.report.to_broker or "")
        assert notice.report.attempts == 1  # straight there, the URL's broker not retried
        producer.send("after the redirect", headers={"seq": 1})
    on_live = single_url("amqp", "127.0.0.1", live.live.amqp_port, live)
    assert seqs(drain(on_live, "queue://redirected")) == [1]


def announcing(live: BrokerPair) -> dict[Any, Any]:
    entry = {symbol("network-host"): "127.0.0.1", symbol("port"): live.live.amqp_port}
    return {symbol("failover-server-list"): [entry]}


@pytest.mark.parametrize("action", ["add", "replace", "ignore"])
def test_the_announced_list_by_failover_server_list(live: BrokerPair, action: str) -> None:
    """The peer announces the live and then goes away for good: add and replace fail over
    to the announced broker, ignore keeps to the URL's list and gives up."""
    peer = ScriptedPeer(announcing(live))
    notices: list[HaFailoverError] = []
    try:
        url = peer_url(peer.port, failover_server_list=action, reconnect_attempts="6")
        with hafailover.connect(url, exception_listener=notices.append) as connection:
            session = connection.create_session()
            peer.close()  # the peer is gone and its port refuses
            wait_until(lambda: notices, 20, "the end of the failover")
            if action == "ignore":
                assert not isinstance(notices[0], FailoverNotice)
                with pytest.raises(HaFailoverError):
                    session.create_producer("queue://announced").send("x")
            else:
                assert isinstance(notices[0], FailoverNotice)
                session.create_producer("queue://announced").send("x", headers={"seq": 2})
    finally:
        peer.close()
    if action != "ignore":
        on_live = single_url("amqp", "127.0.0.1", live.live.amqp_port, live)
        assert seqs(drain(on_live, "queue://announced")) == [2]


def test_replace_drops_the_url_brokers_not_announced(live: BrokerPair) -> None:
    """With replace, the URL's other broker (a second peer that would take the client in)
    is no longer tried: the list is the peer connected to and what it announced."""
    first = ScriptedPeer(announcing(live))
    second = ScriptedPeer()
    try:
        brokers = ",".join(f"amqp://app:secret@127.0.0.1:{p.port}" for p in (first, second))
        query = "&".join(f"{k}={v}" for k, v in {**FAST, "failover_server_list": "replace"}.items())
        with hafailover.connect(f"failover:({brokers})?{query}") as connection:
            connection.create_session()
            first.close()
            wait_until(lambda: connection.reports, 20, "the failover")
            assert str(live.live.amqp_port) in (connection.reports[0].to_broker or "")
            assert second.connections == 0
    finally:
        first.close()
        second.close()


def test_a_broker_that_redirects_at_open_sends_the_failover_on(
    peer: ScriptedPeer, live: BrokerPair
) -> None:
    """After a loss, the URL's broker answers the attempt's open with a redirect: the next
    attempt goes where it says."""
    notices: list[HaFailoverError] = []
    url = peer_url(peer.port, use_topology="false")
    with hafailover.connect(url, exception_listener=notices.append) as connection:
        producer = connection.create_session().create_producer("queue://redirected-at-open")
        peer.redirect_opens("127.0.0.1", live.live.amqp_port)
        wait_until(lambda: notices, 20, "the failover")
        (notice,) = notices
        assert isinstance(notice, FailoverNotice)
        assert peer.connections >= 2  # the failover's first attempt went to the peer
        producer.send("after", headers={"seq": 3})
        assert str(live.live.amqp_port) in (connection.broker or "")
    on_live = single_url("amqp", "127.0.0.1", live.live.amqp_port, live)
    assert seqs(drain(on_live, "queue://redirected-at-open")) == [3]
