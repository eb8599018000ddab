"""`HybridConfig`: the Qwen3-Next / Qwen3.5 fields `ModelConfig` has no room for.

The runtime reads a `ModelConfig` (vocab, hidden size, attention heads, RoPE, eps ...),
so the family's `parse_config` still returns one: the KV pool's geometry is the full
attention layers' (`num_key_value_heads` x `head_dim`), exactly the dense fields. What
only this family needs (which layers are linear attention, the Gated DeltaNet sizes, the
partial rotary width, the experts) is read here from `ModelConfig.raw`, once when the
config is parsed (so a bad field fails before any weight exists) and again, identically,
when the model is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ninfer_core.errors import ModelLoadError
from ninfer_core.model.config import LIMITS, ModelConfig
from ninfer_core.model.config_fields import FieldReader
from ninfer_core.model.moe import MAX_EXPERTS, MoEConfig

LINEAR, FULL = "linear_attention", "full_attention"
#: Where a text-only checkpoint keeps the decoder (`Qwen3_5ForCausalLM` and
#: `Qwen3NextForCausalLM`'s `save_pretrained`), and where Qwen3.5's multimodal ones
#: (`Qwen3_5ForConditionalGeneration`, the Hub's) do; `lm_head.weight` is top-level in both.
TEXT_PREFIX, MULTIMODAL_PREFIX = "model.", "model.language_model."
#: transformers' `Qwen3NextConfig` default when `layer_types` is absent.
DEFAULT_FULL_ATTENTION_INTERVAL = 4


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """Sizes of a Gated DeltaNet layer (`linear_*` fields of the config)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q | k | v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.num_value_heads // self.num_key_heads


@dataclass(frozen=True)
class HybridConfig:
    """A Qwen3-Next or Qwen3.5 config: the shared `ModelConfig` plus the hybrid's own
    fields."""

    base: ModelConfig
    #: `LINEAR` or `FULL`, one per layer.
    layer_types: tuple[str, ...]
    linear: LinearAttentionConfig
    #: Leading dims of each attention head that RoPE rotates (`partial_rotary_factor`).
    rotary_dim: int
    #: None: every layer has a dense SwiGLU MLP (`num_experts` 0).
    moe: MoEConfig | None
    #: How a Gated DeltaNet layer's input projections are laid out in the checkpoint:
    #: grouped by key head in two fused matrices (Qwen3-Next's `in_proj_qkvz` /
    #: `in_proj_ba`), or flat in four (Qwen3.5's `in_proj_qkv`, `_z`, `_b`, `_a`). The
    #: architectures are otherwise the same, so this is the one switch between them.
    grouped_projections: bool = True
    #: Where the checkpoint names the decoder's tensors (`decoder_prefix`).
    prefix: str = TEXT_PREFIX

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer)

    def rope_config(self) -> ModelConfig:
        """The config `RotaryEmbedding` is built from: head_dim narrowed to the rotary
        width, and no partial factor left (`rope.inv_frequencies` refuses one). The
        frequencies are then transformers' `dim = int(head_dim * partial_rotary_factor)`."""
        base = self.base
        raw = {k: v for k, v in base.raw.items() if k != "partial_rotary_factor"}
        scaling = base.rope_scaling
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        return dataclasses.replace(base, head_dim=self.rotary_dim, rope_scaling=scaling, raw=raw)

    @classmethod
    def from_model_config(
        cls, base: ModelConfig, source: str = "config.json", *, grouped_projections: bool = True
    ) -> HybridConfig:
        """Read and check the hybrid fields of `base.raw`; a missing, mistyped or
        inconsistent one is a `ModelLoadError` naming it. `grouped_projections` is the
        family's, not the config's (see the field)."""
        raw = base.raw
        f = FieldReader(raw, source)
        layer_types = _layer_types(raw, f, base.num_layers, source)
        heads_limit = LIMITS["num_heads"]
        k_heads = f.int("linear_num_key_heads", 1, heads_limit)
        v_heads = f.int("linear_num_value_heads", 1, heads_limit)
        if v_heads % k_heads:
            raise ModelLoadError(
                f"{source}: linear_num_value_heads={v_heads} is not a multiple of "
                f"linear_num_key_heads={k_heads}"
            )
        linear = LinearAttentionConfig(
            num_key_heads=k_heads,
            num_value_heads=v_heads,
            key_head_dim=f.int("linear_key_head_dim", 1, LIMITS["head_dim"]),
            value_head_dim=f.int("linear_value_head_dim", 1, LIMITS["head_dim"]),
            conv_kernel=f.int("linear_conv_kernel_dim", 2, 64, default=4),
        )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise f.fail("hidden_act", act, "only silu is supported")
        partial = _partial_rotary_factor(raw, source)
        rotary_dim = int(base.head_dim * partial)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ModelLoadError(
                f"{source}: partial_rotary_factor={partial} gives an odd or empty rotary "
                f"width {rotary_dim} of head_dim={base.head_dim}"
            )
        experts = raw.get("num_experts", 0)
        moe = MoEConfig.from_hf(raw, source) if experts else None
        prefix = decoder_prefix(raw)
        return cls(base, layer_types, linear, rotary_dim, moe, grouped_projections, prefix)


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model as a flat text config: `text_config`'s fields
    over the top level's, the vision tower's left out. `architectures` and
    `tie_word_embeddings` stay the top level's: transformers ties the head by the
    composite model's config. A text-only config is returned as it is."""
    text = raw.get("text_config")
    if text is None:
        return raw
    if not isinstance(text, dict):
        raise ModelLoadError("config.json: text_config must be an object")
    top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    kept = {k: raw[k] for k in ("architectures", "tie_word_embeddings") if k in raw}
    return {**top, **text, **kept}


def decoder_prefix(raw: dict[str, Any]) -> str:
    """The decoder's tensor prefix, from the config alone (the memory plan sizes weights
    before any artifact is opened): a `...ForConditionalGeneration` checkpoint nests the
    language model under `model.language_model.`."""
    archs = raw.get("architectures") or []
    multimodal = any(str(a).endswith("ForConditionalGeneration") for a in archs)
    return MULTIMODAL_PREFIX if multimodal else TEXT_PREFIX


def with_mlp_width(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw`, with `intermediate_size` filled in when an all-MoE config (Qwen3.5-MoE)
    leaves it out: `ModelConfig` requires it, and the workspace estimate reads it as the
    widest MLP activation of a token, which is then its k routed experts' rows or the
    shared expert's. The decoder builds no dense MLP from it (no layer is dense)."""
    some_dense = raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1
    if "intermediate_size" in raw or not raw.get("num_experts") or some_dense:
        return raw  # a dense layer needs the real width: ModelConfig will ask for it
    f = FieldReader(raw, "config.json")
    routed = f.int("num_experts_per_tok", 1, MAX_EXPERTS) * f.int(
        "moe_intermediate_size", 1, LIMITS["intermediate_size"]
    )
    shared = f.int("shared_expert_intermediate_size", 0, LIMITS["intermediate_size"], default=0)
    return {**raw, "intermediate_size": max(routed, shared)}


def _layer_types(raw: dict[str, Any], f: FieldReader, layers: int, source: str) -> tuple[str, ...]:
    """`layer_types` as given, else every `full_attention_interval`-th layer full (as
    transformers' config fills it in)."""
    given = raw.get("layer_types")
    if given is None:
        every = f.int("full_attention_interval", 1, layers, default=DEFAULT_FULL_ATTENTION_INTERVAL)
        return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(layers))
    if not isinstance(given, list) or any(t not in (LINEAR, FULL) for t in given):
        raise f.fail("layer_types", given, f"it must be a list of {LINEAR!r} / {FULL!r}")
    if len(given) != layers:
        raise f.fail("layer_types", given, f"it must name num_hidden_layers={layers} layers")
    if FULL not in given:
        raise f.fail("layer_types", given, "the KV pool needs at least one full_attention layer")
    return tuple(given)


def _partial_rotary_factor(raw: dict[str, Any], source: str) -> float:
    """Where transformers 5 keeps it (`rope_parameters`), else the top-level field."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return FieldReader({"partial_rotary_factor": value}, source).number(
        "partial_rotary_factor", above=0.0, high=1.0
    )
