"""A three-node RabbitMQ cluster for the cluster tests.

The session fixture ``rabbitmq_cluster`` runs ``scripts/rabbitmq-cluster.sh ensure`` (installs
Debian's ``rabbitmq-server`` if missing, starts nodes hafailover-c1..c3@localhost with the STOMP
and AMQP 1.0 plugins, joins them into one cluster) and, if this session started the cluster,
stops it at the end by process id (``HAFAILOVER_RABBITMQ_KEEP=1`` leaves it running, as for the
single node). When the cluster cannot be had, the tests skip with the reason, except in CI
(``CI=true``), where they fail. The single node of tests/interop (hafailover@localhost) is never
touched: the cluster has its own names, ports, data and cookie.

The function fixture ``cluster`` gives the same cluster with its three nodes running, starting
again any node a failed test left killed. Node N (1, 2, 3) listens on
``HAFAILOVER_RABBITMQ_CLUSTER_STOMP_BASE`` + N (61700 + N) for STOMP and
``HAFAILOVER_RABBITMQ_CLUSTER_AMQP_BASE`` + N (5700 + N) for AMQP, the variables the script reads.

The tests' timeouts cover the test functions only (``func_only``): the set-up may install
RabbitMQ on a fresh machine, and is bounded by the script's own timeouts and those below.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import stomp

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "rabbitmq-cluster.sh"
IN_CI = os.environ.get("CI", "").lower() == "true"
NODES = (1, 2, 3)
# installing from Debian's mirrors can take a while; each start is bounded by the script
ENSURE_TIMEOUT_S = float(os.environ.get("HAFAILOVER_RABBITMQ_ENSURE_TIMEOUT", "900"))
NODE_START_TIMEOUT_S = 180.0


def _unavailable(reason: str) -> None:
    message = f"the RabbitMQ cluster is not available: {reason}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _base(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        _unavailable(f"{name}={value!r} is not a port number")
        raise  # not reached: _unavailable fails or skips


@dataclass(frozen=True)
class RabbitMQCluster:
    """Where the three nodes listen, and how to kill and restart one (by process id, through
    the script). guest/guest works on loopback only."""

    host: str
    stomp_base: int
    amqp_base: int
    user: str = "guest"
    password: str = "guest"

    def port(self, protocol: str, node: int) -> int:
        return (self.stomp_base if protocol == "stomp" else self.amqp_base) + node

    def failover_url(self, protocol: str, options: str) -> str:
        """The failover URL listing the three nodes, in node order."""
        brokers = ",".join(
            f"{protocol}://{self.user}:{self.password}@{self.host}:{self.port(protocol, n)}"
            for n in NODES
        )
        return f"failover:({brokers})?{options}"

    def node_of(self, broker: str | None) -> int | None:
        """The node a connection's ``broker`` (its redacted URL) names; None when it names
        none of them (or is None: failing over)."""
        if broker is None:
            return None
        found = re.search(r":(\d+)$", broker)
        if found is None:
            return None
        port = int(found.group(1))
        for node in NODES:
            if port in (self.port("stomp", node), self.port("amqp", node)):
                return node
        return None

    def _run(self, *args: str, timeout: float) -> str:
        try:
            done = _script(*args, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{SCRIPT.name} {' '.join(args)}: no end in {timeout}s") from exc
        if done.returncode != 0:
            raise RuntimeError(
                f"{SCRIPT.name} {' '.join(args)} exited with {done.returncode}: "
                f"{(done.stderr + done.stdout).strip()[-2000:]}"
            )
        return done.stdout

    def kill(self, node: int) -> None:
        """SIGKILL node ``node``'s Erlang VM and wait until the process is gone."""
        self._run("kill", str(node), timeout=30)

    def start(self, node: int) -> None:
        """Start node ``node`` again; returns once it is back in the cluster and its ports
        accept connections."""
        self._run("start", str(node), timeout=NODE_START_TIMEOUT_S)

    def ctl(self, node: int, *args: str) -> list[str]:
        """rabbitmqctl against node ``node``; its output lines."""
        return self._run("ctl", str(node), *args, timeout=90).splitlines()

    def queue_types(self, node: int = 1) -> dict[str, str]:
        """Every queue of the default virtual host and its type (classic, quorum, stream)."""
        lines = self.ctl(node, "list_queues", "--quiet", "--no-table-headers", "name", "type")
        types = {}
        for line in lines:
            name, _, kind = line.rpartition("\t")
            types[name] = kind.strip()
        return types

    def queue_leader(self, name: str, node: int = 1) -> int | None:
        """The node holding the leader of quorum queue ``name`` (None: no such queue, or no
        leader known)."""
        lines = self.ctl(node, "list_queues", "--quiet", "--no-table-headers", "name", "leader")
        for line in lines:
            queue, _, leader = line.rpartition("\t")
            if queue == name:
                found = re.fullmatch(r"hafailover-c(\d+)@localhost", leader.strip())
                return int(found.group(1)) if found else None
        return None

    def declare_quorum_queue(self, name: str, node: int = 1) -> None:
        """Declare the durable quorum queue ``name``, replicated on the three nodes.

        Through the STOMP plugin, which declares a ``/queue/NAME`` with the ``x-queue-type``
        and ``durable`` headers of the SUBSCRIBE that names it. Clients then use it as
        ``/amq/queue/NAME``: RabbitMQ 3.10 refuses a declaration without ``x-queue-type``
        when the queue is a quorum queue, and its AMQP 1.0 plugin cannot pass one."""
        connection = stomp.Connection12(
            [(self.host, self.port("stomp", node))], vhost="/", auto_decode=False
        )
        connection.connect(self.user, self.password, wait=True)
        try:
            connection.subscribe(
                f"/queue/{name}",
                id="declare",
                ack="client-individual",
                headers={
                    "x-queue-type": "quorum",
                    "durable": "true",
                    "auto-delete": "false",
                },
            )
            connection.unsubscribe("declare")
        finally:
            # frames are handled in order: the DISCONNECT's receipt follows the declaration
            connection.disconnect(receipt="bye")


@pytest.fixture(scope="session")
def rabbitmq_cluster() -> Iterator[RabbitMQCluster]:
    cluster = RabbitMQCluster(
        host="127.0.0.1",
        stomp_base=_base("HAFAILOVER_RABBITMQ_CLUSTER_STOMP_BASE", 61700),
        amqp_base=_base("HAFAILOVER_RABBITMQ_CLUSTER_AMQP_BASE", 5700),
    )
    # "status" exits 0 only when all three nodes run with their ports open
    try:
        was_running = _script("status", timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        was_running = False
    try:
        done = _script("ensure", timeout=ENSURE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _unavailable(f"{SCRIPT.name} ensure did not finish within {ENSURE_TIMEOUT_S:.0f}s")
    except OSError as exc:
        _unavailable(f"cannot run {SCRIPT}: {exc}")
    else:
        if done.returncode != 0:
            tail = "\n".join((done.stderr + done.stdout).strip().splitlines()[-30:])
            _unavailable(f"{SCRIPT.name} ensure exited with {done.returncode}:\n{tail}")
    for node in NODES:
        for protocol in ("stomp", "amqp"):
            port = cluster.port(protocol, node)
            if not _port_open(cluster.host, port):
                _unavailable(f"node {node}'s {protocol} port {port} does not accept connections")
    yield cluster
    if not was_running and os.environ.get("HAFAILOVER_RABBITMQ_KEEP") != "1":
        _script("stop", timeout=180)


@pytest.fixture
def cluster(rabbitmq_cluster: RabbitMQCluster) -> RabbitMQCluster:
    """The cluster with its three nodes running (a node a failed test left killed is started
    again first)."""
    began = time.monotonic()
    try:
        done = _script("ensure", timeout=NODE_START_TIMEOUT_S * 3)
    except subprocess.TimeoutExpired:
        _unavailable(f"{SCRIPT.name} ensure did not finish in {time.monotonic() - began:.0f}s")
    else:
        if done.returncode != 0:
            _unavailable(f"{SCRIPT.name} ensure exited with {done.returncode}: {done.stderr}")
    return rabbitmq_cluster
