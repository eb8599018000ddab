"""The `.ninfer` container (versions 1, 2, 3): layout, writer and reader.

Spec: `docs/artifact-format.md`. The reader plugin is `ninfer_plugins/artifact_ninfer.py`.
Importing this package is cheap; the submodules import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ninfer_core.artifact.reader import NinferArtifact, open_container
    from ninfer_core.artifact.writer import ContainerWriter

__all__ = ["ContainerWriter", "NinferArtifact", "open_container"]

_WHERE = {
    "ContainerWriter": "ninfer_core.artifact.writer",
    "NinferArtifact": "ninfer_core.artifact.reader",
    "open_container": "ninfer_core.artifact.reader",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
