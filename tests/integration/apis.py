"""The same failover tests through both public APIs: threaded, and hafailover.aio.

The ``api`` fixture is parametrized. ``api.connect`` is ``hafailover.connect`` for the
threaded API; for the async one it makes an ``aio.AsyncConnection`` on an event loop of its
own thread and returns a blocking view of it: every method call is run on that loop (a
coroutine awaited there, a plain method called there) and waited for by the calling test
thread, so a test written against the threaded API drives the async one, call for call,
while the loop itself never blocks. Messages are the same objects in both APIs.

Where the two APIs differ by design, the view translates: ``send_async`` is ``send_nowait``
(its awaitable seen as a completion), ``receive_no_wait`` is ``receive(0)``, a browser or a
transaction block is iterated by stepping its async iterator, and a transaction attempt's
``with`` is its ``async with``. A message's ``acknowledge()`` is the message's own (the
same object in both APIs), called on the test's thread.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import hafailover
from hafailover import aio

_WRAPPED = (
    aio.AsyncConnection,
    aio.AsyncSession,
    aio.AsyncProducer,
    aio.AsyncConsumer,
    aio.AsyncBrowser,
    aio.AsyncTransactionBlock,
    aio.AsyncTransactionAttempt,
)
_RENAMED = {"send_async": "send_nowait"}


class LoopThread:
    """An event loop running on a thread of its own, for the length of a test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="aio-test-loop")
        self._thread.start()

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function`` on the loop (awaited if it is a coroutine function); wait here."""

        async def call() -> Any:
            result = function(*args, **kwargs)
            if inspect.isawaitable(result) and not isinstance(result, aio.PendingSend):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def _view(value: Any, loop: LoopThread) -> Any:
    if isinstance(value, aio.PendingSend):
        return PendingView(value, loop)
    if isinstance(value, _WRAPPED):
        return BlockingView(value, loop)
    return value


class BlockingView:
    """An aio object, seen as its threaded twin."""

    def __init__(self, target: Any, loop: LoopThread) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_loop", loop)

    def __getattr__(self, name: str) -> Any:
        target, loop = self._target, self._loop
        if name == "receive_no_wait":
            return lambda: _view(loop.run(target.receive, 0), loop)
        value = getattr(target, _RENAMED.get(name, name))
        if not callable(value):
            return value
        return lambda *args, **kwargs: _view(loop.run(value, *args, **kwargs), loop)

    def __enter__(self) -> BlockingView:
        if isinstance(self._target, aio.AsyncTransactionAttempt):
            self._loop.run(self._target.__aenter__)
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        target = self._target
        if isinstance(target, aio.AsyncTransactionAttempt):
            return bool(self._loop.run(target.__aexit__, kind, error, trace))
        self._loop.run(target.close)
        return False

    def __iter__(self) -> Iterator[Any]:
        loop = self._loop
        iterator = loop.run(self._target.__aiter__)
        while True:
            try:
                yield _view(loop.run(iterator.__anext__), loop)
            except StopAsyncIteration:
                return


class PendingView:
    """``send_nowait``'s awaitable, seen as a SendCompletion."""

    def __init__(self, pending: aio.PendingSend, loop: LoopThread) -> None:
        self._pending = pending
        self._loop = loop

    def done(self) -> bool:
        return self._pending.done()

    @property
    def message(self) -> hafailover.Message | None:
        return self._pending.message

    def exception(self) -> BaseException | None:
        if not self._pending.done():
            return None
        try:
            self._pending.result()
        except BaseException as exc:  # noqa: BLE001 - what the send ended with
            return exc
        return None

    def result(self, timeout: float | None = None) -> None:
        async def wait() -> None:
            await asyncio.wait_for(_awaited(self._pending), timeout)

        asyncio.run_coroutine_threadsafe(wait(), self._loop.loop).result()


async def _awaited(pending: aio.PendingSend) -> hafailover.Message:
    return await pending


class Api:
    """How a test connects: ``name`` is "threaded" or "aio"."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loops: list[LoopThread] = []

    def connect(self, url: str, **kwargs: Any) -> Any:
        if self.name == "threaded":
            return hafailover.connect(url, **kwargs)
        loop = LoopThread()
        self._loops.append(loop)
        return BlockingView(loop.run(aio.connect, url, **kwargs), loop)

    def close(self) -> None:
        for loop in self._loops:
            loop.stop()


@pytest.fixture(params=["threaded", "aio"])
def api(request: pytest.FixtureRequest) -> Iterator[Api]:
    chosen = Api(str(request.param))
    yield chosen
    chosen.close()
