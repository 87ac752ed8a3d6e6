"""Celery tasks per second with the hafailover transport, against Celery's py-amqp, one run.

Run: .venv/bin/python benchmarks/celery.py [--quick] [--tasks N] [--json]

A Celery worker (threads pool, 4 threads, ``task_acks_late``, prefetch multiplier 4) runs in
a process of its own; once it is consuming, this process sends N no-op tasks and times
until the worker has run the last one (the tasks' runs are counted in a file each appends
one line to). Figures: tasks run per second from the first send to the last run, and the
sends per second alone. Brokers:

- the bundled pair (live + synchronized backup), STOMP and AMQP 1.0, started here;
- RabbitMQ on 127.0.0.1 (scripts/rabbitmq.sh starts it, as tests/interop does; a node that
  runs already is used as it is, ports from HAFAILOVER_RABBITMQ_AMQP_PORT and
  HAFAILOVER_RABBITMQ_STOMP_PORT): the hafailover transport over STOMP and over AMQP 1.0,
  and Celery's default transport (py-amqp, AMQP 0-9-1) on the same node.

Three reference rows leave Celery out: a raw py-amqp client (AMQP 0-9-1), a raw
python-qpid-proton client (AMQP 1.0) and a raw stomp.py client (STOMP 1.2) each send N
persistent messages of about a task message's size, nobody waiting for the broker, while a
consumer process (prefetch 16, as the worker's 4 threads x 4) appends a line per message and
acknowledges it: what RabbitMQ's protocols allow the same work, each plugin's own ratio (raw
proton or raw stomp.py over raw py-amqp).

The ratio is hafailover's figure over py-amqp's on the same RabbitMQ node, measured in the
same run, runs alternated (best of --repeats). Issue 22's target: >= 0.8 on RabbitMQ. Each
hafailover configuration runs twice: with every task publish confirmed before the next (the
default, ``confirm_publish``) and with ``confirm_publish=False`` (written without waiting for
the broker; kept in the confirmation window only on the bundled pair, whose STOMP has the
reattach extension), since py-amqp, Celery's default, does not confirm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# This file is named celery.py: its own directory must not shadow the celery package.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import amqp  # noqa: E402 - py-amqp, Celery's default transport's client
import stomp  # noqa: E402
from celery import Celery  # noqa: E402
from proton import Message as ProtonMessage  # noqa: E402
from proton import Terminus  # noqa: E402
from proton.handlers import MessagingHandler  # noqa: E402
from proton.reactor import Container, LinkOption  # noqa: E402

import hafailover.kombu  # noqa: E402, F401 - registers the "hafailover" transport alias
from reference_broker.pair import BrokerPair  # noqa: E402

app = Celery("hafailover_bench", broker=os.environ.get("BENCH_CELERY_BROKER"))
app.conf.update(
    task_acks_late=True,
    task_ignore_result=True,
    task_default_queue=os.environ.get("BENCH_CELERY_QUEUE", "bench"),
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options=json.loads(os.environ.get("BENCH_CELERY_OPTIONS", "{}")),
)


@app.task(name="noop")
def noop(number: int) -> None:
    descriptor = os.open(os.environ["BENCH_CELERY_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(descriptor, b"%d\n" % number)
    finally:
        os.close(descriptor)


def lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def wait_for(path: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while lines(path) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {lines(path)} of {count} tasks ran within {timeout}s")
        time.sleep(0.005)


@contextlib.contextmanager
def child(*args: str, env: dict[str, str] | None = None) -> Iterator[None]:
    """This script run again with ``args`` (the worker, a raw consumer) for the block."""
    process = subprocess.Popen(
        [sys.executable, __file__, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def measure(broker_url: str, tasks: int, options: dict[str, object], tmp: Path) -> dict[str, float]:
    """Tasks run per second (first send to last run) and sends per second."""
    stamp = time.monotonic_ns()
    runs = tmp / f"runs-{stamp}"
    env = {
        **os.environ,
        "BENCH_CELERY_BROKER": broker_url,
        "BENCH_CELERY_QUEUE": f"bench-{stamp}",
        "BENCH_CELERY_RUNS": str(runs),
        "BENCH_CELERY_OPTIONS": json.dumps(options),
    }
    # A client app of its own per configuration: an app's producer pool keeps its broker.
    client = Celery("hafailover_bench_client", broker=broker_url)
    client.conf.update(
        task_default_queue=env["BENCH_CELERY_QUEUE"],
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
    )
    with child("--worker", env=env):
        with client.producer_or_acquire() as producer:
            client.send_task("noop", (-1,), producer=producer)  # the worker is up, consuming
            wait_for(runs, 1, 60)
            start = time.perf_counter()
            for number in range(tasks):
                client.send_task("noop", (number,), producer=producer)
            sent = time.perf_counter() - start
        wait_for(runs, tasks + 1, 300)
        ran = time.perf_counter() - start
    client.close()
    return {"tasks_per_s": tasks / ran, "sends_per_s": tasks / sent}


# --- raw clients, no Celery: what RabbitMQ's three protocols allow the same work ------------
#
# One process consumes (prefetch 16, as the worker's 4 threads x multiplier 4), appends a
# line per message to the runs file and acknowledges it; this process sends the messages
# (persistent, a body the size of a Celery task message, nobody waiting for the broker).

RAW_PREFETCH = 16
RAW_BODY = b"x" * 900  # a Celery task message (headers, properties, body) is about 900 bytes


def _raw_ran(runs: str) -> None:
    descriptor = os.open(runs, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(descriptor, b"1\n")
    finally:
        os.close(descriptor)


def _durable(terminus: Any) -> None:
    # As hafailover's links to a RabbitMQ queue: a durable queue, kept after the link.
    terminus.durability = Terminus.DELIVERIES
    terminus.expiry_policy = Terminus.EXPIRE_NEVER


class _DurableSource(LinkOption):
    def apply(self, link: Any) -> None:
        _durable(link.source)


class _DurableTarget(LinkOption):
    def apply(self, link: Any) -> None:
        _durable(link.target)


class _ProtonConsumer(MessagingHandler):
    def __init__(self, url: str, queue: str, runs: str) -> None:
        super().__init__(prefetch=RAW_PREFETCH, auto_accept=False)
        self.url, self.queue, self.runs = url, queue, runs

    def on_start(self, event: Any) -> None:
        connection = event.container.connect(self.url, allowed_mechs="PLAIN")
        event.container.create_receiver(
            connection, f"/queue/{self.queue}", options=_DurableSource()
        )

    def on_message(self, event: Any) -> None:
        _raw_ran(self.runs)
        self.accept(event.delivery)


class _ProtonSender(MessagingHandler):
    """Sends ``count`` messages as the link's credit allows; done once the broker settled
    them all (``sent`` is when the last one was written)."""

    def __init__(self, url: str, queue: str, count: int) -> None:
        super().__init__()
        self.url, self.queue, self.count = url, queue, count
        self.written = self.settled = 0
        self.start = self.sent = 0.0

    def on_start(self, event: Any) -> None:
        connection = event.container.connect(self.url, allowed_mechs="PLAIN")
        event.container.create_sender(connection, f"/queue/{self.queue}", options=_DurableTarget())

    def on_sendable(self, event: Any) -> None:
        if not self.written:
            self.start = time.perf_counter()
        while event.sender.credit and self.written < self.count:
            event.sender.send(ProtonMessage(body=RAW_BODY, durable=True))
            self.written += 1
            if self.written == self.count:
                self.sent = time.perf_counter()

    def on_settled(self, event: Any) -> None:
        self.settled += 1
        if self.settled == self.count:
            event.connection.close()


def _stomp_connection(url: str, listener: Any = None) -> Any:
    parts = urllib.parse.urlsplit(url)
    # RabbitMQ reads STOMP's host header as the virtual host: "/", not the address
    connection = stomp.Connection12(
        [(parts.hostname, parts.port)], heartbeats=(0, 0), vhost="/", auto_decode=False
    )
    if listener is not None:
        connection.set_listener("raw", listener)
    connection.connect(parts.username, parts.password, wait=True)
    # as hafailover's STOMP transport and py-amqp do: each frame a segment of its own
    connection.transport.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


class _StompConsumer(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self, runs: str) -> None:
        self.runs = runs
        self.connection: Any = None

    def on_message(self, frame: Any) -> None:
        _raw_ran(self.runs)
        self.connection.ack(frame.headers["ack"])


def raw_consumer(kind: str, url: str, queue: str, runs: str) -> None:
    if kind == "proton":
        Container(_ProtonConsumer(url, queue, runs)).run()
        return
    if kind == "stomp.py":
        listener = _StompConsumer(runs)
        listener.connection = _stomp_connection(url, listener)
        listener.connection.subscribe(
            f"/queue/{queue}",
            id="raw",
            ack="client-individual",
            headers={"prefetch-count": str(RAW_PREFETCH)},
        )
        while True:
            time.sleep(3600)  # stomp.py's receiver thread consumes
    connection = amqp.Connection(**_amqp_params(url))
    connection.connect()
    channel = connection.channel()
    channel.queue_declare(queue, durable=True, auto_delete=False)
    channel.basic_qos(0, RAW_PREFETCH, False)

    def on_message(message: Any) -> None:
        _raw_ran(runs)
        channel.basic_ack(message.delivery_tag)

    channel.basic_consume(queue, callback=on_message)
    while True:
        connection.drain_events()


def _amqp_params(url: str) -> dict[str, Any]:
    parts = urllib.parse.urlsplit(url)
    return {
        "host": f"{parts.hostname}:{parts.port}",
        "userid": parts.username,
        "password": parts.password,
    }


def raw_send(kind: str, url: str, queue: str, count: int) -> tuple[float, float]:
    """Send ``count`` messages: when the first and the last were written (perf_counter)."""
    if kind == "proton":
        sender = _ProtonSender(url, queue, count)
        Container(sender).run()
        return sender.start, sender.sent
    if kind == "stomp.py":
        client = _stomp_connection(url)
        try:
            start = time.perf_counter()
            for _ in range(count):
                client.send(f"/queue/{queue}", RAW_BODY, headers={"persistent": "true"})
            return start, time.perf_counter()
        finally:
            client.disconnect()  # sends DISCONNECT, does not wait for its receipt
    connection = amqp.Connection(**_amqp_params(url))
    connection.connect()
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True, auto_delete=False)  # as the consumer does
        start = time.perf_counter()
        for _ in range(count):
            channel.basic_publish(
                amqp.Message(RAW_BODY, delivery_mode=2), exchange="", routing_key=queue
            )
        return start, time.perf_counter()
    finally:
        connection.close()


def measure_raw(kind: str, url: str, tasks: int, tmp: Path) -> dict[str, float]:
    """As ``measure``, with the raw clients of ``kind`` (proton: AMQP 1.0, py-amqp: 0-9-1,
    stomp.py: STOMP 1.2)."""
    stamp = time.monotonic_ns()
    runs = tmp / f"runs-{stamp}"
    queue = f"bench-raw-{stamp}"
    with child("--raw-consumer", kind, url, queue, str(runs)):
        raw_send(kind, url, queue, 1)  # the consumer is up, consuming
        wait_for(runs, 1, 60)
        start, sent = raw_send(kind, url, queue, tasks)
        wait_for(runs, tasks + 1, 300)
        ran = time.perf_counter() - start
    return {"tasks_per_s": tasks / ran, "sends_per_s": tasks / (sent - start)}


def rabbitmq_ports() -> tuple[int, int]:
    amqp = int(os.environ.get("HAFAILOVER_RABBITMQ_AMQP_PORT", "5672"))
    stomp = int(os.environ.get("HAFAILOVER_RABBITMQ_STOMP_PORT", "61613"))
    for port in (amqp, stomp):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError:
            subprocess.run(
                ["bash", str(ROOT / "scripts" / "rabbitmq.sh"), "ensure"],
                stdin=subprocess.DEVNULL,
                check=True,
                timeout=900,
            )
            break
    return amqp, stomp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--raw-consumer", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer tasks and one run")
    parser.add_argument("--tasks", type=int, help="tasks per run (2000; --quick 500)")
    parser.add_argument("--repeats", type=int, help="alternated runs, best kept (2; --quick 1)")
    parser.add_argument("--no-pair", action="store_true", help="RabbitMQ only")
    parser.add_argument("--no-rabbitmq", action="store_true", help="the bundled pair only")
    parser.add_argument("--no-raw", action="store_true", help="without the raw client rows")
    parser.add_argument(
        "--only", action="append", default=[], help="only rows whose name has this (repeatable)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.worker:
        app.worker_main(
            [
                *("worker", "-P", "threads", "-c", "4"),
                *("--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "warning"),
            ]
        )
        return 0
    if args.raw_consumer:
        raw_consumer(*args.raw_consumer)
        return 0
    tasks = args.tasks or (500 if args.quick else 2000)
    repeats = args.repeats or (1 if args.quick else 2)
    confirmed: dict[str, object] = {}
    pipelined: dict[str, object] = {"confirm_publish": False}
    # (name, broker URL, transport options, raw client or None: Celery)
    configurations: list[tuple[str, str, dict[str, object], str | None]] = []
    if not args.no_rabbitmq:
        amqp_port, stomp_port = rabbitmq_ports()
        rabbit = "guest:guest@127.0.0.1"
        stomp = f"hafailover+stomp://{rabbit}:{stomp_port}"
        amqp10 = f"hafailover+amqp://{rabbit}:{amqp_port}"
        configurations += [
            ("rabbitmq py-amqp", f"pyamqp://{rabbit}:{amqp_port}//", {}, None),
            ("rabbitmq hafailover stomp", stomp, confirmed, None),
            ("rabbitmq hafailover stomp unconfirmed", stomp, pipelined, None),
            ("rabbitmq hafailover amqp", amqp10, confirmed, None),
            ("rabbitmq hafailover amqp unconfirmed", amqp10, pipelined, None),
        ]
        if not args.no_raw:
            configurations += [
                ("rabbitmq raw py-amqp, no Celery", f"amqp://{rabbit}:{amqp_port}", {}, "py-amqp"),
                ("rabbitmq raw proton, no Celery", f"amqp://{rabbit}:{amqp_port}", {}, "proton"),
                (
                    "rabbitmq raw stomp.py, no Celery",
                    f"stomp://{rabbit}:{stomp_port}",
                    {},
                    "stomp.py",
                ),
            ]
    best: dict[str, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-celery-")))
        if not args.no_pair:
            pair = stack.enter_context(BrokerPair(tmp / "pair", user="app", password="secret"))
            pair.wait_synchronized(30)
            for protocol, url in (("stomp", pair.stomp_url), ("amqp", pair.amqp_url)):
                configurations += [
                    (f"pair hafailover {protocol}", f"hafailover+{url}", confirmed, None),
                    (
                        f"pair hafailover {protocol} unconfirmed",
                        f"hafailover+{url}",
                        pipelined,
                        None,
                    ),
                ]
        if args.only:
            configurations = [c for c in configurations if any(o in c[0] for o in args.only)]
        for _ in range(repeats):
            for name, url, options, raw in configurations:
                if raw is None:
                    figures = measure(url, tasks, dict(options), tmp)
                else:
                    figures = measure_raw(raw, url, tasks, tmp)
                kept = best.setdefault(name, figures)
                if figures["tasks_per_s"] > kept["tasks_per_s"]:
                    best[name] = figures
                print(
                    f"{name:40s} {figures['tasks_per_s']:8.0f} tasks/s "
                    f"(sends {figures['sends_per_s']:6.0f}/s, load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
    base_figures = best.get("rabbitmq py-amqp")
    base = base_figures["tasks_per_s"] if base_figures else None
    raw_base = best.get("rabbitmq raw py-amqp, no Celery")
    result: dict[str, dict[str, float | None]] = {
        name: {
            **figures,
            "ratio_to_py_amqp": (
                (figures["tasks_per_s"] / raw_base["tasks_per_s"] if raw_base else None)
                if name.startswith("rabbitmq raw")
                else (figures["tasks_per_s"] / base if base else None)
            ),
        }
        for name, figures in best.items()
    }
    load = os.getloadavg()
    if args.json:
        print(
            json.dumps(
                {"tasks": tasks, "repeats": repeats, "load": load, "figures": result}, indent=2
            )
        )
    else:
        print(
            f"{tasks} tasks per run, best of {repeats}; ratio: tasks/s over py-amqp's on "
            f"RabbitMQ (raw rows: over raw py-amqp's); load average at the end "
            f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
        )
        for name, row in result.items():
            ratio = row["ratio_to_py_amqp"]
            print(
                f"  {name:40s} {row['tasks_per_s'] or 0:8.0f} tasks/s  "
                f"sends {row['sends_per_s'] or 0:6.0f}/s  "
                f"ratio {'-' if ratio is None else f'{ratio:.2f}'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
