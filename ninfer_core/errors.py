"""Errors that reach the user as one clear line.

Every error the CLI or server shows to a person derives from :class:`NInferError`;
anything else escaping is a bug, and gets a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


def plural(noun: str) -> str:
    """English plural of a registry kind ("draft strategy" → "draft strategies")."""
    if noun.endswith("y") and noun[-2:-1] not in tuple("aeiou"):
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def elided(text: str, width: int = 60) -> str:
    """`text` as an error message quotes it: whole up to `width` characters, else cut to
    `width` with "..." (a name from a request or a file can be megabytes long)."""
    return text if len(text) <= width else text[: width - 3] + "..."


class NInferError(Exception):
    """Base for errors whose message is meant for the user as it is."""


class UnknownNameError(NInferError, KeyError):
    """A name was asked of a registry that does not hold it."""

    def __init__(self, kind: str, name: str, known: Iterable[str], *, note: str = "") -> None:
        self.kind = kind
        self.name = name
        self.known = sorted(known)
        listing = ", ".join(self.known) if self.known else "(none registered)"
        #: What was left out (plugins that failed to load), when the name may be theirs.
        self.note = note
        tail = f"; {note}" if note else ""
        super().__init__(f"unknown {kind} {name!r}; known {plural(kind)}: {listing}{tail}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class DuplicateNameError(NInferError):
    """Two plugins registered the same name for one extension point."""


class ModelLoadError(NInferError):
    """A model artifact could not be loaded; the message names the file and the problem."""


class UnsupportedChoiceError(NInferError):
    """A configured plugin cannot run on this device; the message names the alternatives."""


class ArtifactError(ModelLoadError):
    """A `.ninfer` container is malformed, truncated, corrupt or of an unknown version."""
