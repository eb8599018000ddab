"""The catalogue of NInfer's extension points: one table, one hook spec per row.

Every hook is a `register_*` hook called once when a plugin host is built: it
returns plain objects (see `ninfer_core.plugin_types`) that the host folds into
name-keyed registries. Nothing plugin-shaped runs per token.

Adding an extension point touches this module only: decorate its spec with
`extension_point(...)`, naming the kind of object, the protocol every object is
checked against, whether one object is chosen (exclusive, with its CLI option) or
all supported ones are kept (pooled). The host, the selection, `ninfer probe` and
`ninfer plugins` read `EXTENSION_POINTS`.

Hooks are called with keyword arguments, and an implementation may accept any
subset of a spec's arguments, so a spec can grow an argument without breaking
plugins. Every hook here is documented in `docs/plugins.md`; a meta-test keeps the
two in step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ninfer_core import hookspec
from ninfer_core.plugin_types import (
    ArtifactReader,
    DraftStrategy,
    Frontend,
    KernelBackend,
    KVCodec,
    ModelFamily,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class ExtensionPoint:
    """One row of the catalogue."""

    #: Registry key, `PluginHost.registries[point]`: the hook name without `register_`.
    point: str
    #: The `register_*` hook that returns the objects.
    hook: str
    #: Human name of one object, for messages ("KV codec").
    kind: str
    #: The contract every returned object is checked against when the host is built.
    protocol: type
    #: One object is chosen (by `option`, or `auto`), or every supported one is kept.
    exclusive: bool
    #: The command-line option that picks the object of an exclusive point.
    option: str | None = None
    #: What an exclusive point is asked for when nothing is configured: `auto` (the
    #: best supported) or None (nothing wanted, e.g. no speculative decoding).
    default: str | None = None

    @property
    def dest(self) -> str | None:
        """The option as an argparse destination (`--kv-dtype` -> `kv_dtype`)."""
        return self.option.lstrip("-").replace("-", "_") if self.option else None


#: Every extension point, in the order `ninfer probe` prints them.
EXTENSION_POINTS: dict[str, ExtensionPoint] = {}


def extension_point(
    kind: str,
    protocol: type,
    *,
    exclusive: bool = False,
    option: str | None = None,
    default: str | None = None,
) -> Callable[[F], F]:
    """Make `fn` a hook spec and add its row to `EXTENSION_POINTS`."""
    if exclusive != (option is not None):
        raise ValueError("an exclusive extension point needs its option, a pooled one none")

    def mark(fn: F) -> F:
        name = fn.__name__
        if not name.startswith("register_"):
            raise ValueError(f"extension point hook {name!r} must be named register_*")
        point = name.removeprefix("register_")
        EXTENSION_POINTS[point] = ExtensionPoint(
            point, name, kind, protocol, exclusive, option, default
        )
        return hookspec(fn)

    return mark


def exclusive_points() -> Sequence[ExtensionPoint]:
    """The points where one object is chosen, in catalogue order."""
    return [p for p in EXTENSION_POINTS.values() if p.exclusive]


# --------------------------------------------------------------------------
# Formats: reading models
# --------------------------------------------------------------------------


@extension_point("artifact reader", ArtifactReader)
def register_artifact_readers() -> list[ArtifactReader]:
    """Return artifact readers: objects that open one model format.

    Called once per plugin host. Each reader says from the path alone whether it
    can read it (`can_read`); the first registered reader that can, opens it.
    """


@extension_point("model family", ModelFamily)
def register_model_families() -> list[ModelFamily]:
    """Return model families: objects that build torch modules for architectures.

    Each family lists the `config.json` `architectures` names it builds
    (e.g. `Qwen3ForCausalLM`); two families claiming one name is an error.
    """


# --------------------------------------------------------------------------
# Runtime: memory and kernels
# --------------------------------------------------------------------------


@extension_point("KV codec", KVCodec, exclusive=True, option="--kv-dtype", default="auto")
def register_kv_codecs() -> list[KVCodec]:
    """Return KV codecs: storage formats for the paged KV cache (`--kv-dtype`).

    A codec's `supports(device)` refuses, with a reason, devices it cannot run on;
    a refused codec chosen in the config fails at startup naming the alternatives.
    """


@extension_point(
    "kernel backend", KernelBackend, exclusive=True, option="--gemm-backend", default="auto"
)
def register_kernel_backends() -> list[KernelBackend]:
    """Return kernel backends: GEMM, norm and attention kernels (`--gemm-backend`).

    With `auto`, the supported backend with the highest `priority` is taken.
    """


# --------------------------------------------------------------------------
# Decoding and serving
# --------------------------------------------------------------------------


@extension_point("draft strategy", DraftStrategy, exclusive=True, option="--spec")
def register_draft_strategies() -> list[DraftStrategy]:
    """Return draft strategies for speculative decoding (`--spec`)."""


@extension_point("API frontend", Frontend)
def register_frontends() -> list[Frontend]:
    """Return API frontends: the HTTP dialects `ninfer-serve` speaks."""
