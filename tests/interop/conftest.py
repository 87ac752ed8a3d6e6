"""RabbitMQ for the interop tests.

The session fixture ``rabbitmq`` makes a RabbitMQ node available on loopback and describes it:

- by default it runs ``scripts/rabbitmq.sh ensure`` (installs Debian's ``rabbitmq-server`` if
  missing, enables the STOMP and AMQP 1.0 plugins, starts a private node whose data is under
  ``.data/rabbitmq``) and, if this session started the node, stops it at the end
  (``HAFAILOVER_RABBITMQ_KEEP=1`` leaves it running);
- if ``HAFAILOVER_RABBITMQ_HOST`` is set, it uses that broker as it is and only checks its ports.

Ports come from ``HAFAILOVER_RABBITMQ_AMQP_PORT`` (5672) and ``HAFAILOVER_RABBITMQ_STOMP_PORT``
(61613), the same variables the script reads. When RabbitMQ cannot be had, the tests skip with
the reason, except in CI (``CI=true``), where they fail.

The fixture ``rabbitmq_control`` disrupts that node for failover tests: ``restart()`` stops and
starts the RabbitMQ application inside the running Erlang VM (``rabbitmqctl stop_app`` and
``start_app``: every connection is closed, non-durable queues are deleted, durable ones and
their persistent messages are recovered from disk, exactly as after a full node restart, but in
2-5 s instead of 10), and ``paused()`` freezes the node with SIGSTOP (a broker that stops
answering without closing anything) until the block ends. It needs the node this project
starts, so it is unavailable with ``HAFAILOVER_RABBITMQ_HOST``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from proton.utils import BlockingConnection

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "rabbitmq.sh"
IN_CI = os.environ.get("CI", "").lower() == "true"
DATA_DIR = Path(os.environ.get("HAFAILOVER_RABBITMQ_DATA_DIR", str(ROOT / ".data" / "rabbitmq")))
# installing from Debian's mirrors can take a while; the start itself is bounded by the script
ENSURE_TIMEOUT_S = float(os.environ.get("HAFAILOVER_RABBITMQ_ENSURE_TIMEOUT", "900"))


@dataclass(frozen=True)
class RabbitMQ:
    """Where the broker listens and who to log in as (guest/guest works on loopback only)."""

    host: str
    stomp_port: int
    amqp_port: int
    user: str = "guest"
    password: str = "guest"
    vhost: str = "/"

    @property
    def amqp_url(self) -> str:
        """Connection URL without credentials (pass user and password separately)."""
        return f"amqp://{self.host}:{self.amqp_port}"

    @property
    def stomp_url(self) -> str:
        return f"stomp://{self.host}:{self.stomp_port}"


def _unavailable(reason: str) -> None:
    message = f"RabbitMQ is not available: {reason}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _script(command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), command],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _ensure() -> str | None:
    """Run ``rabbitmq.sh ensure``; return None on success, else why it failed."""
    try:
        done = _script("ensure", ENSURE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{SCRIPT.name} ensure did not finish within {ENSURE_TIMEOUT_S:.0f}s"
    except OSError as exc:
        return f"cannot run {SCRIPT}: {exc}"
    if done.returncode != 0:
        tail = "\n".join((done.stderr + done.stdout).strip().splitlines()[-30:])
        return f"{SCRIPT.name} ensure exited with {done.returncode}:\n{tail}"
    return None


def _port_from_env(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        _unavailable(f"{name}={value!r} is not a port number")
        raise  # not reached: _unavailable fails or skips


@pytest.fixture(scope="session")
def rabbitmq() -> Iterator[RabbitMQ]:
    external = os.environ.get("HAFAILOVER_RABBITMQ_HOST")
    broker = RabbitMQ(
        host=external or "127.0.0.1",
        stomp_port=_port_from_env("HAFAILOVER_RABBITMQ_STOMP_PORT", 61613),
        amqp_port=_port_from_env("HAFAILOVER_RABBITMQ_AMQP_PORT", 5672),
        user=os.environ.get("HAFAILOVER_RABBITMQ_USER", "guest"),
        password=os.environ.get("HAFAILOVER_RABBITMQ_PASSWORD", "guest"),
    )
    started_here = False
    if not external:
        # "status" exits 0 only when our node runs with both ports open
        try:
            was_running = _script("status", 60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            was_running = False
        failure = _ensure()
        if failure:
            _unavailable(failure)
        started_here = not was_running
    for name, port in (("STOMP", broker.stomp_port), ("AMQP", broker.amqp_port)):
        if not _port_open(broker.host, port):
            _unavailable(f"{name} port {broker.host}:{port} does not accept connections")
    yield broker
    if started_here and os.environ.get("HAFAILOVER_RABBITMQ_KEEP") != "1":
        _script("stop", 120)


class RabbitMQControl:
    """Restart or pause the project's RabbitMQ node (see the module's docstring)."""

    def __init__(self, broker: RabbitMQ) -> None:
        self.broker = broker

    def queue_durable(self, name: str) -> bool | None:
        """Whether RabbitMQ holds queue ``name`` as durable (None: it has no such queue)."""
        for line in self._ctl("list_queues", "--quiet", "--no-table-headers", "name", "durable"):
            queue, _, durable = line.rpartition("\t")
            if queue == name:
                return durable.strip() == "true"
        return None

    def _ctl(self, *args: str) -> list[str]:
        done = subprocess.run(
            ["bash", str(SCRIPT), "ctl", *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr or done.stdout}")
        return done.stdout.splitlines()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        ports = (self.broker.stomp_port, self.broker.amqp_port)
        while not all(_port_open(self.broker.host, port, 0.5) for port in ports):
            if time.monotonic() > deadline:
                raise RuntimeError(f"RabbitMQ did not reopen its ports within {timeout}s")
            time.sleep(0.1)

    def restart(self) -> float:
        """Stop and start the broker; return how long it was away, in seconds."""
        began = time.monotonic()
        try:
            self._ctl("stop_app")
        finally:
            # started again even if the stop failed half-way, so later tests find a broker
            self._ctl("start_app")
        self.wait_ready()
        return time.monotonic() - began

    def _pid(self) -> int:
        return int((DATA_DIR / "rabbitmq.pid").read_text().strip())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the node for the block; SIGCONT it after, whatever happens."""
        pid = self._pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)
        self.wait_ready()


def declare_nondurable_queue(broker: RabbitMQ, name: str) -> None:
    """Have RabbitMQ declare ``/queue/NAME`` non-durable, as a raw AMQP 1.0 sender whose
    target keeps the default durability (none) does; such a queue lives until a restart."""
    connection = BlockingConnection(
        broker.amqp_url,
        timeout=20,
        user=broker.user,
        password=broker.password,
        allowed_mechs="PLAIN",
        allow_insecure_mechs=True,  # PLAIN without TLS: loopback only
    )
    try:
        connection.create_sender(f"/queue/{name}")
    finally:
        connection.close()


@pytest.fixture
def rabbitmq_control(rabbitmq: RabbitMQ) -> RabbitMQControl:
    if os.environ.get("HAFAILOVER_RABBITMQ_HOST"):
        _unavailable("HAFAILOVER_RABBITMQ_HOST names a broker these tests cannot restart")
    if not (DATA_DIR / "rabbitmq.pid").is_file():
        _unavailable(f"no node of this project runs from {DATA_DIR}")
    return RabbitMQControl(rabbitmq)
