"""Rotary position embeddings, including the scaling types real configs use.

Formulas follow Hugging Face `modeling_rope_utils` (the reference our parity tests
compare against): `default`, `linear`, `dynamic` (NTK), `yarn` and `llama3`.

cos/sin are not kept as a `[max_positions, D]` table: they are computed for the
step's positions once per forward (`T x D/2` multiplies, before the layer loop),
exactly as transformers does, so long-context models pay no table memory and any
position is valid. Only the half-width `[T, D/2]` is produced; `apply_rope` pairs
dimension i with i + D/2.

`dynamic` scaling: transformers grows the NTK base with the longest position seen
at run time, which re-rotates nothing already cached. A paged cache needs one fixed
rotation, so we precompute it for `context_len` (the longest context the engine
serves; default `max_position_embeddings`). That equals transformers for every
sequence that stays within `max_position_embeddings` (the base is unscaled there),
and for a prefill of exactly `context_len` tokens; vLLM makes the same choice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ninfer_core.errors import ModelLoadError
from ninfer_core.model.config import LIMITS, ModelConfig
from ninfer_core.model.config_fields import FieldReader

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    # inv_freq: [dim / 2], fp32, the same op order as transformers for bitwise parity.
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def inv_frequencies(
    config: ModelConfig, context_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] fp32, attention_scaling) for this config's RoPE variant.

    `attention_scaling` multiplies cos and sin (YaRN's mscale; 1.0 otherwise). Every
    scaling parameter is type- and range-checked first: a `factor` of 0 or a negative one
    would otherwise turn every position's rotation into inf or NaN.
    """
    scaling = dict(config.rope_scaling or {})
    rope_type = rope_type_of(scaling)
    key = "rope_scaling" if config.raw.get("rope_scaling") else "rope_parameters"
    f = FieldReader(scaling, "config.json", prefix=f"{key}.")
    top = FieldReader(config.raw, "config.json")
    partial = f.get("partial_rotary_factor", top.get("partial_rotary_factor", 1.0))
    partial = FieldReader({"partial_rotary_factor": partial}, "config.json").number(
        "partial_rotary_factor", above=0.0, high=1.0
    )
    if partial != 1.0:
        raise ModelLoadError(f"config.json: partial_rotary_factor={partial} is not supported yet")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    dim, base = config.head_dim, config.rope_theta
    max_pos = config.max_position_embeddings
    original = f.get("original_max_position_embeddings", None)
    original_max = (
        FieldReader({"original_max_position_embeddings": original}, "config.json", f"{key}.")
        if original is not None
        else top
    ).int("original_max_position_embeddings", 1, LIMITS["max_position_embeddings"], max_pos)

    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / f.number("factor", above=0.0), 1.0
    if rope_type == "dynamic":
        factor = f.number("factor", above=0.0)
        if dim <= 2:
            raise ModelLoadError("config.json: dynamic RoPE scaling needs head_dim above 2")
        seq_len = max(context_len or max_pos, max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, dim, f, original_max), 1.0
    return _yarn_inv_freq(base, dim, f, max_pos, original_max)


def check_rope(config: ModelConfig) -> None:
    """Refuse a RoPE configuration whose frequencies or scaling are not finite and positive;
    run at config time, so a bad config fails before any weight is allocated."""
    inv_freq, attention = inv_frequencies(config)
    if not (bool(torch.isfinite(inv_freq).all()) and math.isfinite(attention) and attention > 0):
        raise ModelLoadError(
            f"config.json: rope_theta={config.rope_theta} with rope_scaling "
            f"{config.rope_scaling} gives non-finite rotary frequencies"
        )


def _llama3_inv_freq(base: float, dim: int, f: FieldReader, old_context: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    inv_freq = _base_inv_freq(base, dim)
    factor = f.number("factor", above=0.0)
    low = f.number("low_freq_factor", above=0.0)
    high = f.number("high_freq_factor", above=low)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, f: FieldReader, max_pos: int, original_max: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between."""
    factor = f.number("factor", above=0.0, default=max_pos / original_max)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if f.get("attention_factor", None) is not None:
        attention = f.number("attention_factor", above=0.0)
    else:
        m = f.number("mscale", above=-math.inf, default=0.0)
        m_all = f.number("mscale_all_dim", above=-math.inf, default=0.0)
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = f.number("beta_fast", above=0.0, default=32.0) if f.get("beta_fast", 0) else 32
    beta_slow = f.number("beta_slow", above=0.0, default=1.0) if f.get("beta_slow", 0) else 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if f.flag("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: high frequency, extrapolate unchanged
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


class RotaryEmbedding(nn.Module):
    """Maps positions to the (cos, sin) halves `apply_rope` consumes."""

    def __init__(
        self,
        config: ModelConfig,
        context_len: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = inv_frequencies(config, context_len)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, D/2] in `dtype` (computed in fp32, like transformers)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
