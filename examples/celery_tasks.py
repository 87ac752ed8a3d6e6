"""Celery on hafailover: a worker and a producer through a failover URL.

Run: python examples/celery_tasks.py ['failover:(stomp://h1:61613,stomp://h2:61613)?...']
(no URL: the bundled pair is started). Starts a Celery worker (threads pool, late
acknowledgement) as a second process, sends 20 tasks, prints their results as they come
back (through Celery's rpc:// result backend, on the same broker), then stops the worker.
Kill the live broker while it runs: the tasks still complete, each once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from celery import Celery

import hafailover.kombu  # noqa: F401 - registers the "hafailover" transport alias

# The worker process imports this module too and finds the URL here.
BROKER = os.environ.get("EXAMPLE_CELERY_BROKER")

app = Celery("celery_tasks", broker=BROKER, backend="rpc://")
app.conf.update(
    task_acks_late=True,  # a task's message is acknowledged once it ran: failover-safe
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # kombu's pass-through to the URL: a duplicate window for the worker's consumer.
    broker_transport_options={"consumer_dedup": 1000},
)


@app.task(name="multiply")
def multiply(x: int, y: int) -> int:
    time.sleep(0.2)
    return x * y


def main(argv: list[str]) -> int:
    from _pair import failover_url

    with failover_url(argv, "stomp") as url:
        # A fresh process (the worker) must find the backup if the live is gone (F12).
        if "initial_connect_attempts" not in url:
            url += f"{'&' if '?' in url else '?'}initial_connect_attempts=5"
        os.environ["EXAMPLE_CELERY_BROKER"] = f"hafailover+{url}"
        app.conf.broker_url = os.environ["EXAMPLE_CELERY_BROKER"]
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "celery_tasks",
                "worker",
                "-P",
                "threads",
                "-c",
                "4",
                "--without-mingle",
                "--without-gossip",
                "-l",
                "warning",
            ],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            start_new_session=True,
        )
        try:
            results = [multiply.delay(n, 10) for n in range(20)]
            print("sent 20 tasks", flush=True)
            values = [result.get(timeout=60) for result in results]
            print(f"results: {values}", flush=True)
            return 0 if values == [n * 10 for n in range(20)] else 1
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(30)
            app.close()  # this process's connections, before the pair stops


if __name__ == "__main__":
    sys.exit(main(sys.argv))
