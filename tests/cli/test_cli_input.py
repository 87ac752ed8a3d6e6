"""Bad input to the client commands: exit status 2 and a message naming the option, before
any connection is tried (no broker runs here)."""

from __future__ import annotations

import pytest

from hafailover.cli import main

URL = "stomp://127.0.0.1:1"  # never reached: every case fails before connecting


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["producer", "--url", URL, "--count", "0"], "--count"),
        (["producer", "--url", URL, "--count", "many"], "--count"),
        (["producer", "--url", URL, "--message-size", "-1"], "--message-size"),
        (["producer", "--url", URL, "--ack-mode", "sometimes"], "--ack-mode"),
        (["producer", "--url", URL, "--tx-batch", "5", "--ack-mode", "auto"], "--tx-batch"),
        (["producer", "--url", URL, "--pipeline", "0"], "--pipeline"),
        (["producer", "--url", "stomp://h?colour=red"], "--url"),
        (["producer", "--url", "failover:(stomp://a,amqp://b)"], "--url"),
        (["producer", "--url", URL, "--destination", "/queue/"], "--destination"),
        (["producer", "--destination", "queue://x"], "--url"),
        (["producer", "--url", URL, "--record", "/nonexistent/dir/r.jsonl"], "--record"),
        (["consumer", "--url", URL, "--count", "5", "--idle-timeout", "1"], "--idle-timeout"),
        (["consumer", "--url", URL, "--idle-timeout", "soon"], "--idle-timeout"),
        (["consumer", "--url", URL, "--batch", "0"], "--batch"),
        (["consumer", "--url", URL, "--prefetch", "-3"], "--prefetch"),
        (["browser", "--url", URL, "--destination", "topic://prices"], "--destination"),
        (["perf", "producer", "--url", URL, "--count", "5", "--duration", "2"], "--duration"),
        (["perf", "consumer", "--url", URL, "--duration", "-1"], "--duration"),
        (["perf", "sideways", "--url", URL], "perf"),
    ],
)
def test_bad_input_exits_2_naming_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err, err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["producer", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--tx-batch" in out and "--record" in out


def test_no_broker_is_a_failed_run_not_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["producer", "--url", URL, "--count", "1", "--json"]) == 1
    out = capsys.readouterr().out
    assert '"attempted": 0' in out and "NotConnectedError" in out
