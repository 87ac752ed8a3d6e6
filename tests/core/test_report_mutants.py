"""The failover report's log line, which mutation testing found unguarded (docs/testing.md)."""

from __future__ import annotations

from hafailover.core.report import FailoverReport
from hafailover.errors import ErrorCode


def test_the_summary_of_a_reattach_reads_as_one_line() -> None:
    report = FailoverReport(
        code=ErrorCode.FAILOVER,
        reason="reset",
        from_broker="stomp://live:61613",
        to_broker="stomp://backup:61613",
        reattached=True,
        attempts=2,
        duration=1.5,
        degraded=("duplicate detection", "reattach"),
    )
    assert report.summary() == (
        "failover reattached stomp://live:61613 -> stomp://backup:61613 in 1.500s "
        "(2 attempt(s)); replayed 0; resent 0; in doubt 0; stale acks 0; "
        "transactions rolled back 0; broker lacks duplicate detection, reattach"
    )


def test_the_summary_says_reconnected_when_the_session_was_recreated() -> None:
    report = FailoverReport(code=ErrorCode.FAILOVER, reason="reset", from_broker="a", to_broker="b")
    assert report.summary().startswith("failover reconnected a -> b ")


def test_the_summary_of_a_failback_says_so() -> None:
    # A priority failback is a move on purpose: the log line must not read as a failure.
    report = FailoverReport(
        code=ErrorCode.FAILOVER,
        reason="preferred broker is back",
        from_broker="a",
        to_broker="b",
        reattached=False,
        failback=True,
    )
    assert report.summary().startswith("failover failback reconnected a -> b in 0.000s ")
