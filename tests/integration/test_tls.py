"""TLS end to end, both protocols: the bundled pair's TLS listeners, a client that verifies
the broker's certificate and host name by default, mutual TLS, a refusal that names its
reason, and a failover between two TLS nodes under SIGKILL with nothing lost."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

import hafailover
from hafailover import InvalidURLError, SecurityError
from reference_broker import BrokerPair
from reference_broker.tls import TlsFiles, make_certificates

from .support import drain, seqs, url_for

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def strangers(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """Certificates of another CA, which the pair's certificates mean nothing to."""
    return make_certificates(tmp_path_factory.mktemp("other"), name="other")


@pytest.fixture(scope="module")
def tls_pair(
    tmp_path_factory: pytest.TempPathFactory, certificates: TlsFiles
) -> Iterator[BrokerPair]:
    directory = tmp_path_factory.mktemp("tls-pair") / "pair"
    with BrokerPair(directory, user="app", password="secret", tls=certificates) as pair:
        pair.wait_synchronized(30)
        yield pair


def single(pair: BrokerPair, protocol: str, **options: str) -> str:
    scheme = "stomp+ssl" if protocol == "stomp" else "amqps"
    live = pair.live
    port = live.stomp_port if protocol == "stomp" else live.amqp_port
    query = "&".join(f"{k}={v}" for k, v in options.items())
    return f"{scheme}://app:secret@{pair.client_host}:{port}?{query}"


def round_trip(url: str, queue: str, count: int = 5) -> list[int]:
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer(queue)
        for n in range(count):
            producer.send("over tls", headers={"seq": n})
    return seqs(drain(url, queue))


def test_pair_urls_speak_tls(tls_pair: BrokerPair) -> None:
    assert tls_pair.stomp_url.startswith("failover:(stomp+ssl://")
    assert tls_pair.amqp_url.startswith("failover:(amqps://")
    assert "ssl_ca_file=" in tls_pair.stomp_url


def test_connect_send_and_receive_over_tls(tls_pair: BrokerPair, protocol: str) -> None:
    url = url_for(tls_pair, protocol)
    assert sorted(round_trip(url, f"queue://tls-{protocol}")) == list(range(5))


def test_a_broker_a_foreign_ca_signed_is_refused_naming_why(
    tls_pair: BrokerPair, protocol: str, strangers: TlsFiles
) -> None:
    url = single(tls_pair, protocol, ssl_ca_file=str(strangers.ca), reconnect_attempts="3")
    with pytest.raises(SecurityError, match=r"(?i)certificate verify failed|unable to get local"):
        hafailover.connect(url)


def test_a_host_name_the_certificate_does_not_name_is_refused(
    tmp_path: Path, protocol: str
) -> None:
    misnamed = make_certificates(tmp_path / "certs", hosts=("broker.example",))
    with BrokerPair(tmp_path / "pair", user="app", password="secret", tls=misnamed,
                    start_backup=False) as pair:  # fmt: skip
        url = single(pair, protocol, ssl_ca_file=str(misnamed.ca))
        refused = r"(?i)certificate verify failed|mismatch|not valid for"
        with pytest.raises(SecurityError, match=refused):
            hafailover.connect(url)
        # The explicit opt-out connects, and says it did not verify.
        caplog_records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = caplog_records.append  # type: ignore[method-assign]
        logging.getLogger("hafailover").addHandler(handler)
        try:
            insecure = single(pair, protocol, ssl_ca_file=str(misnamed.ca), ssl_verify="false")
            assert sorted(round_trip(insecure, f"queue://insecure-{protocol}", 2)) == [0, 1]
        finally:
            logging.getLogger("hafailover").removeHandler(handler)
        assert any("not verified" in r.getMessage() for r in caplog_records)


def test_mutual_tls_admits_the_client_certificate_and_refuses_none(
    tmp_path: Path, protocol: str, certificates: TlsFiles
) -> None:
    with BrokerPair(tmp_path / "pair", user="app", password="secret", tls=certificates,
                    tls_client_auth=True, start_backup=False) as pair:  # fmt: skip
        assert "ssl_cert_file=" in pair.stomp_url
        assert sorted(round_trip(url_for(pair, protocol), f"queue://mtls-{protocol}", 3)) == [
            0,
            1,
            2,
        ]
        anonymous = single(pair, protocol, ssl_ca_file=str(certificates.ca))
        with pytest.raises((SecurityError, hafailover.NotConnectedError)):
            hafailover.connect(anonymous)


def test_failover_between_two_tls_nodes_loses_nothing(
    tmp_path: Path, protocol: str, certificates: TlsFiles
) -> None:
    with BrokerPair(tmp_path / "pair", user="app", password="secret", tls=certificates) as pair:
        pair.wait_synchronized(30)
        url = url_for(pair, protocol, reconnect_attempts=-1)
        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer("queue://tls-failover")
            for n in range(100):
                producer.send("x", headers={"seq": n})
                if n == 40:
                    pair.kill(pair.live)
            assert connection.statistics().failovers == 1
        assert sorted(seqs(drain(url, "queue://tls-failover"))) == list(range(100))


def test_tls_options_are_checked_when_the_url_is_read(
    tmp_path: Path, certificates: TlsFiles
) -> None:
    with pytest.raises(InvalidURLError, match="ssl_ca_file"):
        hafailover.parse_url(f"stomp+ssl://h:1?ssl_ca_file={tmp_path / 'missing.pem'}")
    with pytest.raises(InvalidURLError, match="ssl_key_file is missing"):
        hafailover.parse_url(f"amqps://h:1?ssl_cert_file={certificates.client_cert}")
    with pytest.raises(InvalidURLError, match="for TLS brokers"):
        hafailover.parse_url(f"stomp://h:1?ssl_ca_file={certificates.ca}")
    with pytest.raises(InvalidURLError, match="ssl_verify"):
        hafailover.parse_url("amqps://h:1?ssl_verify=maybe")
