"""Run a live and a backup node as separate processes, for users and for tests.

``BrokerPair`` starts both nodes on free (or given) loopback ports, waits until the live
serves and the backup is synchronized, and stops both when the ``with`` block ends. Tests
use it to kill (SIGKILL), pause (SIGSTOP), resume (SIGCONT) and restart nodes; it only ever
signals the processes it started, by pid, and cleans every one of them up.

Each node may run inside a network namespace of its own (``netns``: the command is wrapped in
``ip netns exec``) and listen on an address of its own (``hosts``): the fault tests of
tests/faults put the nodes on a private network whose links they can break. The witness and
the lease stay on the shared file system (``pair_dir``) either way.

``pair_up`` is the ``hafailover pair up`` command: the same, printing the addresses and the
two failover URLs, until Ctrl-C or SIGTERM.

Ports. While a node is not running (not started yet, with ``start_backup=False`` never, or
killed) this process keeps its three ports bound, without listening, and lets go of them just
before the node starts. Otherwise another pair (of this process or of another test worker)
could be given them: its node would then be the one the first pair's live announces as its
backup, and that a backup of the first pair follows. A port something else holds already
(a squatter a test set up) is left to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import attrs

from reference_broker.tls import TlsFiles
from reference_broker.users import UsersFile

__all__ = ["BrokerPair", "NodeProcess", "PairError", "free_ports"]


class PairError(RuntimeError):
    """A node did not reach the state asked for in time."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the kernel says are free now (they are released before use: a small race)."""
    sockets = _bound_sockets(count, host)
    try:
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _bound_sockets(count: int, host: str) -> list[socket.socket]:
    """``count`` sockets bound to distinct free ports of ``host``, not listening."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket()
            sockets.append(s)
            s.bind((host, 0))
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets


def _reserve(host: str, port: int) -> socket.socket | None:
    """Bind ``port`` without listening, so that no other socket is given it (a bind to port 0
    and a connect's own port both skip a port bound so); None if something holds it.
    SO_REUSEADDR: a node just killed leaves its port in TIME_WAIT, which this may share."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


@attrs.define
class NodeProcess:
    """One node of the pair: its name, ports, data directory and process."""

    name: str
    preferred_role: str
    stomp_port: int
    amqp_port: int
    replication_port: int
    data_dir: Path
    log_path: Path
    host: str = "127.0.0.1"  # where it listens, and what clients and its peer call it
    netns: str | None = None  # the network namespace it runs in; None: this process's
    process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise PairError(f"node {self.name} is not running")
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def status(self) -> dict[str, Any]:
        try:
            status: dict[str, Any] = json.loads((self.data_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}
        if self.process is None or status.get("pid") != self.process.pid:
            return {}  # written by an earlier incarnation
        return status

    @property
    def role(self) -> str | None:
        return self.status().get("role") if self.running else None

    def __repr__(self) -> str:
        return (
            f"<node {self.name} pid={self.process.pid if self.process else None} role={self.role}>"
        )


class BrokerPair:
    """A live and a backup node on one machine, started and stopped as a unit."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        user: str = "admin",
        password: str = "admin",  # noqa: S107 - a loopback test pair; pass your own for real use
        host: str = "127.0.0.1",
        heartbeat_timeout: float = 1.0,
        lease: float | None = None,
        sync: str = "always",
        allow_failback: bool = True,
        topology_extension: bool = True,
        tls: TlsFiles | None = None,
        tls_client_auth: bool = False,
        ports: tuple[int, int, int, int, int, int] | None = None,
        start_backup: bool = True,
        log_level: str = "INFO",
        segment_size: int | None = None,
        checkpoint_segments: int | None = None,
        netns: Mapping[str, str] | None = None,
        hosts: Mapping[str, str] | None = None,
        node_options: Sequence[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        # Further node options (``--max-message-size 1048576``), given to both nodes.
        self.node_options = list(node_options)
        self.user = user
        self.password = password
        self.host = host
        self.heartbeat_timeout = heartbeat_timeout
        # Half as long again as the heartbeat timeout: a live tolerates an event-loop stall (a
        # full garbage collection of a long backlog) of about half the lease, and a paused
        # live is still taken over within lease + grace = 1.8 heartbeat timeouts.
        self.lease = lease if lease is not None else 1.5 * heartbeat_timeout
        self.sync = sync
        self.allow_failback = allow_failback
        self.topology_extension = topology_extension
        # TLS listeners with these files; tls_client_auth: clients must show a certificate.
        self.tls = tls
        self.tls_client_auth = tls_client_auth
        # What clients call the nodes: over TLS a name the certificate gives (proton does not
        # match an address against a certificate's subjectAltName).
        self.client_host = "localhost" if tls is not None and host == "127.0.0.1" else host
        if tls_client_auth and tls is None:
            raise ValueError("tls_client_auth needs tls files")
        self.start_backup = start_backup
        self.log_level = log_level
        # Journal segment bytes and the compaction threshold; None: the node's defaults.
        self.segment_size = segment_size
        self.checkpoint_segments = checkpoint_segments
        # Per node: the network namespace it runs in ({"live": ..., "backup": ...}) and the
        # address it listens on there (its peer and the clients use it too).
        netns = dict(netns or {})
        hosts = dict(hosts or {})
        for what, given in (("netns", netns), ("hosts", hosts)):
            unknown = sorted(set(given) - {"live", "backup"})
            if unknown:
                raise ValueError(f"{what}: unknown node(s) {unknown}; the nodes are live, backup")
        if netns and set(netns) != set(hosts):
            raise ValueError(
                "netns needs hosts for the same nodes: an address of this process's namespace "
                f"is not one of the node's (netns for {sorted(netns)}, hosts for {sorted(hosts)})"
            )
        if tls is not None and hosts:
            raise ValueError("per-node hosts and tls together are not supported")
        # Sockets holding the ports of each node that is not running (the module's header).
        self._reserved: dict[str, list[socket.socket]] = {}
        held: list[socket.socket] = []
        if ports is not None:
            p = list(ports)
        elif netns:
            # Each node alone in its namespace: the usual ports are free there.
            p = [61613, 5672, 61617, 61613, 5672, 61617]
        else:
            # Bound until each node starts, never released in between.
            held = _bound_sockets(6, host)
            p = [s.getsockname()[1] for s in held]
        self.nodes = (
            NodeProcess(
                "live",
                "live",
                p[0],
                p[1],
                p[2],
                self.data_dir / "live",
                self.data_dir / "live.log",
                host=hosts.get("live", host),
                netns=netns.get("live"),
            ),
            NodeProcess(
                "backup",
                "backup",
                p[3],
                p[4],
                p[5],
                self.data_dir / "backup",
                self.data_dir / "backup.log",
                host=hosts.get("backup", host),
                netns=netns.get("backup"),
            ),
        )
        if self.nodes[0].host == self.nodes[1].host and netns:  # no ports held in namespaces
            raise ValueError(f"hosts: both nodes on {self.nodes[0].host}")
        self.users_file = self.data_dir / "users"
        self.pair_dir = self.data_dir / "pair"
        if held:
            self._reserved = {"live": held[:3], "backup": held[3:]}
        elif not netns:
            for node in self.nodes:
                self._reserve(node)

    # --- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> BrokerPair:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        users = UsersFile()
        users.add(self.user, self.password)
        users.save(self.users_file)
        # Both at once: after a failover the node with the newest data is the preferred
        # backup, and the preferred live joins it as backup (then fails back). On a new pair
        # the preferred live activates and the backup joins it.
        live, backup = self.nodes
        for node in self.nodes:
            if not node.running:
                self._reserve(node)  # again, after a stop()
        self._spawn(live)
        if self.start_backup:
            self._spawn(backup)
        deadline = time.monotonic() + timeout
        active = self.wait_active(timeout)
        if self.start_backup:
            if self.allow_failback and active is not live:
                # The preferred live synchronizes, then takes its role back.
                while live.status().get("role") != "live":
                    if time.monotonic() > deadline:
                        raise PairError(f"node {live.name} did not fail back within {timeout}s")
                    time.sleep(0.01)
            self.wait_synchronized(max(0.1, deadline - time.monotonic()))

    def _reserve(self, node: NodeProcess) -> None:
        """Hold ``node``'s ports while it does not run (the ones nothing else holds)."""
        if node.netns is not None or node.name in self._reserved:
            return
        ports = (node.stomp_port, node.amqp_port, node.replication_port)
        self._reserved[node.name] = [
            s for port in ports if (s := _reserve(node.host, port)) is not None
        ]

    def _release(self, node: NodeProcess) -> None:
        """Let go of ``node``'s ports: it is about to bind them."""
        for s in self._reserved.pop(node.name, []):
            s.close()

    def reserved_ports(self, node: NodeProcess) -> list[int]:
        """The ports this pair holds for ``node`` while it does not run."""
        return [s.getsockname()[1] for s in self._reserved.get(node.name, [])]

    def stop(self) -> None:
        """Stop every node this pair started: SIGTERM, then SIGKILL after a few seconds.
        The ports are let go of as well: a stopped pair holds nothing."""
        for node in self.nodes:
            # A reaped process's pid may belong to another process by now: never signal it.
            if node.process is None or node.process.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.process.pid, signal.SIGCONT)
                node.process.terminate()
        deadline = time.monotonic() + 5
        for node in self.nodes:
            if node.process is None:
                continue
            try:
                node.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(5)
        for node in self.nodes:
            self._release(node)

    def _spawn(self, node: NodeProcess) -> None:
        other = self.nodes[1] if node is self.nodes[0] else self.nodes[0]
        command = [
            sys.executable,
            "-m",
            "reference_broker",
            "run",
            "--node-id", node.name,
            "--role", node.preferred_role,
            "--data-dir", str(node.data_dir),
            "--pair-dir", str(self.pair_dir),
            "--host", node.host,
            "--stomp-port", str(node.stomp_port),
            "--amqp-port", str(node.amqp_port),
            "--replication-port", str(node.replication_port),
            "--peer-host", other.host,
            "--peer-replication-port", str(other.replication_port),
            "--peer-stomp-port", str(other.stomp_port),
            "--peer-amqp-port", str(other.amqp_port),
            "--users", str(self.users_file),
            "--heartbeat-timeout", str(self.heartbeat_timeout),
            "--lease", str(self.lease),
            "--sync", self.sync,
            "--log-level", self.log_level,
        ]  # fmt: skip
        if not self.allow_failback:
            command.append("--no-failback")
        if not self.topology_extension:
            command.append("--no-topology-extension")
        if self.tls is not None:
            command += ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
            command += ["--announce-host", self.client_host]
            if self.tls_client_auth:
                command += ["--tls-client-ca", str(self.tls.ca)]
        if self.segment_size is not None:
            command += ["--segment-size", str(self.segment_size)]
        if self.checkpoint_segments is not None:
            command += ["--checkpoint-segments", str(self.checkpoint_segments)]
        command += self.node_options
        if node.netns is not None:
            command = ["ip", "netns", "exec", node.netns, *command]
        log = open(node.log_path, "ab")  # noqa: SIM115 - the child owns it after Popen
        self._release(node)
        try:
            node.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()

    # --- what tests do ---------------------------------------------------------------------

    @property
    def live(self) -> NodeProcess:
        """The node that says it is live (by its status), else the preferred live."""
        for node in self.nodes:
            if node.role == "live":
                return node
        return self.nodes[0]

    @property
    def backup(self) -> NodeProcess:
        live = self.live
        return self.nodes[1] if live is self.nodes[0] else self.nodes[0]

    def node(self, name: str) -> NodeProcess:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def kill(self, node: NodeProcess) -> None:
        """SIGKILL, and reap the process."""
        if node.process is None or node.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.process.pid, signal.SIGKILL)
        node.process.wait(10)
        self._reserve(node)  # until it starts again

    def pause(self, node: NodeProcess) -> None:
        os.kill(self._running_pid(node), signal.SIGSTOP)

    def resume(self, node: NodeProcess) -> None:
        os.kill(self._running_pid(node), signal.SIGCONT)

    @staticmethod
    def _running_pid(node: NodeProcess) -> int:
        # poll() reaps an exited child; after that its pid may be another process's.
        if not node.running:
            raise PairError(f"node {node.name} is not running")
        return node.pid

    def restart(self, node: NodeProcess, timeout: float = 30.0) -> None:
        """Start a stopped or killed node again; it rejoins as backup (or fails back)."""
        if node.running:
            self.kill(node)
        self._spawn(node)
        deadline = time.monotonic() + timeout
        while not node.status():
            if time.monotonic() > deadline:
                raise PairError(f"node {node.name} did not start: see {node.log_path}")
            time.sleep(0.02)

    def wait_active(self, timeout: float = 10.0) -> NodeProcess:
        """Wait until one running node serves as live; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.running and node.status().get("role") == "live":
                    return node
            time.sleep(0.01)
        raise PairError(f"no node became live within {timeout}s: see {self.data_dir}/*.log")

    def wait_synchronized(self, timeout: float = 30.0) -> NodeProcess:
        """Wait until the backup holds a synchronized copy and the live replicates to it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.running and n.status().get("role") == "live"]
            backup = [n for n in self.nodes if n.running and n.status().get("role") == "backup"]
            if (
                live
                and backup
                and backup[0].status().get("synchronized")
                and not live[0].status().get("degraded")
            ):
                return backup[0]
            time.sleep(0.01)
        raise PairError(f"the backup did not synchronize within {timeout}s")

    # --- addresses -------------------------------------------------------------------------

    def _client_host(self, node: NodeProcess) -> str:
        return self.client_host if node.host == self.host else node.host

    def _url(self, scheme: str, addresses: list[tuple[str, int]]) -> str:
        credentials = f"{quote(self.user, safe='')}:{quote(self.password, safe='')}@"
        tls = self.tls
        if tls is not None:
            scheme = {"stomp": "stomp+ssl", "amqp": "amqps"}[scheme]
        brokers = ",".join(f"{scheme}://{credentials}{host}:{port}" for host, port in addresses)
        url = f"failover:({brokers})"
        if tls is not None:
            url += f"?ssl_ca_file={quote(str(tls.ca), safe='/')}"
            if self.tls_client_auth:
                url += f"&ssl_cert_file={quote(str(tls.client_cert), safe='/')}"
                url += f"&ssl_key_file={quote(str(tls.client_key), safe='/')}"
        return url

    @property
    def stomp_url(self) -> str:
        return self._url("stomp", [(self._client_host(n), n.stomp_port) for n in self.nodes])

    @property
    def amqp_url(self) -> str:
        return self._url("amqp", [(self._client_host(n), n.amqp_port) for n in self.nodes])

    def describe(self) -> dict[str, Any]:
        return {
            "nodes": [
                {
                    "name": n.name,
                    "role": n.role,
                    "pid": n.process.pid if n.process else None,
                    "stomp": f"{self._client_host(n)}:{n.stomp_port}",
                    "amqp": f"{self._client_host(n)}:{n.amqp_port}",
                }
                for n in self.nodes
            ],
            "stomp_url": self.stomp_url,
            "amqp_url": self.amqp_url,
            "data_dir": str(self.data_dir),
            "tls_ca": str(self.tls.ca) if self.tls is not None else None,
        }
