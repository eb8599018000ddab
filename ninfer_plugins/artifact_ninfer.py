"""Artifact reader for `.ninfer` container files (versions 1, 2, 3; `docs/artifact-format.md`).

A file is claimed by its `.ninfer` suffix or by its first 7 bytes being the magic, so a
misnamed container still opens and a damaged `.ninfer` gets this reader's clear error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ninfer_core import hookimpl
from ninfer_core.artifact.layout import MAGIC
from ninfer_core.support import Support


class NinferContainerReader:
    name = "ninfer-container"
    description = ".ninfer container file, versions 1-3 (+ its .part-NNNN volumes)"

    def supports(self, device: Any) -> Support:
        return Support.yes("reads on the CPU; any device")

    def can_read(self, path: Path) -> bool:
        if not path.is_file():
            return False
        if path.suffix == ".ninfer":
            return True
        try:
            with path.open("rb") as fh:
                return fh.read(len(MAGIC)) == MAGIC
        except OSError:
            return False

    def open(self, path: Path) -> Any:
        from ninfer_core.artifact.reader import open_container

        return open_container(path)


@hookimpl
def register_artifact_readers() -> list[NinferContainerReader]:
    return [NinferContainerReader()]
