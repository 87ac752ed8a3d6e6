"""Suite-wide policy: in CI nothing may skip; one Hypothesis profile, chosen explicitly.

Tests that need a service (the bundled broker pair, RabbitMQ, Java, Spark) skip on a
developer's machine that lacks it, with the reason. In CI (CI=true) a missing service
is a failure, never a skip, so a green run means every test ran.

Hypothesis runs under a profile of ours, loaded here whatever the environment says:
left alone, Hypothesis loads its built-in ``ci`` profile when CI is set (deadlines off,
derandomized), so CI and a laptop would run different examples. The profile is named by
HAFAILOVER_HYPOTHESIS_PROFILE (``quick`` when unset; ``--hypothesis-profile`` on the
command line still wins). Every profile that draws at random draws from one seed per
run, printed in the report header, so any failure, in CI too, replays with
``pytest --hypothesis-seed=SEED <test id>``. See docs/testing.md.
"""

from __future__ import annotations

import functools
import os
import random
import re
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

IN_CI = os.environ.get("CI", "").lower() == "true"

PROFILE_VARIABLE = "HAFAILOVER_HYPOTHESIS_PROFILE"

# No profile has a deadline: none of our property tests measures speed (the core is pure,
# and a driver test waits on threads), so a deadline only turns a slow machine, a shrink
# or a busy CI runner into a failure that says nothing about the code. The too_slow
# health check is off for the same reason; the tests that are slow on purpose (driver
# tests running threads per example) set their own, smaller max_examples.
# Built on Hypothesis's "default" profile, not on whatever is loaded: with CI set, that is
# its "ci" profile, and its derandomize would leak into ours.
_COMMON = settings(
    settings.get_profile("default"),
    derandomize=False,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

# make test, CI: random, twice Hypothesis's default budget.
settings.register_profile("quick", _COMMON, max_examples=200)
# make test-deep: ten times that, and longer stateful runs.
settings.register_profile("deep", _COMMON, max_examples=2000, stateful_step_count=100)
# make mutate: a mutant's verdict must not depend on the draw, nor on examples a previous
# mutant saved, so the same examples every time and no example database.
settings.register_profile("mutate", _COMMON, max_examples=100, derandomize=True, database=None)

settings.load_profile(os.environ.get(PROFILE_VARIABLE, "quick"))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # One seed for the run, chosen here (before Hypothesis's plugin reads the option) so
    # the header can print it: a test's examples then depend on the seed alone, not on
    # which other tests ran before it.
    if config.getoption("hypothesis_seed", None) is None and not settings.default.derandomize:
        config.option.hypothesis_seed = str(random.SystemRandom().randrange(2**32))


def _hypothesis_line(config: pytest.Config) -> str:
    seed = config.getoption("hypothesis_seed", None)
    if settings.default.derandomize:
        replay = "derandomized"
    else:
        replay = f"seed {seed}, replay a failure with --hypothesis-seed={seed}"
    return f"hypothesis: profile {settings.get_current_profile_name()!r}, {replay}"


def pytest_report_header(config: pytest.Config) -> str:
    return _hypothesis_line(config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # Again at the end, where -q (which hides the header) still shows it.
    terminalreporter.write_line(_hypothesis_line(terminalreporter.config))


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


# make test runs the suite on pytest-xdist workers (--dist loadgroup), with the work units
# chosen here rather than by xdist_group marks (which pytest 9 no longer carries to xdist's
# scheduler). Tests that share one machine-wide service run on one worker, one after
# another: the RabbitMQ node and the three-node cluster (fixed ports, started once per
# worker session) and Spark (a JVM per session, heavy enough that two would starve the
# timing of everything else). A module that defines a module- or class-scoped fixture
# stays together, so the fixture is built once. Every other test is a unit of its own.
# xdist starts the units with the most tests first, so the shared groups never become the
# run's tail.
_SHARED_GROUPS = {
    "tests/interop/": "rabbitmq",
    "tests/cluster/": "rabbitmq",
    "tests/spark/": "spark",
}
_SHARED_SCOPE = re.compile(r"""scope\s*=\s*["'](?:module|class|package)["']""")


_IMPORTED_TESTS = re.compile(r"^from (tests(?:\.\w+)+|\.\w+) import", re.MULTILINE)


@functools.cache
def _keeps_together(path: str) -> bool:
    """Does the test module (or a conftest.py beside it or above, or a test module it
    imports fixtures from) define a fixture that outlives one test?"""
    root = Path(__file__).resolve().parent.parent
    module = root / path
    files = [module]
    folder = module.parent
    while folder != root and root in folder.parents:
        files.append(folder / "conftest.py")
        folder = folder.parent
    files.extend(
        (
            module.parent / name[1:] if name.startswith(".") else root.joinpath(*name.split("."))
        ).with_suffix(".py")
        for name in _IMPORTED_TESTS.findall(module.read_text())
    )
    return any(f.is_file() and _SHARED_SCOPE.search(f.read_text()) for f in files)


@functools.cache
def _work_unit_of_module(path: str) -> str | None:
    for prefix, group in _SHARED_GROUPS.items():
        if path.startswith(prefix):
            return group
    text = (Path(__file__).resolve().parent.parent / path).read_text()
    if "tests.interop.conftest import" in text or "tests.cluster.conftest import" in text:
        return "rabbitmq"  # a test elsewhere that borrows the RabbitMQ fixtures
    return path if _keeps_together(path) else None


def _work_unit(nodeid: str) -> str:
    return _work_unit_of_module(nodeid.split("::", 1)[0]) or nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None  # xdist's own
    from xdist.scheduler import LoadGroupScheduling

    class Units(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return Units(config, log)
