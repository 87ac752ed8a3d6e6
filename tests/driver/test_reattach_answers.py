"""A server whose reattach answer cannot be reconciled with the confirmation window.

A reattach names the last command the server received. When it claims fewer commands
than it had confirmed, or more than were ever sent, the client cannot know what to replay:
the core plans a reconnect instead (the server's session is ended, a new one is made,
F5), and the connection goes on. Before, this raised IllegalStateError inside the attempt,
which the reconnect schedule never retries: one odd answer ended the connection for good.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

import hafailover
from hafailover import FailoverNotice
from hafailover.core.window import ConfirmationWindow
from hafailover.protocols.base import LinkEvents, Opened
from hafailover.url import BrokerAddress, FailoverPolicy

from .fake import FakeBroker, FakeLink
from .test_failover_driver import Heard, failed_over, url, wait_until

pytestmark = pytest.mark.timeout(30)


class OddReattach(FakeLink):
    """Answers the first reattach with a last-received id that ``skew`` moves."""

    skew: Callable[[int, ConfirmationWindow[Any]], int] = staticmethod(lambda last, window: last)
    skewed: list[int] = []  # noqa: RUF012 - one list per test, set by the fixture

    def open(self, broker: BrokerAddress, *, resume: str | None) -> Opened:
        opened = super().open(broker, resume=resume)
        if opened.resumed and not self.skewed:
            odd = self.skew(opened.last_received, self.window)
            self.skewed.append(odd)
            return attrs.evolve(opened, last_received=odd)
        return opened


def factory(
    broker: FakeBroker, skew: Callable[[int, ConfirmationWindow[Any]], int]
) -> tuple[Callable[..., FakeLink], list[int]]:
    class Link(OddReattach):
        pass

    Link.skew = staticmethod(skew)  # type: ignore[method-assign]
    Link.skewed = []

    def make(events: LinkEvents, policy: FailoverPolicy, window: ConfirmationWindow[Any]) -> Any:
        return Link(broker, events, policy, window)

    return make, Link.skewed


@pytest.mark.parametrize(
    "skew",
    [
        pytest.param(lambda last, window: window.next_id + 3, id="more-than-were-sent"),
        pytest.param(lambda last, window: window.last_confirmed - 2, id="fewer-than-confirmed"),
    ],
)
def test_an_inconsistent_reattach_answer_reconnects_and_the_connection_goes_on(
    broker: FakeBroker, skew: Callable[[int, ConfirmationWindow[Any]], int]
) -> None:
    heard = Heard()
    make, skewed = factory(broker, skew)
    with hafailover.connect(
        url(reconnect_attempts=-1), exception_listener=heard, link_factory=make
    ) as connection:
        producer = connection.create_session().create_producer("queue://orders")
        for n in range(5):
            producer.send(f"before {n}")  # confirmed: the window has a confirmed id
        with broker.paused():
            broker.answers.append("reattach")
            for thread in broker.current().lose(noticed_by=("reader",)):
                thread.join(5)
        wait_until(failed_over(connection), "the failover")
        producer.send("after")
        assert len(skewed) == 1, "the broker gave one odd reattach answer"
        report = connection.reports[-1]
        assert not report.reattached, "an answer that cannot be reconciled must reconnect"
        wait_until(lambda: len(heard.errors) == 1, "the listener")
        assert isinstance(heard.errors[0], FailoverNotice)
        assert [m.body for m in broker.stored("orders")][-1] == "after"
        assert connection.state == "reconnected"
