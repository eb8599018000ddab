"""What each kind of plugin object looks like.

`register_*` hooks (see `hookspecs.py`) return plain objects of these shapes; the
host folds them into name-keyed registries once at startup. Every object has a
`name`, a one-line `description` and `supports(device) -> Support`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ninfer_core.device import DeviceInfo
    from ninfer_core.model.config import ModelConfig
    from ninfer_core.support import Support


@runtime_checkable
class Plugin(Protocol):
    """The part every registered object shares."""

    name: str
    description: str

    def supports(self, device: DeviceInfo) -> Support: ...


class Artifact(Protocol):
    """An opened model artifact: config, weights and the text files beside them."""

    path: Path

    @property
    def config(self) -> dict[str, Any]:
        """The Hugging Face style `config.json` contents."""
        ...

    def tensor_names(self) -> list[str]: ...

    def tensor_shape(self, name: str) -> tuple[int, ...]: ...

    def load_tensor(self, name: str) -> torch.Tensor:
        """The named tensor on the CPU, in its stored dtype."""
        ...

    def read_text(self, name: str) -> str | None:
        """A text file shipped with the model (`tokenizer.json`, ...), or None when absent."""
        ...


class ArtifactReader(Plugin, Protocol):
    """Opens one artifact format (a Hugging Face folder, a `.ninfer` container, ...)."""

    def can_read(self, path: Path) -> bool:
        """Cheap check on the path alone (suffix, a marker file); no weights are read."""
        ...

    def open(self, path: Path) -> Artifact:
        """Open the artifact; raises `ModelLoadError` naming the file and the problem."""
        ...


class ModelFamily(Plugin, Protocol):
    """An architecture family: which `config.json` architectures it builds, and how."""

    architectures: tuple[str, ...]

    def parse_config(self, raw: dict[str, Any]) -> ModelConfig: ...

    def build(self, config: ModelConfig, ops: Any, dtype: torch.dtype) -> torch.nn.Module:
        """A model with empty (meta or uninitialised) weights, ready for `load_weights`."""
        ...


class KVCodec(Plugin, Protocol):
    """How keys and values are stored in the paged pool (fp16, int8, ...)."""

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int: ...

    def allocate(self, layout: Any, device: torch.device) -> Any:
        """A KV store for `layout` (see `ninfer_core.kv`)."""
        ...


class KernelBackend(Plugin, Protocol):
    """A set of kernels (GEMM, norms, attention) the model calls through."""

    #: Higher wins when several are supported and none is configured.
    priority: int

    def create_ops(self, device: DeviceInfo) -> Any:
        """The ops object handed to the model (see `ninfer_core.model.ops.KernelOps`)."""
        ...


class DraftStrategy(Plugin, Protocol):
    """Proposes draft tokens for speculative decoding (MTP, n-gram, ...)."""


class Frontend(Plugin, Protocol):
    """An HTTP API dialect (OpenAI, Anthropic): routes that turn requests into generations."""

    def route_handlers(self, app_state: Any) -> list[Any]: ...
