"""`DenseDecoder`: a Qwen3 / Llama / Mistral-style decoder-only transformer over a paged cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ninfer_core.model.config import ModelConfig
from ninfer_core.model.decode_graph import dense_decode_graph
from ninfer_core.model.layers import (
    DecoderLayer,
    RMSNorm,
    embed_rows,
    empty_param,
    held_bytes,
    pack_params,
    pack_weight,
)
from ninfer_core.model.ops import KernelOps
from ninfer_core.model.rope import RotaryEmbedding
from ninfer_core.model.verify_graph import dense_verify_graph
from ninfer_core.quant.tensor import QuantizedTensor

if TYPE_CHECKING:
    from ninfer_core.model.attention_meta import AttentionMetadata


class DenseDecoder(nn.Module):
    """Token ids in, final hidden states out; `compute_logits` is separate so the
    runner projects only the rows it samples from (the last token of each sequence)."""

    #: Its MTP layer, when the artifact has one, is a dense decoder layer (the `mtp`
    #: draft strategy's default `MTPLayerKind`).
    mtp_layer = None

    def __init__(
        self,
        config: ModelConfig,
        ops: KernelOps,
        dtype: torch.dtype,
        context_len: int | None = None,
    ) -> None:
        super().__init__()
        self.config, self.ops, self.dtype = config, ops, dtype
        dev, vocab, hidden = ops.device, config.vocab_size, config.hidden_size
        self.embed_tokens = empty_param(vocab, hidden, dtype=dtype, device=dev)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, ops, dtype) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        # Tied: the head is the embedding matrix itself, not a copy.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else empty_param(vocab, hidden, dtype=dtype, device=dev)
        )
        self.rotary = RotaryEmbedding(config, context_len, dev)

        #: The head as the kernel backend packed it (see `pack_weights`), or None.
        self.packed_head = None

    @property
    def head_weight(self) -> torch.Tensor | QuantizedTensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def weight_bytes(self) -> int:
        return held_bytes(self)

    def pack_weights(self) -> None:
        """Hand every projection to the backend's `pack_linear`, once, after loading.

        A tied head is packed as its own copy: the embedding lookup needs the plain
        matrix, the head GEMM the packed one.
        """
        owners = [
            (module, name)
            for layer in self.layers
            for module, name in (
                (layer.self_attn, "qkv_proj"),
                (layer.self_attn, "o_proj"),
                (layer.mlp, "gate_up_proj"),
                (layer.mlp, "down_proj"),
            )
        ]
        pack_params(owners, self.ops, self.dtype)
        packed = pack_weight(self.ops, self.head_weight, self.dtype)
        if packed is not self.head_weight:
            self.packed_head = packed
            if self.lm_head is not None:  # untied: the packed head replaces the plain one
                self._parameters.pop("lm_head", None)
                self.lm_head = packed

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_store,
        states=None,
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]; `states` is unused: every
        # layer keeps paged K/V (`dense_caches`)
        self.ops.prepare(meta)
        cos, sin = self.rotary(positions, self.dtype)  # cos, sin: [T, D/2], once per step
        # The residual stream stays in fp32 whatever the compute dtype: each layer adds
        # its output to it without rounding it to bf16 (30 roundings of the stream were
        # the largest part of bf16's error against fp32, and flipped SmolLM2's near-tied
        # greedy answers). The norms hand the GEMMs the compute dtype; no op is added.
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_store, meta)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> the residual stream's first values [T, hidden], fp32."""
        return embed_rows(self.embed_tokens, input_ids)

    def decode_graph(self, input_ids, positions, kv_store, block_table, context):
        """One decode token per sequence, capturable whole (`model/decode_graph.py`)."""
        return dense_decode_graph(self, input_ids, positions, kv_store, block_table, context)

    def verify_graph(self, input_ids, positions, kv_store, block_table, context, width: int):
        """A speculative round's `width` rows per sequence, capturable whole, each row as
        `decode_graph` computes it alone (`model/verify_graph.py`)."""
        return dense_verify_graph(self, input_ids, positions, kv_store, block_table, context, width)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] fp32 (the GEMM runs in the model dtype)
        head = self.packed_head if self.packed_head is not None else self.head_weight
        return self.ops.linear(hidden, head).float()
