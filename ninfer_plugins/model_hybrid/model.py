"""`HybridDecoder`: Qwen3-Next / Qwen3.5, Gated DeltaNet layers between gated full
attention ones.

Each decoder layer is pre-norm, `x + mixer(norm(x))` then `h + mlp(norm(h))`, the mixer
a `GatedDeltaNet` or a `GatedAttention` (`HybridConfig.layer_types`), the MLP a
`SparseMoE` on sparse layers and a dense SwiGLU otherwise. The residual stream stays in
fp32 whatever the compute dtype, as in the dense decoder.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ninfer_core.model.layers import embed_rows, empty_param, held_bytes, pack_params, pack_weight
from ninfer_core.model.moe import SparseMoE, SwiGLU, moe_slots
from ninfer_core.model.ops import KernelOps
from ninfer_core.model.rope import RotaryEmbedding
from ninfer_core.model.weights import WeightSlot
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_plugins.model_hybrid.config import HybridConfig
from ninfer_plugins.model_hybrid.graph import hybrid_graph
from ninfer_plugins.model_hybrid.layers import GatedAttention, GatedDeltaNet, ZeroCentredRMSNorm

if TYPE_CHECKING:
    from ninfer_core.kv.state import StepStates
    from ninfer_core.model.attention_meta import AttentionMetadata
    from ninfer_core.plugin_types import MTPLayerKind


class HybridLayer(nn.Module):
    """One decoder layer: a token mixer (linear or full attention), then the MLP."""

    def __init__(
        self,
        config: HybridConfig,
        layer: int,
        kv_index: int | None,
        ops: KernelOps,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        base = config.base
        h, eps = base.hidden_size, base.rms_norm_eps
        self.input_layernorm = ZeroCentredRMSNorm(h, eps, ops, dtype)
        self.post_attention_layernorm = ZeroCentredRMSNorm(h, eps, ops, dtype)
        self.linear_attn = GatedDeltaNet(config, layer, ops, dtype) if kv_index is None else None
        self.self_attn = None if kv_index is None else GatedAttention(config, kv_index, ops, dtype)
        self.mlp: nn.Module = (
            SparseMoE(config.moe, h, ops, dtype)
            if config.is_sparse(layer)
            else SwiGLU(h, base.intermediate_size, ops, dtype)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_store,
        meta: AttentionMetadata,
        states: StepStates | None,
        cu_seqlens: list[int],
    ) -> torch.Tensor:
        y = self.input_layernorm(x)
        if self.linear_attn is not None:
            if states is None:
                raise ValueError("a Gated DeltaNet layer needs the batch's sequence states")
            mixed = self.linear_attn(y, states, cu_seqlens)
        else:
            mixed = self.self_attn(y, cos, sin, kv_store, meta)
        h = x + mixed
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridDecoder(nn.Module):
    """Token ids in, final hidden states out; `compute_logits` projects the chosen rows."""

    def __init__(
        self,
        config: HybridConfig,
        ops: KernelOps,
        dtype: torch.dtype,
        context_len: int | None = None,
        mtp_layer: MTPLayerKind | None = None,
    ) -> None:
        super().__init__()
        base = config.base
        self.config, self.hybrid, self.ops, self.dtype = base, config, ops, dtype
        #: The family's MTP layer (`CausalLM.mtp_layer`), for a draft strategy that has
        #: only this model; None: built outside the family, and no MTP layer offered.
        self.mtp_layer = mtp_layer
        dev, vocab, hidden = ops.device, base.vocab_size, base.hidden_size
        self.embed_tokens = empty_param(vocab, hidden, dtype=dtype, device=dev)
        # Full-attention layers are numbered in the KV pool in layer order
        # (`ModelCaches.kv_index`); a linear layer gets None.
        full = [i for i in range(base.num_layers) if not config.is_linear(i)]
        self.layers = nn.ModuleList(
            HybridLayer(config, i, full.index(i) if i in full else None, ops, dtype)
            for i in range(base.num_layers)
        )
        self.norm = ZeroCentredRMSNorm(hidden, base.rms_norm_eps, ops, dtype)
        self.lm_head = (
            None
            if base.tie_word_embeddings
            else empty_param(vocab, hidden, dtype=dtype, device=dev)
        )
        self.rotary = RotaryEmbedding(config.rope_config(), context_len, dev)
        #: The head as the kernel backend packed it (see `pack_weights`), or None.
        self.packed_head: Any = None

    @property
    def head_weight(self) -> torch.Tensor | QuantizedTensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_store,
        states: StepStates | None = None,
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden]
        self.ops.prepare(meta)
        cos, sin = self.rotary(positions, self.dtype)  # [T, rotary_dim / 2]
        # Host offsets from the host query lengths: the state ops slice by them, no sync.
        cu_seqlens = list(accumulate(meta.query_lens, initial=0))
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_store, meta, states, cu_seqlens)
        return self.norm(x)

    def decode_graph(
        self, input_ids, positions, kv_store, block_table, context, state_pool=None,
        state_rows=None,
    ):  # fmt: skip
        """One decode token per sequence, capturable whole (`graph.py`): logits, the
        attention layers' K/V, and the Gated DeltaNet layers' new states."""
        hidden, keys, values, *states = hybrid_graph(
            self, input_ids, positions, kv_store, block_table, context, 1, state_pool, state_rows
        )
        return self.compute_logits(hidden), keys, values, *states

    def verify_graph(
        self, input_ids, positions, kv_store, block_table, context, width: int,
        state_pool=None, state_rows=None,
    ):  # fmt: skip
        """A speculative round's `width` rows a sequence, each computed as `decode_graph`
        computes it alone; the states come back as after the sequence's real rows."""
        hidden, keys, values, *states = hybrid_graph(
            self, input_ids, positions, kv_store, block_table, context, width, state_pool,
            state_rows,
        )  # fmt: skip
        return self.compute_logits(hidden), hidden, keys, values, *states

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> the residual stream's first values [T, hidden], fp32."""
        return embed_rows(self.embed_tokens, input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] fp32
        head = self.packed_head if self.packed_head is not None else self.head_weight
        return self.ops.linear(hidden, head).float()

    def pack_weights(self) -> None:
        """Once after loading: every projection through the backend's `pack_linear`
        (the experts by `SparseMoE.pack_weights`), and each zero-centred norm's `1 + w`."""
        finalize_norms(self)
        for layer in self.layers:
            pack_layer(layer, self.ops, self.dtype)
        packed = pack_weight(self.ops, self.head_weight, self.dtype)
        if packed is not self.head_weight:
            self.packed_head = packed
            if self.lm_head is not None:
                self._parameters.pop("lm_head", None)
                self.lm_head = packed

    def weight_bytes(self) -> int:
        return held_bytes(self)


def finalize_norms(module: nn.Module) -> None:
    """Once after loading: each zero-centred norm's fp32 `1 + w` (`ZeroCentredRMSNorm`)."""
    for sub in module.modules():
        if isinstance(sub, ZeroCentredRMSNorm):
            sub.finalize()


def pack_layer(layer: HybridLayer, ops: KernelOps, dtype: torch.dtype) -> None:
    """Once after loading: a layer's projections through the backend's `pack_linear`
    (the experts by `SparseMoE.pack_weights`)."""
    mixer = layer.linear_attn if layer.linear_attn is not None else layer.self_attn
    names = (
        ("in_proj_qkvz", "in_proj_ba", "out_proj")
        if layer.linear_attn is not None
        else ("qkv_proj", "o_proj")
    )
    owners = [(mixer, n) for n in names]
    if isinstance(layer.mlp, SparseMoE):
        layer.mlp.pack_weights()
    else:
        owners += [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
    pack_params(owners, ops, dtype)


def weight_plan(config: HybridConfig) -> list[WeightSlot]:
    """Every tensor a Qwen3-Next / Qwen3.5 checkpoint must provide, and the parameter it
    fills; the decoder's tensors are named under `config.prefix`. `mtp.*` (the multi-token
    prediction head) and a multimodal checkpoint's `model.visual.*` are not listed."""
    base, prefix = config.base, config.prefix
    h, v = base.hidden_size, base.vocab_size
    plan = [WeightSlot(prefix + "embed_tokens.weight", "embed_tokens", 0, (v, h))]
    for n in range(base.num_layers):
        hf, ours = f"{prefix}layers.{n}.", f"layers.{n}."
        plan += layer_slots(
            config, hf, ours, linear=config.is_linear(n), sparse=config.is_sparse(n)
        )
    plan.append(norm_slot(prefix + "norm.weight", "norm.weight", h))
    if not base.tie_word_embeddings:
        plan.append(WeightSlot("lm_head.weight", "lm_head", 0, (v, h)))
    return plan


def layer_slots(
    config: HybridConfig, hf: str, ours: str, *, linear: bool, sparse: bool
) -> list[WeightSlot]:
    """The tensors of one decoder layer (a Gated DeltaNet or gated attention mixer, a
    `SparseMoE` or dense MLP), named under `hf` in the checkpoint and filling the
    `HybridLayer` whose parameters are named under `ours`. Shared with the MTP layer
    (`mtp.py`): full attention under `mtp.layers.0.`, whatever the decoder's layer 0 is."""
    base, h = config.base, config.base.hidden_size
    plan = [
        norm_slot(hf + "input_layernorm.weight", ours + "input_layernorm.weight", h),
        norm_slot(
            hf + "post_attention_layernorm.weight", ours + "post_attention_layernorm.weight", h
        ),
    ]
    if linear:
        plan += _linear_slots(config, hf + "linear_attn.", ours + "linear_attn.")
    else:
        plan += _attention_slots(config, hf + "self_attn.", ours + "self_attn.")
    if sparse:
        plan += moe_slots(config.moe, h, hf + "mlp.", ours + "mlp.")
    else:
        i = base.intermediate_size
        plan += [
            WeightSlot(hf + "mlp.gate_proj.weight", ours + "mlp.gate_up_proj", 0, (i, h)),
            WeightSlot(hf + "mlp.up_proj.weight", ours + "mlp.gate_up_proj", i, (i, h)),
            WeightSlot(hf + "mlp.down_proj.weight", ours + "mlp.down_proj", 0, (h, i)),
        ]
    return plan


def norm_slot(hf_name: str, param: str, size: int) -> WeightSlot:
    """A zero-centred norm's weight: held in fp32 whatever the compute dtype
    (`ZeroCentredRMSNorm.HELD_DTYPE`), as the memory plan must count it."""
    return WeightSlot(hf_name, param, 0, (size,), ZeroCentredRMSNorm.HELD_DTYPE)


def planned_weights(config: HybridConfig) -> int:
    """How many weights `weight_plan` lists, by arithmetic on the config alone: a hostile
    config (1024 layers of 4096 experts) is refused against the file's size before a
    plan of millions of slots is built."""
    base, c = config.base, config.linear
    h, q, kv = base.hidden_size, base.q_size, base.kv_size
    linear = (
        (2 * c.key_dim + 2 * c.value_dim) * h
        + 2 * c.num_value_heads * h
        + c.conv_dim * c.conv_kernel
        + 2 * c.num_value_heads
        + c.value_head_dim
        + h * c.value_dim
    )
    full = 2 * q * h + 2 * kv * h + h * q + 2 * base.head_dim
    total = (1 if base.tie_word_embeddings else 2) * base.vocab_size * h + h
    for n in range(base.num_layers):
        total += 2 * h + (linear if config.is_linear(n) else full)
        if config.is_sparse(n):
            moe = config.moe
            total += moe.num_experts * (h + 3 * moe.moe_intermediate_size * h)
            if moe.shared_expert_intermediate_size:
                total += 3 * moe.shared_expert_intermediate_size * h + h
        else:
            total += 3 * base.intermediate_size * h
    return total


def _linear_slots(config: HybridConfig, hf: str, ours: str) -> list[WeightSlot]:
    c, h = config.linear, config.base.hidden_size
    hv = c.num_value_heads
    return [
        *_in_proj_slots(config, hf, ours),
        WeightSlot(hf + "conv1d.weight", ours + "conv1d_weight", 0, (c.conv_dim, 1, c.conv_kernel)),
        WeightSlot(hf + "dt_bias", ours + "dt_bias", 0, (hv,), GatedDeltaNet.DECAY_DTYPE),
        WeightSlot(hf + "A_log", ours + "A_log", 0, (hv,), GatedDeltaNet.DECAY_DTYPE),
        WeightSlot(hf + "norm.weight", ours + "norm_weight", 0, (c.value_head_dim,)),
        WeightSlot(hf + "out_proj.weight", ours + "out_proj", 0, (h, c.value_dim)),
    ]


def _in_proj_slots(config: HybridConfig, hf: str, ours: str) -> list[WeightSlot]:
    """The Gated DeltaNet's input projections, in the two matrices `GatedDeltaNet` keeps
    either way: Qwen3-Next stores them so (grouped by key head), Qwen3.5 as four flat
    ones that land q|k|v then z, and b then a, in those rows."""
    c, h = config.linear, config.base.hidden_size
    hv, qkvz, ba = c.num_value_heads, ours + "in_proj_qkvz", ours + "in_proj_ba"
    if config.grouped_projections:
        return [
            WeightSlot(hf + "in_proj_qkvz.weight", qkvz, 0, (2 * c.key_dim + 2 * c.value_dim, h)),
            WeightSlot(hf + "in_proj_ba.weight", ba, 0, (2 * hv, h)),
        ]
    return [
        WeightSlot(hf + "in_proj_qkv.weight", qkvz, 0, (c.conv_dim, h)),
        WeightSlot(hf + "in_proj_z.weight", qkvz, c.conv_dim, (c.value_dim, h)),
        WeightSlot(hf + "in_proj_b.weight", ba, 0, (hv, h)),
        WeightSlot(hf + "in_proj_a.weight", ba, hv, (hv, h)),
    ]


def _attention_slots(config: HybridConfig, hf: str, ours: str) -> list[WeightSlot]:
    base, h = config.base, config.base.hidden_size
    q, kv, d = base.q_size, base.kv_size, base.head_dim
    return [
        # q_proj: per head, the query rows then the gate rows (2 * head_dim).
        WeightSlot(hf + "q_proj.weight", ours + "qkv_proj", 0, (2 * q, h)),
        WeightSlot(hf + "k_proj.weight", ours + "qkv_proj", 2 * q, (kv, h)),
        WeightSlot(hf + "v_proj.weight", ours + "qkv_proj", 2 * q + kv, (kv, h)),
        WeightSlot(hf + "o_proj.weight", ours + "o_proj", 0, (h, q)),
        norm_slot(hf + "q_norm.weight", ours + "q_norm.weight", d),
        norm_slot(hf + "k_norm.weight", ours + "k_norm.weight", d),
    ]
