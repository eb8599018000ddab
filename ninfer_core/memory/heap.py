"""`HeapTrimmer`: hand glibc's free heap pages back to the kernel, now and then.

On the CPU every new prompt length compiles new oneDNN kernels and evicts old ones from the
bounded caches (docs/memory.md, "Memory that stays bounded"). What the evicted kernels and a
prefill's large temporaries free stays in glibc's heap, fragmented, and counts in RSS: 300
prompts of distinct lengths grew the built-in model's process by 187 MiB of which 31 MiB was
live. `malloc_trim(0)` returns it (75 ms the first time on a fragmented heap, ~2 ms after), so
the model runner calls `maybe_trim` before prefill steps, at most once per interval.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

#: Seconds between two trims at least: a trim costs ~2 ms on a heap trimmed before.
TRIM_INTERVAL_S = 5.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None on a C library without it (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """Calls `malloc_trim(0)` at most once per `interval_s`; does nothing without glibc."""

    def __init__(
        self,
        interval_s: float = TRIM_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        trim: Callable[[int], int] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._trim = trim if trim is not None else _malloc_trim()
        self._last = clock()
        self.trims = 0

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed since the last trim (or since creation)."""
        if self._trim is None:
            return False
        now = self._clock()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        self._trim(0)
        self.trims += 1
        return True
