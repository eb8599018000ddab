"""NInfer core: the plugin host, the model runtime and the engine.

Importing this package is cheap on purpose: it never imports Triton or CuPy and
never touches CUDA. Heavy modules are imported where they are used.
"""

import pluggy

__version__ = "0.1.0"

PROJECT_NAME = "ninfer"
#: Entry-point group that built-in and third-party plugins register under.
ENTRY_POINT_GROUP = "ninfer"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

__all__ = ["ENTRY_POINT_GROUP", "PROJECT_NAME", "__version__", "hookimpl", "hookspec"]
