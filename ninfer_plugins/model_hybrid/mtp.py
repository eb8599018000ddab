"""The multi-token-prediction layer of Qwen3-Next / Qwen3.5 (`ModelFamily.mtp_layer`).

Their checkpoints keep it under `mtp.` at the top level (a Qwen3.5 multimodal checkpoint
too, beside `model.language_model.`): `mtp.fc` [H, 2H], `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, one decoder layer `mtp.layers.0.` and `mtp.norm`. The layer is
the family's own full-attention layer (gated attention with zero-centred q/k norms and
partial rotary; a `SparseMoE` or dense MLP by the config's rule for layer 0, as vLLM's
`Qwen3NextMultiTokenPredictor` builds it), and every norm is zero-centred (`1 + w`), so
the dense decoder's `MTPLayer` cannot compute it: the `mtp` draft strategy asks the
family for this one instead. What it computes is the dense one's:

    out = norm(layer(fc(concat(pre_fc_norm_embedding(embed(x_{t+1})),
                               pre_fc_norm_hidden(h_t)))))

with embedding, RoPE and head the target's, and the layer's K/V in layer 0 of the
drafter's own paged store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ninfer_core.loading import with_components
from ninfer_core.memory.planner import PACKED_PARAMS, PackedBytes, slots_bytes
from ninfer_core.model.config import ModelConfig
from ninfer_core.model.layers import empty_param, pack_params
from ninfer_core.model.ops import KernelOps
from ninfer_core.model.weights import WeightSlot, check_weights, load_weights
from ninfer_core.plugin_types import Artifact
from ninfer_plugins.model_hybrid.config import HybridConfig
from ninfer_plugins.model_hybrid.layers import ZeroCentredRMSNorm
from ninfer_plugins.model_hybrid.model import (
    HybridLayer,
    finalize_norms,
    layer_slots,
    norm_slot,
    pack_layer,
)

if TYPE_CHECKING:
    from ninfer_core.model.attention_meta import AttentionMetadata
    from ninfer_core.plugin_types import KVStore

#: Where the checkpoints keep it, and the `.ninfer` component holding it.
PREFIX, COMPONENT = "mtp.", "mtp"
#: The parameters (last name part) handed to `pack_linear` once loaded, as the planner
#: sizes them: fc and the layer's projections as the decoder's (`PACKED_PARAMS`: a
#: `SparseMoE`'s router, shared-expert gate and experts included).
PACKED = frozenset({"fc", *PACKED_PARAMS})


def mtp_slots(config: HybridConfig) -> list[WeightSlot]:
    """Every tensor of the MTP layer and the `HybridMTPLayer` parameter it fills."""
    h = config.base.hidden_size
    p = PREFIX
    return [
        WeightSlot(p + "fc.weight", "fc", 0, (h, 2 * h)),
        norm_slot(p + "pre_fc_norm_embedding.weight", "pre_fc_norm_embedding.weight", h),
        norm_slot(p + "pre_fc_norm_hidden.weight", "pre_fc_norm_hidden.weight", h),
        *layer_slots(config, p + "layers.0.", "layer.", linear=False, sparse=config.is_sparse(0)),
        norm_slot(p + "norm.weight", "norm.weight", h),
    ]


class HybridMTPLayer(nn.Module):
    """fc, the two pre-fc norms, one full-attention `HybridLayer` (layer 0 of the MTP's own
    KV store) and the final norm: an `MTPBlock`."""

    def __init__(self, config: HybridConfig, ops: KernelOps, dtype: torch.dtype) -> None:
        super().__init__()
        base = config.base
        self.config, self.hybrid, self.ops, self.dtype = base, config, ops, dtype
        h, eps = base.hidden_size, base.rms_norm_eps
        self.fc = empty_param(h, 2 * h, dtype=dtype, device=ops.device)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps, ops, dtype)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps, ops, dtype)
        # kv_index 0: a gated attention mixer, whatever the decoder's layer 0 is; its MLP
        # is layer 0's kind (`HybridConfig.is_sparse(0)`), as vLLM builds it.
        self.layer = HybridLayer(config, 0, 0, ops, dtype)
        self.norm = ZeroCentredRMSNorm(h, eps, ops, dtype)

    def load(self, artifact: Artifact) -> str:
        """Fill every parameter from `artifact` (checked first), then form the norms'
        `1 + w` and pack the projections; returns the naming (`qwen3-next`)."""
        with with_components(artifact, {COMPONENT}) as full:
            load_weights(self, full, checked_slots(self.hybrid, full))
        finalize_norms(self)
        pack_layer(self.layer, self.ops, self.dtype)
        pack_params([(self, "fc")], self.ops, self.dtype)
        return "qwen3-next"

    def embed_input(self, embeds: torch.Tensor) -> torch.Tensor:
        """embeds: [T, hidden] (the target's embedding of token t + 1) -> its normed
        embedding [T, hidden] in the compute dtype (a function of the token alone)."""
        return self.pre_fc_norm_embedding(embeds)

    def forward(
        self,
        embed_input: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_store: KVStore,
    ) -> torch.Tensor:
        """embed_input, hidden: [T, hidden]; cos, sin: the target's RoPE at t, [T,
        rotary_dim / 2] -> [T, hidden] after the final norm, the K/V written into layer 0
        of `kv_store`. The residual stream is fp32, as in `HybridDecoder`."""
        e_h = torch.cat((embed_input, self.pre_fc_norm_hidden(hidden)), dim=-1)  # [T, 2H]
        x = self.ops.linear(e_h, self.fc).float()
        # A full-attention layer reads no sequence state (`states`, `cu_seqlens` unused).
        x = self.layer(x, cos, sin, kv_store, meta, None, [])
        return self.norm(x)


def checked_slots(config: HybridConfig, artifact: Artifact) -> list[WeightSlot]:
    """`mtp_slots`, every tensor and shape checked against `artifact`: `LookupError` when
    it has no MTP layer at all, `ModelLoadError` naming the first tensor missing or
    misshapen."""
    slots = mtp_slots(config)
    if slots[0].hf_name not in set(artifact.tensor_names()):
        raise LookupError(
            f"{artifact.path}: no MTP layer ({slots[0].hf_name!r} is not among its tensors)"
        )
    return check_weights(config.base, artifact, slots)


class HybridMTP:
    """The family's `MTPLayerKind`: Qwen3-Next's naming, `HybridMTPLayer` computing it."""

    def __init__(self, grouped_projections: bool) -> None:
        #: The family's (`HybridConfig.grouped_projections`); the MTP layer has no DeltaNet,
        #: but its config is the family's own.
        self.grouped_projections = grouped_projections

    def hybrid_config(self, config: ModelConfig) -> HybridConfig:
        return HybridConfig.from_model_config(config, grouped_projections=self.grouped_projections)

    def weight_slots(self, config: ModelConfig, artifact: Artifact) -> list[WeightSlot]:
        return checked_slots(self.hybrid_config(config), artifact)

    def weights_bytes(
        self,
        config: ModelConfig,
        artifact: Artifact,
        dtype: torch.dtype,
        packed_bytes: PackedBytes | None = None,
    ) -> int:
        """The planner's rules for the tensors (`slots_bytes`; the zero-centred norms'
        slots say they are held in fp32)."""
        slots = self.weight_slots(config, artifact)
        return slots_bytes(
            slots, dtype, artifact=artifact, packed_bytes=packed_bytes, packed=PACKED
        )

    def build(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype) -> HybridMTPLayer:
        return HybridMTPLayer(self.hybrid_config(config), ops, dtype)

    def __repr__(self) -> str:
        return f"HybridMTP(grouped_projections={self.grouped_projections})"
