"""The failover report folds each session's part into what the application reads."""

from __future__ import annotations

from hafailover.core.report import FailoverReport, SessionFailover
from hafailover.errors import ErrorCode


def test_report_totals_and_summary() -> None:
    report = FailoverReport(
        code=ErrorCode.FAILOVER,
        reason="connection reset",
        from_broker="stomp://live:61613",
        to_broker="stomp://backup:61613",
        attempts=2,
        duration=0.5,
        sessions=(
            SessionFailover(1, replayed=(4, 5), in_doubt=("m9",)),
            SessionFailover(2, resent=("m1", "m2"), stale_acks=("d1",), rolled_back=True),
        ),
        degraded=("reattach",),
    )
    assert report.replayed == 2
    assert report.resent == ("m1", "m2")
    assert report.in_doubt == ("m9",)
    assert report.stale_acks == ("d1",)
    assert report.transactions_rolled_back == (2,)
    line = report.summary()
    assert "reconnected stomp://live:61613 -> stomp://backup:61613" in line
    assert "transactions rolled back 1" in line and "broker lacks reattach" in line


def test_disconnect_summary() -> None:
    report = FailoverReport(
        code=ErrorCode.DISCONNECT, reason="refused", from_broker="amqp://a:5672", attempts=3
    )
    assert report.summary().startswith("failover failed after 3 attempt(s)")
