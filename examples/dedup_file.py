"""A consumer's duplicate window kept in a file (consumer_dedup_file), across a restart.

Run: python examples/dedup_file.py [FAILOVER_URL]
(no URL: the bundled pair is started with its duplicate detection off, as RabbitMQ has
none). Ten messages are consumed; the consumer's connection is closed, as a process that
stops would; then copies of the same ten (same duplicate ids, as a failover's resends leave
them on such a broker) and two new messages arrive. The new consumer, reading the file,
drops the copies.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

from _pair import OPTIONS

import hafailover
from hafailover import Message


@contextlib.contextmanager
def broker_url(argv: list[str]) -> Iterator[str]:
    if len(argv) > 1:
        yield argv[1]
        return
    from reference_broker.pair import BrokerPair

    with (
        tempfile.TemporaryDirectory(prefix="hafailover-example-") as tmp,
        BrokerPair(
            tmp,
            user="example",
            password="example",  # noqa: S106 - loopback
            node_options=["--duplicate-id-cache-size", "0"],  # no duplicate detection
        ) as pair,
    ):
        print(f"started the bundled pair: {pair.stomp_url.replace('example:example@', '')}")
        yield f"{pair.stomp_url}?{OPTIONS}"


def consume(url: str) -> list[str]:
    with hafailover.connect(url) as connection:
        consumer = connection.create_session().create_consumer("queue://example.kept")
        connection.start()
        got = []
        while (message := consumer.receive(timeout=1.5)) is not None:
            got.append(message.text)
        dropped = consumer.duplicates_dropped
    print(f"handed out {len(got)}: {', '.join(got)}; dropped {dropped} copies")
    return got


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp, broker_url(argv) as url:
        window = os.path.join(tmp, "window")
        kept = f"{url}{'&' if '?' in url else '?'}consumer_dedup=1000&consumer_dedup_file={window}"
        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer("queue://example.kept")
            for seq in range(10):
                producer.send(Message(f"order {seq}", message_id=f"order-{seq}"))
        first = consume(kept)
        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer("queue://example.kept")
            for seq in range(12):  # 0..9 again, then two new ones
                producer.send(Message(f"order {seq}", message_id=f"order-{seq}"))
        second = consume(kept)
        once = sorted(first + second) == sorted(f"order {n}" for n in range(12))
        print("each order handed out once" if once else "an order was handed out twice")
        return 0 if once else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
