"""The exception listener: told once per connection failure (F10), on its own thread.

Run: python examples/exception_listener.py [FAILOVER_URL] [SECONDS]
(no URL: the bundled pair). Kill the live broker while it runs: the listener hears a
FailoverNotice (code FAILOVER) with the failover report, and the sends go on; if failover
gives up it hears a DisconnectedError (code DISCONNECT) instead.
"""

from __future__ import annotations

import sys
import time

from _pair import failover_url

import hafailover
from hafailover import FailoverCompleted, FailoverNotice, HaFailoverError


def on_exception(error: HaFailoverError) -> None:
    if isinstance(error, FailoverNotice):
        how = "reattached" if error.reattached else "reconnected"
        print(f"exception listener: {error.code.value} ({how})", flush=True)
    else:
        print(f"exception listener: {error.code.value}: {error}", flush=True)


def main(argv: list[str]) -> int:
    seconds = float(argv[2]) if len(argv) > 2 else 3.0
    with failover_url(argv) as url, hafailover.connect(url, exception_listener=on_exception) as c:
        c.add_event_listener(
            lambda event: (
                isinstance(event, FailoverCompleted)
                and print(f"event: {event.report.summary()}", flush=True)
            )
        )
        producer = c.create_session().create_producer("queue://example.events")
        sent = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            producer.send(f"tick {sent}", headers={"seq": sent})  # waits through failover
            sent += 1
            if sent % 50 == 0:
                print(f"sent {sent} (broker {c.broker})", flush=True)
            time.sleep(0.005)
        time.sleep(0.2)  # let the notifier thread finish printing
        print(f"sent {sent} confirmed, {c.statistics().failovers} failover(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
