"""Fixtures of the Celery and kombu tests: the bundled pair, both protocols, kombu URLs.

kombu and celery come with the dev install (the celery extra): a missing one fails these
tests at import, never skips them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reference_broker import BrokerPair
from tests.integration.support import url_for


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[BrokerPair]:
    """A fresh pair, for the tests that kill a node."""
    with BrokerPair(tmp_path / "pair", user="app", password="secret") as started:
        started.wait_synchronized(30)
        yield started


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerPair]:
    """One pair for a module's tests that leave both nodes alone (each uses its own queues)."""
    with BrokerPair(tmp_path_factory.mktemp("pair"), user="app", password="secret") as started:
        started.wait_synchronized(30)
        yield started


def kombu_url(pair: BrokerPair, protocol: str, **options: object) -> str:
    """A broker_url that selects the transport: ``hafailover+`` and a hafailover URL."""
    return "hafailover+" + url_for(pair, protocol, **options)


@pytest.fixture
def name() -> str:
    """A queue or exchange name of this test alone."""
    return f"t-{uuid.uuid4().hex[:12]}"
