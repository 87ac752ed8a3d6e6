"""A durable topic subscription: what is published while the subscriber is away, and
through a failover of the broker, is kept for it and delivered when it comes back.

Run: python examples/durable_subscription.py [FAILOVER_URL]   (no URL: the bundled pair)

The URL gets a client_id: a durable subscription that is not shared is named by it. A
plain create_consumer on the topic would have lost all of this (DESIGN F5).
"""

from __future__ import annotations

import sys

from _pair import failover_url

import hafailover
from hafailover import AckMode

TOPIC = "topic://example.prices"
NAME = "price-board"


def main(argv: list[str]) -> int:
    with failover_url(argv) as url:
        url = f"{url}{'&' if '?' in url else '?'}client_id=example-board"
        with hafailover.connect(url) as connection:
            session = connection.create_session(AckMode.AUTO)
            # Subscribe once, then go away: the broker keeps the subscription.
            session.create_durable_consumer(TOPIC, NAME).close()
            producer = session.create_producer(TOPIC)
            for seq in range(5):
                producer.send(f"price {seq}")
            print("published 5 while the subscriber was away", flush=True)
            # A failover here (the live killed) waits in send() and goes on on the backup,
            # which holds the subscription and its messages: they are replicated.
            for seq in range(5, 10):
                producer.send(f"price {seq}")
            print("published 5 more", flush=True)

            consumer = session.create_durable_consumer(TOPIC, NAME)
            connection.start()
            received = []
            while (message := consumer.receive(timeout=2.0)) is not None:
                received.append(message.text)
            print(f"the subscriber came back to {len(received)}: {', '.join(received)}")
            consumer.close()
            session.unsubscribe(NAME)  # the broker forgets it and what it would keep
            print(f"failovers: {connection.statistics().failovers}")
        return 0 if len(received) == 10 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
