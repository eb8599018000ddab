"""`MTPLayer`: the multi-token-prediction layer, computed with the target's kernels.

At position t it reads the target's final-normed hidden state h_t and the embedding of
token t + 1, and predicts token t + 2 through the target's head:

    x = fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))
    out = norm(decoder_layer(x))      # causal attention over the layer's own K/V, RoPE at t

(DeepSeek-V3 and Qwen3-Next both; the built-in model was trained this way,
`tools/train_builtin_model.py`). The decoder layer is layer 0 of a one-layer KV store of
its own. Embedding and head are the target's, not copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ninfer_core.model.config import ModelConfig
from ninfer_core.model.layers import DecoderLayer, RMSNorm, empty_param
from ninfer_core.model.ops import KernelOps
from ninfer_core.model.weights import load_weights
from ninfer_core.plugin_types import Artifact
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_plugins.draft_mtp.weights import PACKED, checked_plan, mtp_tensors

if TYPE_CHECKING:
    from ninfer_core.model.attention_meta import AttentionMetadata
    from ninfer_core.plugin_types import KVStore


class MTPLayer(nn.Module):
    """fc, the two pre-fc norms, one decoder layer and the final norm. The caller embeds
    the tokens and computes RoPE with the target's own (`embed`, `rotary`)."""

    def __init__(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.ops, self.dtype = config, ops, dtype
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = empty_param(h, 2 * h, dtype=dtype, device=ops.device)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, ops, dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, ops, dtype)
        self.layer = DecoderLayer(config, 0, ops, dtype)  # layer 0 of the MTP's own store
        self.norm = RMSNorm(h, eps, ops, dtype)

    def load(self, artifact: Artifact) -> str:
        """Fill every parameter from `artifact` (checked first), pack the projections;
        returns the naming found (`qwen3-next`, `deepseek-v3`)."""
        with mtp_tensors(artifact) as tensors:
            names, plan = checked_plan(self.config, tensors)
            load_weights(self, tensors, plan)
        self.pack_weights()
        return names.scheme

    def pack_weights(self) -> None:
        """Hand each projection to the backend's `pack_linear` once, as `DenseDecoder` does."""
        for param in PACKED:
            path, _, name = param.rpartition(".")
            module = self.get_submodule(path)
            w = getattr(module, name)
            # A quantized weight does not say the compute dtype; a dense one is in it.
            quantized = isinstance(w, QuantizedTensor)
            packed = (
                self.ops.pack_linear(w, dtype=self.dtype) if quantized else self.ops.pack_linear(w)
            )
            if packed is not w:
                module._parameters.pop(name, None)
                setattr(module, name, packed)

    def embed_input(self, embeds: torch.Tensor) -> torch.Tensor:
        """embeds: [T, hidden] (the target's embedding of token t + 1) -> the normed
        embedding `forward` reads, [T, hidden] in the compute dtype. Apart from `forward`:
        it depends on the token alone, so a drafter may keep it as a table."""
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
        """embed_input: [T, hidden] (`embed_input` of token t + 1's embedding), hidden:
        [T, hidden] (the target's final-normed hidden at t, or this layer's own output),
        cos, sin: [T, D/2] at t -> [T, hidden] in the compute dtype, after the final norm.
        Writes the T entries' K/V at `meta.slot_mapping` (`ops.prepare(meta)` done)."""
        e_h = torch.cat((embed_input, self.pre_fc_norm_hidden(hidden)), dim=-1)  # [T, 2 hidden]
        x = self.ops.linear(e_h, self.fc)
        # The residual stream in fp32, as in `DenseDecoder`: the layer adds to it unrounded.
        x = self.layer(x.float(), cos, sin, kv_store, meta)
        return self.norm(x)
