"""The catalogue of NInfer's extension points.

Every hook is a `register_*` hook called once when a plugin host is built: it
returns plain objects (see `ninfer_core.plugin_types`) that the host folds into
name-keyed registries. Nothing plugin-shaped runs per token.

Hook calls are keyword-only, and an implementation may accept any subset of a
spec's arguments, so a spec can grow an argument without breaking plugins.
Every hook here is documented in `docs/plugins.md`; a meta-test keeps the two in step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer_core import hookspec

if TYPE_CHECKING:
    from ninfer_core.plugin_types import (
        ArtifactReader,
        DraftStrategy,
        Frontend,
        KernelBackend,
        KVCodec,
        ModelFamily,
    )

# --------------------------------------------------------------------------
# Formats: reading models
# --------------------------------------------------------------------------


@hookspec
def register_artifact_readers() -> list[ArtifactReader]:
    """Return artifact readers: objects that open one model format.

    Called once per plugin host. Each reader says from the path alone whether it
    can read it (`can_read`); the first registered reader that can, opens it.
    """


@hookspec
def register_model_families() -> list[ModelFamily]:
    """Return model families: objects that build torch modules for architectures.

    Each family lists the `config.json` `architectures` names it builds
    (e.g. `Qwen3ForCausalLM`); two families claiming one name is an error.
    """


# --------------------------------------------------------------------------
# Runtime: memory and kernels
# --------------------------------------------------------------------------


@hookspec
def register_kv_codecs() -> list[KVCodec]:
    """Return KV codecs: storage formats for the paged KV cache (`--kv-dtype`).

    A codec's `supports(device)` refuses, with a reason, devices it cannot run on;
    a refused codec chosen in the config fails at startup naming the alternatives.
    """


@hookspec
def register_kernel_backends() -> list[KernelBackend]:
    """Return kernel backends: GEMM, norm and attention kernels (`--gemm-backend`).

    With `auto`, the supported backend with the highest `priority` is taken.
    """


# --------------------------------------------------------------------------
# Decoding and serving
# --------------------------------------------------------------------------


@hookspec
def register_draft_strategies() -> list[DraftStrategy]:
    """Return draft strategies for speculative decoding (`--spec`)."""


@hookspec
def register_frontends() -> list[Frontend]:
    """Return API frontends: the HTTP dialects `ninfer-serve` speaks."""
