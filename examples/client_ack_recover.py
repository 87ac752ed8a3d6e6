"""CLIENT_ACKNOWLEDGE through a failover: a stale acknowledge, recover(), redelivery.

Run: python examples/client_ack_recover.py [FAILOVER_URL] [COUNT]
(no URL: the bundled pair). Kill the live broker while it runs to see the recovery.

A session that holds unacknowledged messages when the connection fails over is dirty (F8):
the broker will deliver those messages again, so the next acknowledge() raises
StaleAcknowledgeError (after recovering the session). The application drops the work it
did on them and goes on; the messages come again, marked redelivered.
"""

from __future__ import annotations

import sys
import time

from _pair import failover_url

import hafailover
from hafailover import AckMode, StaleAcknowledgeError

QUEUE = "queue://example.work"
BATCH = 5


def main(argv: list[str]) -> int:
    count = int(argv[2]) if len(argv) > 2 else 60
    with failover_url(argv) as url, hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer(QUEUE)
        for seq in range(count):
            producer.send(f"job {seq}", headers={"seq": seq})
        print(f"queued {count} jobs", flush=True)

        session = connection.create_session(AckMode.CLIENT)
        consumer = session.create_consumer(QUEUE, prefetch=10)
        connection.start()
        done: set[int] = set()
        batch: list[int] = []
        stale = redelivered = 0
        while len(done) < count:
            message = consumer.receive(timeout=5.0)
            if message is None:
                break
            redelivered += message.redelivered
            batch.append(int(message.properties["seq"]))
            time.sleep(0.02)  # the work
            if len(batch) == BATCH:
                try:
                    session.acknowledge()
                except StaleAcknowledgeError:
                    stale += 1
                    print(f"  stale acknowledge: jobs {batch} will come again", flush=True)
                else:
                    done.update(batch)
                    print(f"acknowledged {len(done)}", flush=True)
                batch = []
        if batch:
            session.acknowledge()
            done.update(batch)
        session.recover()  # nothing unacknowledged is left; recover() is harmless here
        print(
            f"done {len(done)} of {count}; {stale} stale acknowledge(s), "
            f"{redelivered} redelivered, {connection.statistics().failovers} failover(s)"
        )
        return 0 if len(done) == count else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
