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

The ratio is hafailover's figure over py-amqp's on the same RabbitMQ node, measured in the
same run, runs alternated (best of --repeats). Issue 22's target: >= 0.8 on RabbitMQ. Each
hafailover configuration runs twice: with every task publish confirmed before the next (the
default, ``confirm_publish``) and with ``confirm_publish=False`` (kept in the confirmation
window, confirmed in the background), since py-amqp, Celery's default, does not confirm.
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
from collections.abc import Iterator
from pathlib import Path

# This file is named celery.py: its own directory must not shadow the celery package.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402

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
def worker(env: dict[str, str]) -> Iterator[None]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--worker"],
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
    with worker(env):
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
    parser.add_argument("--quick", action="store_true", help="fewer tasks and one run")
    parser.add_argument("--tasks", type=int, help="tasks per run (2000; --quick 500)")
    parser.add_argument("--repeats", type=int, help="alternated runs, best kept (2; --quick 1)")
    parser.add_argument("--no-pair", action="store_true", help="RabbitMQ only")
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
    tasks = args.tasks or (500 if args.quick else 2000)
    repeats = args.repeats or (1 if args.quick else 2)
    amqp_port, stomp_port = rabbitmq_ports()
    rabbit = "guest:guest@127.0.0.1"
    confirmed: dict[str, object] = {}
    pipelined: dict[str, object] = {"confirm_publish": False}
    configurations = [
        ("rabbitmq py-amqp", f"pyamqp://{rabbit}:{amqp_port}//", {}),
        ("rabbitmq hafailover stomp", f"hafailover+stomp://{rabbit}:{stomp_port}", confirmed),
        (
            "rabbitmq hafailover stomp unconfirmed",
            f"hafailover+stomp://{rabbit}:{stomp_port}",
            pipelined,
        ),
        ("rabbitmq hafailover amqp", f"hafailover+amqp://{rabbit}:{amqp_port}", confirmed),
        (
            "rabbitmq hafailover amqp unconfirmed",
            f"hafailover+amqp://{rabbit}:{amqp_port}",
            pipelined,
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
                    (f"pair hafailover {protocol}", f"hafailover+{url}", confirmed),
                    (f"pair hafailover {protocol} unconfirmed", f"hafailover+{url}", pipelined),
                ]
        for _ in range(repeats):
            for name, url, options in configurations:
                figures = measure(url, tasks, dict(options), tmp)
                kept = best.setdefault(name, figures)
                if figures["tasks_per_s"] > kept["tasks_per_s"]:
                    best[name] = figures
                print(
                    f"{name:40s} {figures['tasks_per_s']:8.0f} tasks/s "
                    f"(sends {figures['sends_per_s']:6.0f}/s)",
                    file=sys.stderr,
                    flush=True,
                )
    base = best["rabbitmq py-amqp"]["tasks_per_s"]
    result = {
        name: {**figures, "ratio_to_py_amqp": figures["tasks_per_s"] / base}
        for name, figures in best.items()
    }
    if args.json:
        print(json.dumps({"tasks": tasks, "repeats": repeats, "figures": result}, indent=2))
    else:
        print(
            f"{tasks} tasks per run, best of {repeats}; ratio: tasks/s over py-amqp's on RabbitMQ"
        )
        for name, figures in result.items():
            print(
                f"  {name:40s} {figures['tasks_per_s']:8.0f} tasks/s  "
                f"sends {figures['sends_per_s']:6.0f}/s  ratio {figures['ratio_to_py_amqp']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
