"""Every script in examples/ runs as a user would run it: as a process, given a failover URL
of a bundled pair; the ones about failover run while the live is SIGKILLed."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reference_broker.pair import BrokerPair
from tests.broker import SHARED_NODE_LEASE

ROOT = Path(__file__).resolve().parents[2]
# A heart-beat of 1 s: the kills here are SIGKILLs on loopback, noticed at once by the reset;
# with 250 ms (a 500 ms AMQP idle timeout) a full run once read no heart-beat from the new
# live in time, right after its takeover, and the client counted a second failover.
OPTIONS = "heartbeat=1s&retry_interval=50ms&max_retry_interval=500ms&initial_connect_attempts=5"


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def url_of(pair: BrokerPair, protocol: str) -> str:
    return f"{pair.stomp_url if protocol == 'stomp' else pair.amqp_url}?{OPTIONS}"


def run_with_kill(pair: BrokerPair, name: str, args: list[str], kill_after: str) -> tuple[int, str]:
    """Run an example; SIGKILL the live when a line containing ``kill_after`` appears."""
    process = subprocess.Popen(
        [sys.executable, "-u", str(ROOT / "examples" / name), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert process.stdout is not None
        killed = False
        deadline = time.monotonic() + 60
        for line in process.stdout:
            lines.append(line)
            if not killed and kill_after in line:
                pair.kill(pair.live)
                lines.append("--- live killed ---\n")
                killed = True
            assert time.monotonic() < deadline, "".join(lines)
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = "".join(lines)
    assert killed, output
    return process.returncode, output


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerPair]:
    """One pair for the examples that do not kill anything: its live holds the long lease
    of the shared nodes (a loaded machine once starved the default one: the live fenced
    itself, and an example's connect was refused)."""
    with BrokerPair(
        tmp_path_factory.mktemp("pair"), user="ex", password="ex", lease=SHARED_NODE_LEASE
    ) as pair:
        yield pair


@pytest.fixture
def fresh_pair(tmp_path: Path) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path / "pair", user="ex", password="ex") as pair:
        yield pair


# --- no broker --------------------------------------------------------------------------


def test_failover_url_example() -> None:
    result = run_example("failover_url.py")
    assert result.returncode == 0, result.stderr
    assert "attempt 1: stomp://live:61613 after 0.000s" in result.stdout
    assert "attempt 2: stomp://backup:61613 after 0.100s" in result.stdout
    assert "attempt 4: stomp://backup:61613 after 0.400s" in result.stdout


def test_failover_url_example_rejects_bad_input() -> None:
    result = run_example("failover_url.py", "failover:(stomp://a,amqp://b)")
    assert result.returncode == 2
    assert "mixes protocols" in result.stdout and "[option: brokers]" in result.stdout


# --- against a pair -----------------------------------------------------------------------


@pytest.mark.broker
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "protocol"), [("stomp_basic.py", "stomp"), ("amqp_basic.py", "amqp")]
)
def test_basic_producer_consumer(pair: BrokerPair, name: str, protocol: str) -> None:
    result = run_example(name, url_of(pair, protocol))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sent 10" in result.stdout and "received 10: hello 0 .. hello 9" in result.stdout


@pytest.mark.broker
@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_browser(pair: BrokerPair, protocol: str) -> None:
    result = run_example("browser.py", url_of(pair, protocol))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "browsed 5: item 0, item 1, item 2, item 3, item 4" in result.stdout
    assert "consumed 5" in result.stdout


@pytest.mark.broker
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "protocol",
    ["stomp", "amqp"],
)
def test_request_reply_over_a_temporary_queue(pair: BrokerPair, protocol: str) -> None:
    result = run_example("request_reply.py", url_of(pair, protocol))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ping -> PING (correlation id q0)" in result.stdout
    assert "version -> VERSION (correlation id q2)" in result.stdout


# --- with a SIGKILL of the live in the middle ---------------------------------------------


@pytest.mark.broker
@pytest.mark.timeout(90)
def test_transacted_retry_loop_through_sigkill(fresh_pair: BrokerPair) -> None:
    code, out = run_with_kill(
        fresh_pair, "transacted_retry.py", [url_of(fresh_pair, "stomp"), "12"], "batch 4 committed"
    )
    assert code == 0, out
    assert "batch 11 committed" in out
    assert "1 failover(s)); received 120: lost 0, duplicated 0" in out


@pytest.mark.broker
@pytest.mark.timeout(90)
def test_client_ack_recover_through_sigkill(fresh_pair: BrokerPair) -> None:
    code, out = run_with_kill(
        fresh_pair, "client_ack_recover.py", [url_of(fresh_pair, "stomp"), "60"], "acknowledged 20"
    )
    assert "1 failover(s)" in out, out
    assert code == 0, out
    assert "done 60 of 60" in out


@pytest.mark.broker
@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_exception_listener_hears_the_failover(fresh_pair: BrokerPair, protocol: str) -> None:
    code, out = run_with_kill(
        fresh_pair, "exception_listener.py", [url_of(fresh_pair, protocol), "2"], "sent 50 "
    )
    assert code == 0, out
    assert out.count("exception listener: FAILOVER") == 1, out
    assert "event: failover" in out
    assert "confirmed, 1 failover(s)" in out


@pytest.mark.broker
@pytest.mark.timeout(90)
def test_tracing_example_through_sigkill(fresh_pair: BrokerPair) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra and opentelemetry-sdk")
    code, out = run_with_kill(
        fresh_pair, "tracing.py", [url_of(fresh_pair, "stomp"), "2"], "sent 50 "
    )
    assert code == 0, out
    assert "child of its send span" in out and "without a send span" not in out, out
    assert out.count("failover span: reconnected") + out.count("failover span: reattached") == 2


@pytest.mark.broker
@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_asyncio_example_through_sigkill(fresh_pair: BrokerPair, protocol: str) -> None:
    code, out = run_with_kill(
        fresh_pair, "asyncio_app.py", [url_of(fresh_pair, protocol), "300"], "sent 100 "
    )
    assert code == 0, out
    assert "event: lost" in out and "event: failover" in out, out
    assert "received 300 of 300" in out, out


def test_examples_start_their_own_pair_without_a_url() -> None:
    result = run_example("stomp_basic.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "started the bundled pair" in result.stdout and "received 10" in result.stdout


# --- issue 21: zero prefetch, a kept duplicate window, priority failback ----------------------


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_zero_prefetch_example(pair: BrokerPair) -> None:
    result = run_example("zero_prefetch.py", url_of(pair, "amqp"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "receive(0.2) on an empty queue: None" in result.stdout
    assert "busy consumer received 10 of 10" in result.stdout


@pytest.mark.broker
@pytest.mark.timeout(90)
def test_dedup_file_example_drops_the_copies_after_a_restart() -> None:
    result = run_example("dedup_file.py")  # its own pair, without duplicate detection
    assert result.returncode == 0, result.stdout + result.stderr
    assert "handed out 2: order 10, order 11; dropped 10 copies" in result.stdout
    assert "each order handed out once" in result.stdout


@pytest.mark.broker
@pytest.mark.timeout(90)
def test_priority_failback_example_moves_back() -> None:
    result = run_example("priority_failback.py")  # two brokers of its own
    assert result.returncode == 0, result.stdout + result.stderr
    assert "failover: " in result.stdout and "failback: " in result.stdout


@pytest.mark.parametrize(("protocol", "action"), [("amqp", "add"), ("stomp", "replace")])
def test_announced_list_example_fails_over_to_a_broker_the_url_never_named(
    protocol: str, action: str
) -> None:
    result = run_example("announced_list.py", protocol, action)  # a pair of its own
    assert result.returncode == 0, result.stdout + result.stderr
    assert "which the broker announced" in result.stdout
    assert "received 10 of 10 on the backup" in result.stdout


def test_announced_list_example_refuses_a_bad_argument() -> None:
    result = run_example("announced_list.py", "amqp", "sometimes")
    assert result.returncode == 2 and "usage:" in result.stderr
