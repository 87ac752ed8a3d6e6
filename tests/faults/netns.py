"""Kernel-level network faults for tests: network namespaces, veth pairs, a bridge, iptables.

What it owns
------------
A ``Network`` is one test's private network. It makes a *router* namespace holding a bridge,
and one namespace per endpoint (a broker node, a client), each joined to the bridge by a veth
pair created directly inside the two namespaces. Every endpoint gets a private address
(10.231.0.N/24) that exists only inside those namespaces. Faults are kernel rules inside the
endpoints' namespaces:

- ``block(a, b)``: packets from a to b are dropped silently (a black hole: no reset, no ICMP;
  the sender only notices by its own timeouts and heart-beats);
- ``block(a, b, reject=True)``: packets from a to b are answered with a TCP reset;
- a fault is always one direction; ``partition(a, b)`` is both, ``isolate(a)`` is a against
  every other endpoint;
- ``link_down(a)``: ``ip link set eth0 down`` inside a's namespace.

Every rule goes into a chain of its own (``HAFAULT``, hooked into INPUT of the receiver's
namespace: the receiver drops what it does not accept), so ``heal()`` is one flush per
namespace plus every link set up again.

What it must never do
---------------------
Touch the host's own network namespace or its iptables: every ``ip`` command names a
namespace (``ip -n NS`` or ``ip netns exec NS``), veths are created inside their namespaces,
never in the host's, and no command runs without one. Names carry a per-test unique prefix
``hf<pid>x<n>`` (the pid of the test process that made it): ``close()`` deletes every namespace
a Network made, by name, and ``sweep()`` (once per session) deletes those whose creating process
is gone, never another live process's.

Clients in a namespace
----------------------
Clients run in-process, on threads that entered an endpoint's namespace (``setns`` with
CLONE_NEWNET is per thread, and a thread the entered one starts inherits it): the scenario then
sees the application's own view (exception-listener events, how long a blocked call waited,
the exception it raised) without a protocol between the test and a client subprocess. A socket
belongs to the namespace of the thread that created it, and the hafailover client creates every
socket, and every thread that creates one, from the connection's own threads: so a connection
opened on an entered thread stays entirely inside the namespace
(test_netns.py checks that a thread started by an entered thread is in the namespace too).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

__all__ = [
    "Endpoint",
    "NetnsError",
    "NetnsThread",
    "Network",
    "cut_directory",
    "entered",
    "missing_tools",
    "restore_directory",
    "sweep",
]

PREFIX = "hf"
SUBNET = "10.231.0"
CHAIN = "HAFAULT"
BRIDGE = "br0"
# The interface of an endpoint inside its own namespace.
DEVICE = "eth0"
COMMAND_TIMEOUT = 15.0
CLONE_NEWNET = 0x40000000
_NAME = re.compile(rf"^{PREFIX}(\d+)x\d+-")
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(RuntimeError):
    """A namespace, link or rule command failed: the message names the command and its output."""


def missing_tools() -> list[str]:
    """The programs this toolkit needs that are not installed (iproute2's ip, iptables)."""
    return [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]


def _run(*command: str) -> str:
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(command)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(
            f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip() or done.stdout}"
        )
    return done.stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def _delete_namespace(name: str) -> None:
    with contextlib.suppress(NetnsError):
        _run("ip", "netns", "delete", name)


def sweep() -> list[str]:
    """Delete the namespaces of this toolkit whose creating process no longer runs."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        _delete_namespace(name)
        removed.append(name)
    return removed


@attrs.frozen
class Endpoint:
    """One host of the network: its role name, its namespace and its address."""

    name: str
    netns: str
    address: str


class Network:
    """One test's private network; use it as a context manager (or call ``close``)."""

    def __init__(self) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.router = f"{self.prefix}-r"
        self.endpoints: dict[str, Endpoint] = {}
        self._made: list[str] = []  # every namespace made, in order, for close()
        self._lock = threading.Lock()
        try:
            self._make_namespace(self.router)
            self._ip(self.router, "link", "add", BRIDGE, "type", "bridge")
            self._ip(self.router, "link", "set", BRIDGE, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace this network made (their veths go with them)."""
        for name in reversed(self._made):
            _delete_namespace(name)
        self._made.clear()

    # --- building --------------------------------------------------------------------------

    def add(self, name: str) -> Endpoint:
        """A new endpoint ``name`` (letters and digits) with the next free address."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", name):
            raise ValueError(f"endpoint name {name!r}: 1-10 lower-case letters or digits")
        with self._lock:
            if name in self.endpoints:
                raise ValueError(f"endpoint {name!r} exists already")
            number = len(self.endpoints) + 2
            if number > 254:
                raise ValueError("a network holds at most 253 endpoints")
            endpoint = Endpoint(name, f"{self.prefix}-{name}", f"{SUBNET}.{number}")
            self.endpoints[name] = endpoint
        self._make_namespace(endpoint.netns)
        port = f"p-{name}"  # the bridge side, in the router namespace (<= 15 characters)
        _run(
            "ip", "-n", endpoint.netns, "link", "add", DEVICE, "type", "veth",
            "peer", "name", port, "netns", self.router,
        )  # fmt: skip
        self._ip(self.router, "link", "set", port, "master", BRIDGE)
        self._ip(self.router, "link", "set", port, "up")
        self._ip(endpoint.netns, "addr", "add", f"{endpoint.address}/24", "dev", DEVICE)
        self._ip(endpoint.netns, "link", "set", DEVICE, "up")
        self._iptables(endpoint, "-N", CHAIN)
        self._iptables(endpoint, "-A", "INPUT", "-j", CHAIN)
        return endpoint

    def _make_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        self._ip(name, "link", "set", "lo", "up")

    @staticmethod
    def _ip(netns: str, *args: str) -> str:
        return _run("ip", "-n", netns, *args)

    @staticmethod
    def _iptables(endpoint: Endpoint, *args: str) -> str:
        return _run("ip", "netns", "exec", endpoint.netns, "iptables", "-w", "5", *args)

    def __getitem__(self, name: str) -> Endpoint:
        try:
            return self.endpoints[name]
        except KeyError:
            raise KeyError(f"no endpoint {name!r} in {sorted(self.endpoints)}") from None

    # --- faults ----------------------------------------------------------------------------

    def block(self, source: str, target: str, *, reject: bool = False) -> None:
        """Packets from ``source`` to ``target`` are dropped (reject: answered with a TCP
        reset). One direction only: replies from target to source still flow."""
        a, b = self[source], self[target]
        if reject:
            action = ["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"]
        else:
            action = ["-j", "DROP"]
        self._iptables(b, "-A", CHAIN, "-s", a.address, *action)

    def partition(self, a: str, b: str, *, reject: bool = False) -> None:
        """No packet between a and b, either way."""
        self.block(a, b, reject=reject)
        self.block(b, a, reject=reject)

    def isolate(self, name: str, *, reject: bool = False) -> None:
        """``name`` cut off from every other endpoint, both ways."""
        for other in list(self.endpoints):
            if other != name:
                self.partition(name, other, reject=reject)

    def link_down(self, name: str) -> None:
        self._ip(self[name].netns, "link", "set", DEVICE, "down")

    def link_up(self, name: str) -> None:
        self._ip(self[name].netns, "link", "set", DEVICE, "up")

    def heal(self) -> None:
        """Remove every rule and bring every link up."""
        for endpoint in list(self.endpoints.values()):
            self._iptables(endpoint, "-F", CHAIN)
            self.link_up(endpoint.name)

    def rules(self, name: str) -> str:
        """The fault rules in force in ``name``'s namespace (for messages)."""
        return self._iptables(self[name], "-S", CHAIN)


# --- a directory lost to one process ------------------------------------------------------------


def cut_directory(pid: int, path: str) -> None:
    """Make ``path`` read-only for process ``pid`` alone: a bind mount of it onto itself,
    remounted read-only, in that process's mount namespace (``ip netns exec`` gives every
    node one of its own, whose mounts do not propagate back). Its writes then fail with
    EROFS, as a shared disk that went away fails them; every other process still writes."""
    _run("nsenter", "-t", str(pid), "-m", "--", "mount", "--bind", path, path)
    # The remount fails with EBUSY while the process has a file there open for writing (a
    # lease being written): try again a moment later.
    for attempt in range(50):
        try:
            _run("nsenter", "-t", str(pid), "-m", "--", "mount", "-o", "remount,bind,ro", path)
            break
        except NetnsError:
            if attempt == 49:
                raise
            time.sleep(0.01)
    own = _run("nsenter", "-t", str(pid), "-m", "--", "cat", "/proc/self/mounts")
    host = _run("cat", "/proc/self/mounts")
    if f" {path} " not in own or f" {path} " in host:
        raise NetnsError(f"the read-only mount of {path} is not private to process {pid}")


def restore_directory(pid: int, path: str) -> None:
    """Undo ``cut_directory``."""
    _run("nsenter", "-t", str(pid), "-m", "--", "umount", path)


# --- threads inside a namespace ----------------------------------------------------------------


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise NetnsError(f"setns: {os.strerror(errno)}")


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """Run the calling thread in namespace ``netns`` for the block, then go back."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)


class NetnsThread(threading.Thread):
    """A daemon thread that runs ``target`` inside namespace ``netns``; an exception it raised
    is kept in ``error`` for the test to report."""

    def __init__(self, netns: str, target: Callable[[], Any], name: str | None = None) -> None:
        super().__init__(name=name or f"in-{netns}", daemon=True)
        self.netns = netns
        self.target = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with entered(self.netns):
                self.target()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
