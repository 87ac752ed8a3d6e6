"""A poison message: a message whose listener always fails is not redelivered without
end; after max_redeliveries failed deliveries the consumer rejects it to the broker's
dead-letter address and counts it in ``consumer.rejected``.

Run: python examples/poison_message.py [FAILOVER_URL]   (no URL: the bundled pair)

The bundled pair's dead-letter queue is queue://DLQ (other brokers: their own setting).
"""

from __future__ import annotations

import sys
import threading
import time

from _pair import failover_url

import hafailover
from hafailover import AckMode, Message

QUEUE = "queue://example.orders"
DEAD_LETTERS = "queue://DLQ"
MAX_REDELIVERIES = 2


def main(argv: list[str]) -> int:
    with failover_url(argv) as url:
        url = f"{url}{'&' if '?' in url else '?'}max_redeliveries={MAX_REDELIVERIES}"
        with hafailover.connect(url) as connection:
            session = connection.create_session(AckMode.AUTO)
            session.create_producer(QUEUE).send("an order nobody can process")
            attempts: list[int] = []
            lock = threading.Lock()

            def process(message: Message) -> None:
                with lock:
                    attempts.append(message.delivery_count)
                print(f"delivery {len(attempts)} (delivery_count {message.delivery_count})")
                raise ValueError("cannot process this order")

            consumer = session.create_consumer(QUEUE)
            consumer.set_message_listener(process)
            connection.start()
            deadline = time.monotonic() + 30
            while consumer.rejected == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            consumer.close()
            print(f"handed out {len(attempts)} times, then rejected: {consumer.rejected}")

            dead = session.create_consumer(DEAD_LETTERS)
            letter = dead.receive(timeout=5.0)
            print(f"in {DEAD_LETTERS}: {letter.text if letter is not None else 'nothing'}")
        return 0 if len(attempts) == MAX_REDELIVERIES + 1 and letter is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
