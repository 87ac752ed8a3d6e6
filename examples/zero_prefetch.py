"""Zero prefetch on AMQP: a consumer that holds nothing it did not ask for.

Run: python examples/zero_prefetch.py ['failover:(amqp://h1:5672,amqp://h2:5672)?...']
(no URL: the bundled pair is started). Two consumers share a queue; one never receives.
With prefetch=0 it holds no message, so the other gets all ten; a receive that times out
leaves no credit behind.
"""

from __future__ import annotations

import sys

from _pair import failover_url

import hafailover


def main(argv: list[str]) -> int:
    with failover_url(argv, "amqp") as url, hafailover.connect(url) as connection:
        session = connection.create_session()
        idle = session.create_consumer("queue://example.pull", prefetch=0)
        busy = session.create_consumer("queue://example.pull", prefetch=0)
        connection.start()
        print(f"idle consumer, receive(0.2) on an empty queue: {idle.receive(0.2)}")
        producer = session.create_producer("queue://example.pull")
        for seq in range(10):
            producer.send(f"job {seq}", headers={"seq": seq})
        got = []
        while (message := busy.receive(timeout=2.0)) is not None:
            got.append(message.text)
        print(f"busy consumer received {len(got)} of 10; the idle one held none")
        return 0 if len(got) == 10 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
