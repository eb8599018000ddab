"""Where an artifact keeps its MTP layer's tensors, under either naming in use.

Qwen3-Next checkpoints (and NInfer's built-in model) keep it under `mtp.`: `mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, one decoder layer under
`mtp.layers.0.` and `mtp.norm`. DeepSeek-V3 checkpoints keep it as one more layer after the
decoder's, `model.layers.{num_hidden_layers}.`, with `eh_proj`, `enorm`, `hnorm` and
`shared_head.norm` beside the decoder layer's own tensors (its `embed_tokens` and
`shared_head.head` copies are the target's and are not read). Both compute the same thing,
so both fill the same `MTPLayer` parameters.

A `.ninfer` container keeps the layer in its own component, `mtp`, and opens with only
`text` readable (a model served without speculation never maps the rest); `mtp_tensors`
reopens it with `mtp` as well while the layer is checked or loaded.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ninfer_core.loading import with_components
from ninfer_core.memory.planner import PackedBytes, slots_bytes
from ninfer_core.model.config import ModelConfig
from ninfer_core.model.weights import WeightSlot, check_weights, layer_slots
from ninfer_core.plugin_types import Artifact

if TYPE_CHECKING:
    from ninfer_core.model.ops import KernelOps
    from ninfer_plugins.draft_mtp.layer import MTPLayer


@dataclass(frozen=True, slots=True)
class MTPNames:
    """The checkpoint names of one MTP layer's tensors."""

    #: The naming, for messages (`qwen3-next`, `deepseek-v3`).
    scheme: str
    fc: str
    pre_fc_norm_embedding: str
    pre_fc_norm_hidden: str
    norm: str
    #: Prefix of the decoder layer's tensors (`input_layernorm.weight`, ...).
    layer: str


QWEN3_NEXT = MTPNames(
    scheme="qwen3-next",
    fc="mtp.fc.weight",
    pre_fc_norm_embedding="mtp.pre_fc_norm_embedding.weight",
    pre_fc_norm_hidden="mtp.pre_fc_norm_hidden.weight",
    norm="mtp.norm.weight",
    layer="mtp.layers.0.",
)


def deepseek_names(config: ModelConfig) -> MTPNames:
    """DeepSeek-V3's: the MTP layer is layer `num_hidden_layers` of the checkpoint."""
    p = f"model.layers.{config.num_layers}."
    return MTPNames(
        scheme="deepseek-v3",
        fc=p + "eh_proj.weight",
        pre_fc_norm_embedding=p + "enorm.weight",
        pre_fc_norm_hidden=p + "hnorm.weight",
        norm=p + "shared_head.norm.weight",
        layer=p,
    )


#: The `.ninfer` component holding the MTP layer.
COMPONENT = "mtp"

#: The `MTPLayer` parameters handed to the backend's `pack_linear` once loaded: what
#: `MTPLayer.pack_weights` packs, and what the memory plan sizes as packed.
PACKED = (
    "fc",
    "layer.self_attn.qkv_proj",
    "layer.self_attn.o_proj",
    "layer.mlp.gate_up_proj",
    "layer.mlp.down_proj",
)


def mtp_tensors(artifact: Artifact) -> AbstractContextManager[Artifact]:
    """`artifact` with its MTP tensors listed and loadable, for a `with` block (a `.ninfer`
    file lists its `mtp` component only when asked)."""
    return with_components(artifact, {COMPONENT})


def find_names(config: ModelConfig, artifact: Artifact) -> MTPNames | None:
    """The naming whose `fc` tensor the artifact holds (Qwen3-Next's first), or None when
    it holds neither: no MTP layer."""
    names = set(artifact.tensor_names())
    for candidate in (QWEN3_NEXT, deepseek_names(config)):
        if candidate.fc in names:
            return candidate
    return None


def mtp_plan(config: ModelConfig, names: MTPNames) -> list[WeightSlot]:
    """Every tensor of the MTP layer and the `MTPLayer` parameter it fills."""
    h = config.hidden_size
    return [
        WeightSlot(names.fc, "fc", 0, (h, 2 * h)),
        WeightSlot(names.pre_fc_norm_embedding, "pre_fc_norm_embedding.weight", 0, (h,)),
        WeightSlot(names.pre_fc_norm_hidden, "pre_fc_norm_hidden.weight", 0, (h,)),
        *layer_slots(config, names.layer, "layer."),
        WeightSlot(names.norm, "norm.weight", 0, (h,)),
    ]


def checked_plan(config: ModelConfig, artifact: Artifact) -> tuple[MTPNames, list[WeightSlot]]:
    """The naming the artifact uses and its plan, every tensor and shape checked: raises
    `ModelLoadError` naming the first missing or misshapen tensor, `LookupError` when the
    artifact has no MTP layer at all."""
    names = find_names(config, artifact)
    if names is None:
        raise LookupError(
            f"{artifact.path}: no MTP layer (neither {QWEN3_NEXT.fc!r} nor "
            f"{deepseek_names(config).fc!r} is among its tensors)"
        )
    return names, check_weights(config, artifact, mtp_plan(config, names))


def mtp_weights_bytes(
    config: ModelConfig,
    artifact: Artifact,
    dtype: torch.dtype,
    packed_bytes: PackedBytes | None = None,
) -> int:
    """Bytes the loaded, packed `MTPLayer` holds, from the artifact's headers alone (the
    planner's rules: a dense tensor cast to `dtype`, a quantized one as stored, a packed
    projection as `packed_bytes` says). Raises as `checked_plan` does."""
    with mtp_tensors(artifact) as full:
        _, plan = checked_plan(config, full)
        projections = {name.rpartition(".")[2] for name in PACKED}
        return slots_bytes(
            plan, dtype, artifact=full, packed_bytes=packed_bytes, packed=projections
        )


class DenseMTP:
    """The `MTPLayerKind` of a family that declares none (`ModelFamily.mtp_layer` None):
    one dense decoder layer under either naming above, computed by `MTPLayer`."""

    def weight_slots(self, config: ModelConfig, artifact: Artifact) -> list[WeightSlot]:
        return checked_plan(config, artifact)[1]

    def weights_bytes(
        self,
        config: ModelConfig,
        artifact: Artifact,
        dtype: torch.dtype,
        packed_bytes: PackedBytes | None = None,
    ) -> int:
        return mtp_weights_bytes(config, artifact, dtype, packed_bytes)

    def build(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype) -> MTPLayer:
        from ninfer_plugins.draft_mtp.layer import MTPLayer  # layer.py imports this module

        return MTPLayer(config, ops, dtype)

    def __repr__(self) -> str:
        return "DenseMTP()"


#: The one `DenseMTP`: it keeps nothing.
DENSE_MTP = DenseMTP()
