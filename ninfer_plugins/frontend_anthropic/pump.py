"""Engine events with a heartbeat, so a stream can send `ping`s while nothing happens.

A request may wait in the queue or in a long prefill for minutes; clients and proxies
drop a connection that stays silent, so the stream must send something every few
seconds. Waiting on the event stream with a timeout would cancel the wait — and
cancelling the generator cancels the request — so the next event is awaited in a task
of its own, and a timeout only means "nothing yet".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

#: Returned by `EventPump.next` when the timeout passed before the next event.
TICK = object()

_CLOSING: set[asyncio.Task[Any]] = set()


async def _next(events: AsyncIterator[Any]) -> Any:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


class EventPump:
    def __init__(self, events: AsyncIterator[Any], on_close: Any = None) -> None:
        self._events = events
        self._task: asyncio.Task[Any] | None = None
        #: Called once on close (the engine's cancel), so that freeing the request's pages
        #: never waits for a task or a generator finalizer to run.
        self._on_close = on_close

    async def start(self, wait_s: float) -> None:
        """Submit the request and wait up to `wait_s` for its first event. A refusal that
        comes by then (a full queue, a queue timeout) is raised here, before a response
        has been sent, so it can still choose the status."""
        self._task = asyncio.ensure_future(_next(self._events))
        await asyncio.wait({self._task}, timeout=wait_s)
        if self._task.done() and self._task.exception() is not None:
            task, self._task = self._task, None
            task.result()

    def peek(self) -> Any:
        """The next event if it has already come (it stays the next), else None."""
        task = self._task
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    async def next(self, timeout: float) -> Any:
        """The next event, `TICK` after `timeout` seconds without one, or None at the end."""
        if self._task is None:
            self._task = asyncio.ensure_future(_next(self._events))
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        if not done:
            return TICK
        task, self._task = self._task, None
        return task.result()

    def close(self) -> None:
        """End the request without awaiting anything: safe in a cancelled stream."""
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()  # its CancelledError runs the generator's own cleanup
            return
        if task is not None and not task.cancelled():
            task.exception()  # seen: a finished task's error is not "never retrieved"
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop any more: nothing left to tidy
            return
        closing = loop.create_task(self._events.aclose())
        _CLOSING.add(closing)  # a task nobody references may be collected before it runs
        closing.add_done_callback(_CLOSING.discard)
