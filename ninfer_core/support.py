"""`Support`: the answer a plugin gives to "can you run on this device?"."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Support:
    """Either supported, or not with a reason a person can act on."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls, reason: str = "") -> Support:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Support:
        if not reason:
            raise ValueError("a refusal needs a reason")
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.ok
