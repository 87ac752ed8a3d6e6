"""Suite-wide policy: in CI nothing may skip.

Tests that need a service (the bundled broker pair, RabbitMQ, Java, Spark) skip on a
developer's machine that lacks it, with the reason. In CI (CI=true) a missing service
is a failure, never a skip, so a green run means every test ran.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test must run: {reason}"
