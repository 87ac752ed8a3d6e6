"""A producer and a consumer on STOMP 1.2, through a failover URL.

Run: python examples/stomp_basic.py ['failover:(stomp://h1:61613,stomp://h2:61613)?...']
(no URL: the bundled pair is started). Sends 10 messages, each confirmed by the broker,
then receives them.
"""

from __future__ import annotations

import sys

from _pair import failover_url

import hafailover
from hafailover import AckMode


def main(argv: list[str]) -> int:
    with failover_url(argv, "stomp") as url, hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.AUTO)
        producer = session.create_producer("queue://example.stomp")
        for seq in range(10):
            producer.send(f"hello {seq}", headers={"seq": seq})  # waits for the receipt
        print(f"sent 10 to {connection.broker}")

        consumer = session.create_consumer("queue://example.stomp")
        connection.start()
        received = []
        while (message := consumer.receive(timeout=2.0)) is not None:
            received.append(message.text)
        print(f"received {len(received)}: {received[0]} .. {received[-1]}")
        return 0 if len(received) == 10 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
