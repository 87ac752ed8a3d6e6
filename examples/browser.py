"""A queue browser: look at the messages waiting on a queue without consuming them.

Run: python examples/browser.py [FAILOVER_URL]   (no URL: the bundled pair)

If the connection fails over while browsing, iteration raises BrowserInvalidatedError
(F11) rather than stop early as if the queue had ended: browse again.
"""

from __future__ import annotations

import sys

from _pair import failover_url

import hafailover
from hafailover import AckMode, BrowserInvalidatedError

QUEUE = "queue://example.browse"


def main(argv: list[str]) -> int:
    with failover_url(argv) as url, hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.AUTO)
        producer = session.create_producer(QUEUE)
        for seq in range(5):
            producer.send(f"item {seq}", headers={"seq": seq})

        try:
            seen = [message.text for message in session.create_browser(QUEUE)]
        except BrowserInvalidatedError:
            print("a failover cut the browse short: browse again")
            return 1
        print(f"browsed {len(seen)}: {', '.join(seen)}")

        consumer = session.create_consumer(QUEUE)
        connection.start()
        taken = 0
        while consumer.receive(timeout=2.0) is not None:
            taken += 1
        print(f"still there after browsing: consumed {taken}")
        return 0 if len(seen) == taken == 5 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
