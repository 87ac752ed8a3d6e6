"""The Celery application the worker tests run in real processes (``celery -A`` loads it).

Configured from the environment, since the worker and the producer are separate processes:
``HAFAILOVER_CELERY_BROKER`` (the broker_url), ``HAFAILOVER_CELERY_QUEUE`` and
``HAFAILOVER_CELERY_RUNS`` (a file each run of ``record`` appends one line to),
``HAFAILOVER_CELERY_TASK_SECONDS`` (how long each task the producer sends takes),
``HAFAILOVER_CELERY_QUEUE_TYPE`` (Celery's ``task_default_queue_type``: ``quorum`` for a
RabbitMQ quorum queue, declared beforehand).
"""

from __future__ import annotations

import os
import time

from celery import Celery

import hafailover.kombu  # noqa: F401 - registers the "hafailover" transport alias

QUEUE = os.environ.get("HAFAILOVER_CELERY_QUEUE", "celery")
TASK_SECONDS = float(os.environ.get("HAFAILOVER_CELERY_TASK_SECONDS", "0.02"))

app = Celery("hafailover_tests", broker=os.environ.get("HAFAILOVER_CELERY_BROKER"))
app.conf.update(
    task_acks_late=True,
    task_default_queue=QUEUE,
    task_default_queue_type=os.environ.get("HAFAILOVER_CELERY_QUEUE_TYPE", "classic"),
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    worker_cancel_long_running_tasks_on_connection_loss=False,
)


@app.task(name="record")
def record(number: int, seconds: float = 0.02) -> int:
    """Take a little time (so that a kill finds runs in progress), then note the run."""
    time.sleep(seconds)
    line = f"{number} {os.getpid()}\n".encode()
    descriptor = os.open(
        os.environ["HAFAILOVER_CELERY_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT
    )
    try:
        os.write(descriptor, line)  # one write with O_APPEND: whole lines from every process
    finally:
        os.close(descriptor)
    return number


def send(count: int) -> None:
    """The producer process: ``python -m tests.celery.celery_app COUNT``."""
    with app.producer_or_acquire() as producer:
        for number in range(count):
            record.apply_async((number, TASK_SECONDS), producer=producer)


if __name__ == "__main__":
    import sys

    send(int(sys.argv[1]))
