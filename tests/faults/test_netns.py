"""The toolkit itself: each fault does what it says, healing undoes it, nothing leaks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from reference_broker import BrokerPair

from .netns import NetnsThread, Network, entered, sweep

pytestmark = pytest.mark.timeout(60)

PORT = 7001


@pytest.fixture
def echo(network: Network) -> Iterator[Network]:
    """Endpoints a (client side) and b (an echo server on PORT)."""
    network.add("a")
    b = network.add("b")
    stop = threading.Event()
    ready = threading.Event()

    def serve() -> None:
        with socket.create_server((b.address, PORT)) as server:
            server.settimeout(0.1)
            ready.set()
            while not stop.is_set():
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                with connection:
                    connection.settimeout(5)
                    data = connection.recv(100)
                    connection.sendall(data)

    thread = NetnsThread(b.netns, serve)
    thread.start()
    assert ready.wait(10), thread.error
    yield network
    stop.set()
    thread.join(5)


def _exchange(network: Network, timeout: float = 1.0) -> str:
    """What a connection from a to b's echo server sees: 'ok', 'timeout' or 'reset'."""
    with entered(network["a"].netns):
        try:
            with socket.create_connection((network["b"].address, PORT), timeout=timeout) as s:
                s.sendall(b"ping")
                return "ok" if s.recv(100) == b"ping" else "garbled"
        except TimeoutError:
            return "timeout"
        except (ConnectionRefusedError, ConnectionResetError):
            return "reset"


def test_each_fault_and_its_heal(echo: Network) -> None:
    assert _exchange(echo) == "ok"
    echo.block("a", "b")  # a black hole: no answer at all
    assert _exchange(echo) == "timeout"
    echo.heal()
    assert _exchange(echo) == "ok"
    echo.block("a", "b", reject=True)  # refused at once
    assert _exchange(echo) == "reset"
    echo.heal()
    echo.block("b", "a")  # one way: the SYN arrives, the SYN-ACK is lost
    assert _exchange(echo) == "timeout"
    echo.heal()
    echo.link_down("b")
    assert _exchange(echo) != "ok"
    echo.heal()
    assert _exchange(echo) == "ok"


def test_addresses_exist_only_in_the_namespaces(echo: Network) -> None:
    # The host's namespace has neither the test network's addresses nor a rule of ours.
    host_addresses = subprocess.run(
        ["ip", "-o", "addr"], capture_output=True, text=True, check=True
    ).stdout
    assert "10.231." not in host_addresses
    host_rules = subprocess.run(
        ["iptables", "-S"], capture_output=True, text=True, check=True
    ).stdout
    assert "HAFAULT" not in host_rules


def test_threads_started_inside_a_namespace_stay_in_it(echo: Network) -> None:
    """What the client's own threads (reader, heart-beat, dispatcher) rely on."""
    target = echo["a"].netns
    expected = os.stat(f"/run/netns/{target}").st_ino
    seen: list[int] = []

    def child() -> None:
        seen.append(os.stat("/proc/thread-self/ns/net").st_ino)

    def parent() -> None:
        thread = threading.Thread(target=child)
        thread.start()
        thread.join()

    runner = NetnsThread(target, parent)
    runner.start()
    runner.join(5)
    assert runner.error is None
    assert seen == [expected]
    assert os.stat("/proc/thread-self/ns/net").st_ino != expected


def test_close_and_sweep_remove_every_namespace() -> None:
    from .conftest import require_toolkit

    require_toolkit()
    with Network() as network:
        network.add("x")
        names = [network.router, network["x"].netns]
        assert set(names) <= set(_listed())
    assert not set(names) & set(_listed())
    # A namespace named for a process that has exited is swept; one of a running process
    # is not.
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = f"hf{child.stdout.strip()}x0-leftover"
    alive = f"hf{1}x0-notmine"  # pid 1 always runs
    for name in (dead, alive):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = sweep()
        assert dead in removed and alive not in removed
        assert alive in _listed()
    finally:
        for name in (dead, alive):
            subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)


def _listed() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def test_the_pair_runs_in_its_namespaces(fault_pair: BrokerPair, network: Network) -> None:
    live, backup = fault_pair.nodes
    assert (live.host, backup.host) == (network["live"].address, network["backup"].address)
    assert live.role == "live" and backup.role == "backup"
    for node in fault_pair.nodes:
        ns = subprocess.run(
            ["ip", "netns", "identify", str(node.pid)], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert ns == node.netns
    assert network["live"].address in fault_pair.stomp_url
    assert network["backup"].address in fault_pair.amqp_url


def test_bad_pair_options_are_named() -> None:
    with pytest.raises(ValueError, match="unknown node"):
        BrokerPair("unused", netns={"primary": "x"}, hosts={"primary": "10.0.0.1"})
    with pytest.raises(ValueError, match="netns needs hosts"):
        BrokerPair("unused", netns={"live": "x", "backup": "y"})


def test_bad_endpoint_names_are_named(network: Network) -> None:
    with pytest.raises(ValueError, match="endpoint name"):
        network.add("Live-1")
    network.add("ok")
    with pytest.raises(ValueError, match="exists already"):
        network.add("ok")
    with pytest.raises(KeyError, match="no endpoint"):
        network.block("ok", "missing")
