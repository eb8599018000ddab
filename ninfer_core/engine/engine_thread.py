"""The engine's own thread: steps while there is work, sleeps on a condition when idle.

Kept apart from `Engine` so the step logic reads without the threading around it; the
mixin uses the engine's `_lock`/`_wake`, `step()`, `_live`, `_end` and `_emit`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Self

from ninfer_core.engine.request import EngineClosedError, EngineError, EngineStepError

log = logging.getLogger("ninfer_core.engine.engine")


class StepThread:
    _lock: threading.Lock
    _wake: threading.Condition
    _thread: threading.Thread | None
    _closing: bool
    _live: dict[str, Any]

    def start(self) -> None:
        """Run the step loop on its own thread (idempotent)."""
        with self._lock:
            if self._closing:
                raise EngineClosedError("the engine is shutting down")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="ninfer-engine", daemon=True
                )
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closing and not self.has_work:
                    self._wake.wait()
                if self._closing:
                    return
            try:
                self.step()
            except Exception as exc:  # a bug in the bookkeeping: fail what is live, go on
                log.exception("engine step failed")
                self._fail_all(EngineStepError(f"the step failed: {type(exc).__name__}: {exc}"))

    def _fail_all(self, error: EngineError) -> None:
        events: list = []
        with self._lock:
            for live in list(self._live.values()):
                self._end(live, "error", events, error=type(error)(str(error)))
        self._emit(events)

    def close(self, reason: str = "the engine shut down") -> None:
        """Stop the thread after its current step; every live request, running or queued,
        ends with an `EngineClosedError(reason)` (the server's shutdown says why), so each
        client gets its protocol's error instead of a cut connection."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._fail_all(EngineClosedError(reason))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
