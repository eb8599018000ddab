"""`ModelConfig`: the architecture facts the runtime needs, read from `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer_core.errors import ModelLoadError
from ninfer_core.model.config_fields import FieldReader

#: Upper bounds on the sizes a config may declare: each is several times the largest
#: published dense model's, and low enough that a hostile value fails here instead of
#: sizing a loop or an allocation (weights are also checked against the file's size).
LIMITS = {
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20,
    "num_layers": 1024,
    "num_heads": 1024,
    "head_dim": 1024,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24,
}


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
        """Read a Hugging Face config; a missing, mistyped, out-of-range or inconsistent
        field is a `ModelLoadError` naming it (see `LIMITS` for the ranges)."""
        f = FieldReader(raw, source)
        archs = raw.get("architectures") or [raw.get("model_type", "?")]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise f.fail("architectures", archs, "it must be a list of class names")
        hidden = f.int("hidden_size", 1, LIMITS["hidden_size"])
        heads = f.int("num_attention_heads", 1, LIMITS["num_heads"])
        kv_heads = f.int("num_key_value_heads", 1, heads, default=heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        if raw.get("head_dim") is None and hidden % heads:
            raise ModelLoadError(
                f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads="
                f"{heads}, and no head_dim is given"
            )
        head_dim = f.int("head_dim", 2, LIMITS["head_dim"], default=hidden // heads)
        if head_dim % 2:
            raise f.fail("head_dim", head_dim, "rotary embeddings need an even head_dim")
        if (
            raw.get("sliding_window")
            and raw.get("use_sliding_window", True)
            and (raw.get("model_type") == "mistral")
        ):
            raise ModelLoadError(f"{source}: sliding-window attention is not supported yet")
        vocab = f.int("vocab_size", 1, LIMITS["vocab_size"])
        rope_scaling = raw.get("rope_scaling")
        params = raw.get("rope_parameters")  # transformers >= 5 spelling
        for key, value in (("rope_scaling", rope_scaling), ("rope_parameters", params)):
            if value is not None and not isinstance(value, dict):
                raise f.fail(key, value, "it must be a JSON object or null")
        rope_theta = raw.get("rope_theta")
        if isinstance(params, dict):
            rope_theta = rope_theta if rope_theta is not None else params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        theta = FieldReader({"rope_theta": rope_theta}, source)
        return cls(
            architecture=archs[0] if archs else "?",
            model_type=f.text("model_type", ""),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.int("intermediate_size", 1, LIMITS["intermediate_size"]),
            num_layers=f.int("num_hidden_layers", 1, LIMITS["num_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", above=0.0, high=1.0, default=1e-6),
            rope_theta=theta.number("rope_theta", above=1.0, default=10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=f.int(
                "max_position_embeddings", 1, LIMITS["max_position_embeddings"], default=4096
            ),
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            qk_norm=qk_norm,
            attention_bias=f.flag("attention_bias", False),
            mlp_bias=f.flag("mlp_bias", False),
            torch_dtype=f.text("torch_dtype" if raw.get("torch_dtype") else "dtype", "bfloat16"),
            bos_token_id=(f.token_ids("bos_token_id", vocab) or (None,))[0],
            eos_token_ids=f.token_ids("eos_token_id", vocab),
            raw=dict(raw),
        )
