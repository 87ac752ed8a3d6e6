"""Parse a failover URL and show the reconnect attempts it implies.

Run: python examples/failover_url.py ["failover:(stomp://h1:61613,stomp://h2:61613)?..."]
"""

from __future__ import annotations

import sys

from hafailover import InvalidURLError, parse_url
from hafailover.core.schedule import ReconnectSchedule


def main(argv: list[str]) -> int:
    url = (
        argv[1]
        if len(argv) > 1
        else (
            "failover:(stomp://live:61613,stomp://backup:61613)"
            "?retry_interval=100ms&retry_interval_multiplier=2&max_retry_interval=1s&retry_jitter=0"
        )
    )
    try:
        policy = parse_url(url)
    except InvalidURLError as exc:
        print(f"bad URL: {exc} [option: {exc.option}]")
        return 2
    print(f"normalized: {policy.redacted()}")
    print(f"protocol:   {policy.protocol.value}, reattach: {policy.reattach_enabled}")
    for attempt in ReconnectSchedule(policy).plan(initial=False, limit=6):
        print(f"attempt {attempt.number}: {attempt.broker.redacted()} after {attempt.delay:.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
