"""Weights and K/V pages in 2 MiB pages on Linux (transparent huge pages).

A decode step on the CPU streams every weight once and reads each sequence's K/V pages.
Through 4 KiB pages that is a TLB miss every 4 KiB (and under a hypervisor each miss is
a two-level page walk). On the 2-vCPU test machine, in one process, alternating:

- bf16 GEMVs over SmolLM2's matrices read 24-26 GB/s from 4 KiB pages and 31-38 GB/s
  from 2 MiB pages;
- the decode attention over a 30-layer pool took 34 -> 30 us a layer with the pages in
  order and 70 -> 57 us with them scattered.

Transparent huge pages are often left to `madvise` (memory gets them only when asked),
and only whole 2 MiB-aligned stretches of one mapping can be huge: a model's weights are
hundreds of separate allocations, most smaller than that. So:

- `consolidate` moves the storages under a model's weights into a few large 2 MiB-
  aligned arenas (a few hundred MiB at a time, so at most that much is held twice),
  asked for huge pages before they are written, and points every tensor at its new
  place (`Tensor.set_`: the same tensor objects, so nothing that holds them changes). A
  storage some tensor outside the list still views stays where it is.
- `collapse` asks in place, for one large allocation (the K/V pool, whose views the
  store hands out): `MADV_COLLAPSE` (Linux 6.1+) moves the pages already there into
  huge pages, 2 MiB at a time.

Huge pages are a speed-up, never a requirement: where the kernel refuses (an older
kernel, THP set to `never`, no free huge page), memory stays as it was and the report
says why. `NINFER_HUGE_PAGES=0` turns both off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

#: The x86-64 and arm64 transparent huge page size.
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
#: Bytes of storages moved into one arena at most (a larger storage gets its own).
ARENA_BYTES = 256 << 20
#: Storages start at multiples of this in an arena (a cache line; any dtype's size).
ALIGN = 64
#: Weights smaller than this in all stay where they are: an arena's last huge page may
#: hold up to 2 MiB past its storages, which a small model would pay several times over
#: (and a model this small streams from cache more than from memory).
MIN_CONSOLIDATED = 64 << 20


@dataclass(frozen=True)
class HugePages:
    """What was asked and done: bytes in 2 MiB-aligned stretches asked for, bytes in huge
    pages after, bytes moved into arenas, and why not all were huge, if not."""

    asked: int
    huge: int
    moved: int = 0
    reason: str | None = None

    def describe(self, what: str) -> str:
        mib = 1 << 20
        line = f"huge pages: {self.huge / mib:.0f} of {self.asked / mib:.0f} MiB of {what}"
        return line if self.reason is None else f"{line} ({self.reason})"


def unavailable() -> str | None:
    """Why huge pages are not asked for here, or None."""
    if os.environ.get("NINFER_HUGE_PAGES", "1") == "0":
        return "NINFER_HUGE_PAGES=0"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if _madvise() is None:
        return "no madvise in the C library"
    return None


def collapse(tensors: Iterable[torch.Tensor]) -> HugePages:
    """Ask for huge pages under the CPU storages of `tensors` (each once), in place."""
    return _collapse_storages(_storages(tensors).values())


def _collapse_storages(storages: Iterable[torch.UntypedStorage]) -> HugePages:
    reason = unavailable()
    asked = huge = 0
    for storage in storages:
        start, end = _aligned(storage.data_ptr(), storage.nbytes())
        asked += max(0, end - start)
        if reason is None and end > start:
            got, why = _collapse_range(start, end)
            huge, reason = huge + got, reason or why
    return HugePages(asked, huge, 0, reason)


def consolidate(tensors: Iterable[torch.Tensor], min_bytes: int | None = None) -> HugePages:
    """Move the CPU storages under `tensors` into huge-page arenas (see the module),
    where they add up to `min_bytes` (`MIN_CONSOLIDATED`) at least; otherwise
    `collapse` them in place."""
    tensors = list({id(t): t for t in tensors}.values())
    storages = _storages(tensors)
    least = MIN_CONSOLIDATED if min_bytes is None else min_bytes
    reason = unavailable()
    if reason is not None or sum(s.nbytes() for s in storages.values()) < least:
        return _collapse_storages(storages.values())
    viewers: dict[int, list[torch.Tensor]] = {}  # storage address -> its tensors
    for t in tensors:
        if t.device.type == "cpu" and t.layout == torch.strided:
            viewers.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    # Only storages every view of which is in the list: another view would keep the old
    # memory alive (the bytes held twice) and stop seeing the moved ones.
    movable = [
        (storages[p], views) for p, views in viewers.items()
        if _views(storages[p]) == len(views) and storages[p].nbytes() > 0
    ]  # fmt: skip
    moving = {s.data_ptr() for s, _ in movable}
    left = [s for p, s in storages.items() if p not in moving]
    asked = huge = moved = 0
    for group in _arenas(movable):
        size = sum(_padded(s.nbytes()) for s, _ in group)
        raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
        base = raw.data_ptr()
        start = -(-base // HUGE_PAGE) * HUGE_PAGE
        end = (start + size + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        end = min(end, (base + raw.numel()) // HUGE_PAGE * HUGE_PAGE)
        _madvise()(start, end - start, MADV_HUGEPAGE)  # before any byte is written
        at = start - base  # byte offset of the next storage in `raw`
        arena = raw.untyped_storage()
        for storage, views in group:
            n = storage.nbytes()
            old = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,))
            raw[at : at + n].copy_(old)
            for t in views:
                item = t.element_size()
                offset = (at + t.storage_offset() * item) // item
                with torch.no_grad():
                    t.set_(arena, offset, t.size(), t.stride())
            at += _padded(n)
            moved += n
        asked += end - start
        got, why = _collapse_range(start, end)  # what the faults did not make huge
        huge, reason = huge + got, reason or why
    rest = _collapse_storages(left)
    return HugePages(asked + rest.asked, huge + rest.huge, moved, reason or rest.reason)


def _arenas(movable):
    """The storages in groups of at most `ARENA_BYTES` (in order: a model's layers)."""
    group, size = [], 0
    for item in movable:
        n = _padded(item[0].nbytes())
        if group and size + n > ARENA_BYTES:
            yield group
            group, size = [], 0
        group.append(item)
        size += n
    if group:
        yield group


def _views(storage: torch.UntypedStorage) -> int:
    """Tensors viewing `storage` (the count of its holders, less the storage object), or
    -1 where torch does not tell (then nothing is moved: every view must be known)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return -1 if use_count is None else use_count(storage._cdata) - 1


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The CPU storages under `tensors`, each once, by address."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type == "cpu" and t.layout == torch.strided:
            storage = t.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage)
    return seen


def _aligned(ptr: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned stretch inside [ptr, ptr + nbytes)."""
    return -(-ptr // HUGE_PAGE) * HUGE_PAGE, (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE


def _collapse_range(start: int, end: int) -> tuple[int, str | None]:
    """`MADV_HUGEPAGE` and `MADV_COLLAPSE` over [start, end), 2 MiB at a time: the bytes
    in huge pages after, and the first refusal's reason."""
    madvise, reason, huge = _madvise(), None, 0
    madvise(start, end - start, MADV_HUGEPAGE)  # memory faulted in from now on
    for at in range(start, end, HUGE_PAGE):
        if madvise(at, HUGE_PAGE, MADV_COLLAPSE) == 0:
            huge += HUGE_PAGE
        elif reason is None:
            code = ctypes.get_errno()
            reason = f"MADV_COLLAPSE: {errno.errorcode.get(code, code)}"
    return huge, reason


_MADVISE: list = []


def _madvise():
    """libc's `madvise` (errno kept), or None."""
    if not _MADVISE:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _MADVISE.append(fn)
    return _MADVISE[0]
