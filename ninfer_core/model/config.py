"""`ModelConfig`: the architecture facts the runtime needs, read from `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer_core.errors import ModelLoadError


@dataclass(frozen=True)
class ModelConfig:
    """A dense decoder-only transformer (Qwen3, Llama and Mistral-style)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: The `rope_scaling` / `rope_parameters` dict as found (None: plain RoPE).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    #: Qwen3 normalises q and k per head before RoPE.
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, qk_norm: bool, source: str = "config.json"):
        """Read a Hugging Face config; a missing or impossible field is a `ModelLoadError`."""

        def need(key: str) -> Any:
            if key not in raw:
                raise ModelLoadError(f"{source}: missing required field {key!r}")
            return raw[key]

        archs = raw.get("architectures") or [raw.get("model_type", "?")]
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        if (
            raw.get("sliding_window")
            and raw.get("use_sliding_window", True)
            and (raw.get("model_type") == "mistral")
        ):
            raise ModelLoadError(f"{source}: sliding-window attention is not supported yet")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = raw.get("rope_scaling")
        params = raw.get("rope_parameters")  # transformers >= 5 spelling
        rope_theta = raw.get("rope_theta")
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        return cls(
            architecture=str(archs[0]),
            model_type=str(raw.get("model_type", "")),
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=dict(raw),
        )
