"""examples/celery_tasks.py runs as a user would run it, while the live is SIGKILLed after
the tasks were sent: every result comes back."""

from __future__ import annotations

from pathlib import Path

import pytest

from reference_broker import BrokerPair
from tests.examples.test_examples import run_with_kill, url_of

pytestmark = pytest.mark.broker


def test_celery_example_through_a_kill(pair: BrokerPair, tmp_path: Path) -> None:
    code, output = run_with_kill(
        pair, "celery_tasks.py", [url_of(pair, "stomp")], kill_after="sent 20 tasks"
    )
    assert code == 0, output
    assert "results: [0, 10, 20," in output, output
