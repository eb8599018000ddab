"""Name-keyed registries, built once at startup from plugin hooks.

A registry refuses a duplicate name (naming both sources) and answers an unknown
name with the list of known ones, so a typo in a config never fails silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from ninfer_core.errors import DuplicateNameError, UnknownNameError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Entry(Generic[T]):
    """One registered object and the plugin (and distribution) it came from."""

    name: str
    obj: T
    plugin: str
    distribution: str


class Registry(Generic[T]):
    """Plugins of one kind ("KV codec", "kernel backend", ...) keyed by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        #: Plugins left out, and objects of this kind refused, when the host was built:
        #: an unknown name may be theirs, so the error lists them.
        self.unavailable: list[str] = []

    def unavailable_note(self) -> str:
        if not self.unavailable:
            return ""
        return "not loaded: " + "; ".join(self.unavailable)

    def add(self, name: str, obj: T, *, plugin: str = "?", distribution: str = "?") -> None:
        if name in self._entries:
            first = self._entries[name]
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered twice: by {first.plugin} "
                f"({first.distribution}) and by {plugin} ({distribution})"
            )
        self._entries[name] = Entry(name, obj, plugin, distribution)

    def remove(self, name: str) -> None:
        """Take out an object refused after it was added (e.g. a clashing architecture)."""
        del self._entries[name]

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                self.kind, name, self._entries, note=self.unavailable_note()
            ) from None

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[Entry[T]]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[T]:
        return (e.obj for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
