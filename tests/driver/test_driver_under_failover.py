"""A stateful test of the whole driver against the scripted broker: API calls on several
sessions interleaved with losses noticed by the reader, by a write on the application's
thread, by a heartbeat or by several at once, answered by reattach, by a new session, or
after refused attempts.

Invariants: no call waits past the failover plus its timeout; every confirmed send is on
the broker once (duplicate detection is on) and every send given up is reported in doubt;
no acknowledge names a delivery of another connection; the reports and the exception
listener match the failovers that happened.
"""

from __future__ import annotations

import contextlib
import time

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hafailover
from hafailover import (
    AckMode,
    FailoverNotice,
    HaFailoverError,
    SendCompletion,
    StaleAcknowledgeError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)

from .fake import FakeBroker, link_factory
from .test_failover_driver import Heard, url, wait_until

NOTICES = st.sampled_from(
    [("reader",), ("heartbeat",), ("writer",), ("reader", "heartbeat"), ("writer", "reader")]
)
ANSWERS = st.sampled_from(
    [
        ["reattach"],
        ["fresh"],
        ["refuse", "reattach"],
        ["refuse", "fresh"],
        # Issue 17: an attempt's link reported lost before it is the connection's.
        ["refuse", "reattach, then reported lost", "reattach"],
        ["fresh, then reported lost", "fresh"],
        ["illegal", "reattach"],
    ]
)


class DriverUnderFailover(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.broker = FakeBroker()
        self.broker.start()
        self.heard = Heard()
        self.connection = hafailover.connect(
            url(), exception_listener=self.heard, link_factory=link_factory(self.broker)
        )
        connection = self.connection
        self.producers = [
            connection.create_session().create_producer("queue://orders") for _ in range(2)
        ]
        self.transacted = connection.create_session(AckMode.SESSION_TRANSACTED)
        self.tx_producer = self.transacted.create_producer("queue://orders")
        self.client = connection.create_session(AckMode.CLIENT)
        self.consumer = self.client.create_consumer("queue://work")
        connection.start()
        self.sends: list[SendCompletion] = []
        self.committed: list[str] = []  # ids of messages in transactions that committed
        self.maybe_committed: list[str] = []
        self.failovers = 0
        self.work = 0
        # Non-persistent sends: no duplicate id, never confirmed, so never sent twice.
        self.unstamped: list[SendCompletion] = []
        # CLIENT (F8): ids received since the last acknowledge, and ids whose acknowledge
        # the broker confirmed: those must never be delivered again.
        self.held: list[str] = []
        self.acknowledged: set[str] = set()

    def teardown(self) -> None:
        try:
            self.settle()
            self.check_sends()
        finally:
            self.connection.close()
            self.broker.stop()

    def settle(self) -> None:
        """Wait until the connection is up and every send has its answer (bounded)."""
        wait_until(lambda: self.connection.broker is not None, "the connection", 10)
        for completion in self.sends:
            with contextlib.suppress(HaFailoverError):
                completion.result(5)
        # What was written last (non-persistent sends complete as written) is read too.
        wait_until(lambda: not self.broker.current().wire, "the broker to read the wire", 5)

    # --- API calls ----------------------------------------------------------------------

    @rule(which=st.integers(0, 1), count=st.integers(1, 5))
    def send_async(self, which: int, count: int) -> None:
        for _ in range(count):
            self.sends.append(self.producers[which].send_async("order"))

    @rule(count=st.integers(1, 3))
    def send_non_persistent(self, count: int) -> None:
        """F5: non-persistent sends carry no duplicate id; a failover may lose them (in
        doubt) but must never send one twice."""
        for _ in range(count):
            self.unstamped.append(self.producers[1].send_async("quote", persistent=False))

    @rule(count=st.integers(1, 3))
    def commit(self, count: int) -> None:
        batch = [hafailover.Message(body="tx") for _ in range(count)]
        for _ in range(3):
            for message in batch:
                self.tx_producer.send(message)  # the same objects keep their ids (F13)
            try:
                self.transacted.commit()
            except TransactionRolledBackError:
                continue  # F9: replay the batch
            except TransactionOutcomeUnknownError:
                self.maybe_committed.extend(m.message_id or "" for m in batch)
                continue  # sent again with the same ids: at most once on the broker
            self.committed.extend(self._ids(batch))
            return
        raise AssertionError("a transaction never committed in three tries")

    @staticmethod
    def _ids(batch: list[hafailover.Message]) -> list[str]:
        from hafailover.driver.producer import sent_id

        return [sent_id(message) for message in batch]

    @rule(count=st.integers(1, 3))
    def queue_work(self, count: int) -> None:
        for _ in range(count):
            self.producers[0].send("work", destination="queue://work")
        self.work += count

    @precondition(lambda self: self.work > 0)
    @rule()
    def receive_and_acknowledge(self) -> None:
        message = self.consumer.receive(0.2)
        if message is None:
            return
        message_id = message.message_id or ""
        assert message_id not in self.acknowledged, (
            f"{message_id} came again after the broker confirmed its acknowledge"
        )
        self.held.append(message_id)
        try:
            message.acknowledge()
        except StaleAcknowledgeError:
            self.held.clear()  # F8: the session recovered; they come again
            return
        except HaFailoverError:
            self.held.clear()  # not confirmed: it may come again
            return
        # CLIENT acknowledges everything the session delivered so far, confirmed.
        self.acknowledged.update(self.held)
        self.held.clear()

    @rule()
    def recover(self) -> None:
        self.client.recover()
        self.held.clear()

    # --- failures -------------------------------------------------------------------------

    @rule(noticed_by=NOTICES, answers=ANSWERS)
    def lose_the_connection(self, noticed_by: tuple[str, ...], answers: list[str]) -> None:
        broker = self.broker
        with broker.paused():
            broker.answers.extend(answers)
            for thread in broker.current().lose(noticed_by=noticed_by):
                thread.join(5)
            if noticed_by == ("writer",):
                # Nobody noticed yet: the application's next write does.
                self.sends.append(self.producers[1].send_async("notices the loss"))
        self.failovers += 1
        wait_until(
            lambda: (
                self.connection.statistics().failovers == self.failovers
                and self.connection.broker is not None
            ),
            "the failover",
            10,
        )

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def acknowledges_name_only_this_connections_deliveries(self) -> None:
        assert self.broker.violations == []

    @invariant()
    def one_report_and_one_notice_per_failover(self) -> None:
        reports = self.connection.reports
        assert len(reports) == self.failovers
        wait_until(lambda: len(self.heard.errors) == self.failovers, "the listener", 5)
        assert all(isinstance(e, FailoverNotice) for e in self.heard.errors)
        assert [e.reattached for e in self.heard.errors] == [r.reattached for r in reports]

    def check_sends(self) -> None:
        in_doubt = {m for report in self.connection.reports for m in report.in_doubt}
        stored = self.broker.stored_ids
        for completion in self.sends:
            assert completion.done(), "a send still waits after the failover and its timeout"
            assert completion.message is not None
            message_id = completion.message.message_id or ""
            error = completion.exception()
            if error is None:
                assert stored[message_id] == 1, f"confirmed send {message_id} not stored once"
            else:
                assert isinstance(error, UnblockedError), error
                assert message_id in in_doubt, f"{message_id} given up but not reported"
                assert stored[message_id] <= 1
        arrived = self.broker.arrived_ids
        for completion in self.unstamped:
            assert completion.message is not None
            message_id = completion.message.message_id or ""
            # Lost with a reconnected session, as documented (F5), or stored once.
            assert arrived[message_id] <= 1, f"non-persistent {message_id} was sent twice"
        for message_id in self.committed:
            assert stored[message_id] == 1, f"committed {message_id} not stored once"
        for message_id in self.maybe_committed:
            assert stored[message_id] <= 1


DriverUnderFailover.TestCase.settings = settings(
    max_examples=25, stateful_step_count=12, deadline=None
)
test_driver_under_failover = DriverUnderFailover.TestCase


def test_the_state_machine_runs_quickly() -> None:
    """The stateful test belongs in every run: it must stay in seconds."""
    started = time.monotonic()
    state = DriverUnderFailover()
    state.send_async(0, 3)
    state.lose_the_connection(("writer",), ["fresh"])
    state.commit(2)
    state.teardown()
    assert time.monotonic() - started < 10
