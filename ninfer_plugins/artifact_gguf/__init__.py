"""Artifact reader for GGUF files (llama.cpp's format): `ninfer generate model.gguf`.

Reads architectures llama, mistral, qwen2 and qwen3 through gguf-py's `GGUFReader`
(bounded for untrusted files, `file.py`): the metadata becomes a Hugging Face `config.json`
(`config.py`), the tensors are served under Hugging Face names in torch's layout, Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K..Q6_K and IQ4_XS matrices kept in their codes
(`tensors.py`), and the `tokenizer.*` metadata becomes `tokenizer.json` and `tokenizer_config.json`
(`tokenizer.py`), so loading, the text layer and `ninfer convert` see a GGUF like a model
folder. See docs/gguf.md.

Importing this module is cheap: gguf-py (and numpy) load when a file is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ninfer_core import hookimpl
from ninfer_core.errors import ModelLoadError
from ninfer_core.support import Support

#: The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"


class GGUFFileReader:
    name = "gguf"
    description = (
        "GGUF file (llama.cpp): llama, mistral, qwen2, qwen3 (Q4_0..Q8_0 and "
        "Q4_K/Q5_K/Q6_K kept, the rest dequantized)"
    )

    def supports(self, device: Any) -> Support:
        return Support.yes("reads on the CPU; any device")

    def can_read(self, path: Path) -> bool:
        """A file named `*.gguf`, or any file starting with the GGUF magic."""
        if not path.is_file():
            return False
        if path.suffix.lower() == ".gguf":
            return True
        try:
            with path.open("rb") as fh:
                return fh.read(len(GGUF_MAGIC)) == GGUF_MAGIC
        except OSError:
            return False

    def open(self, path: Path) -> Any:
        try:
            from ninfer_plugins.artifact_gguf.artifact import GGUFArtifact
        except ImportError as exc:  # gguf is a dependency; a broken install says so
            raise ModelLoadError(
                f"{path}: reading GGUF files needs the gguf package ({exc}); pip install gguf"
            ) from None
        return GGUFArtifact(path)


@hookimpl
def register_artifact_readers() -> list[GGUFFileReader]:
    return [GGUFFileReader()]
