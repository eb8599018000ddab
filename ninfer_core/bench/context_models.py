"""The two random-weight models of `ninfer bench context`: a Qwen3-Next-shaped hybrid and
a dense Qwen3 of about its size.

What the benchmark compares is how each architecture's cost grows with the context (the
hybrid's Gated DeltaNet layers keep a fixed-size state, its few full-attention layers and
every layer of the dense model read a KV cache as long as the context), which depends on
the shapes, not on what the weights learned. Both are written as plain Hugging Face
folders (bf16 safetensors and `config.json`, written directly: transformers is not
needed) with the built-in model's byte-level tokenizer, and reused while their
`config.json` is unchanged. The dense weights come from the benchmark checkpoint's
generator (`checkpoint.state_dict`); the hybrid's are drawn here the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ninfer_core.bench import checkpoint
from ninfer_core.builtin_model import (
    SPECIAL_TOKENS,
    TOKENIZER_CONFIG,
    builtin_model_dir,
    byte_tokenizer_json,
)
from ninfer_core.errors import NInferError

#: The longest context either model accepts (`max_position_embeddings`).
MAX_POSITIONS = 131072
#: The built-in byte-level tokenizer's vocabulary: a small head, so that the layers (whose
#: cost is what moves with the context) are most of a step.
VOCAB = 256 + len(SPECIAL_TOKENS)


@dataclass(frozen=True)
class Shape:
    """One `--size`: the hidden width and depth both models share, each one's attention.

    The hybrid keeps Qwen3-Next's proportions: one full-attention layer in four (gated
    queries, few KV heads, a quarter of each head rotated), and Gated DeltaNet layers
    with twice as many value heads as key heads. The dense model has Qwen3's layout with
    the same width and depth, so the two differ in the attention layers alone."""

    hidden: int
    intermediate: int
    layers: int
    #: Full attention (both models): query heads, KV heads, head width.
    heads: int
    kv_heads: int
    head_dim: int
    #: The hybrid's Gated DeltaNet: key heads (value heads are twice as many), head width.
    linear_key_heads: int
    linear_head_dim: int


SIZES = {
    "tiny": Shape(64, 128, 4, 2, 1, 32, 1, 32),
    "small": Shape(256, 768, 8, 4, 2, 64, 2, 64),
    "medium": Shape(512, 1536, 12, 8, 2, 64, 4, 64),
}


def dense_config(shape: Shape) -> dict[str, Any]:
    """A Qwen3 `config.json` of `shape` (the benchmark checkpoint's keys)."""
    return {
        **checkpoint.CONFIG,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "max_window_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": VOCAB,
        "bos_token_id": None,
        "eos_token_id": 256 + 2,
        "max_position_embeddings": MAX_POSITIONS,
    }


def hybrid_config(shape: Shape) -> dict[str, Any]:
    """A `Qwen3NextForCausalLM` `config.json` of `shape`, dense MLPs (no experts): the
    keys the hybrid family reads (`ninfer_plugins/model_hybrid/config.py`)."""
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(shape.layers)
    ]
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "layer_types": layer_types,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": shape.linear_key_heads,
        "linear_num_value_heads": 2 * shape.linear_key_heads,
        "linear_key_head_dim": shape.linear_head_dim,
        "linear_value_head_dim": shape.linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": VOCAB,
        "bos_token_id": None,
        "eos_token_id": 256 + 2,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": checkpoint.INIT_STD,
        "torch_dtype": "bfloat16",
    }


def hybrid_state_dict(
    config: dict[str, Any], seed: int = checkpoint.SEED
) -> dict[str, torch.Tensor]:
    """The hybrid's tensors (bf16), under the names `Qwen3NextForCausalLM` saves: matrices
    drawn like the dense checkpoint's, the zero-centred norms (`1 + w`) zero, the gated
    norm one, and the decays as transformers initialises them (A uniform in (0, 16))."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = hk * config["linear_key_head_dim"], hv * config["linear_value_head_dim"]
    conv_dim, width = 2 * key_dim + value_dim, config["linear_conv_kernel_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * checkpoint.INIT_STD).to(torch.bfloat16)

    def full(n: int, value: float) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.bfloat16)

    out = {"model.embed_tokens.weight": rand(config["vocab_size"], h)}
    for n, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{n}."
        out |= {p + "input_layernorm.weight": full(h, 0.0),
                p + "post_attention_layernorm.weight": full(h, 0.0)}  # fmt: skip
        if kind == "linear_attention":
            a = torch.empty(hv).uniform_(1e-3, 16.0, generator=gen)
            out |= {
                p + "linear_attn.in_proj_qkvz.weight": rand(2 * key_dim + 2 * value_dim, h),
                p + "linear_attn.in_proj_ba.weight": rand(2 * hv, h),
                p + "linear_attn.conv1d.weight": rand(conv_dim, 1, width),
                p + "linear_attn.dt_bias": full(hv, 1.0),
                p + "linear_attn.A_log": a.log().to(torch.bfloat16),
                p + "linear_attn.norm.weight": full(config["linear_value_head_dim"], 1.0),
                p + "linear_attn.out_proj.weight": rand(h, value_dim),
            }
        else:
            out |= {
                p + "self_attn.q_proj.weight": rand(2 * q, h),  # queries and their gates
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, q),
                p + "self_attn.q_norm.weight": full(d, 0.0),
                p + "self_attn.k_norm.weight": full(d, 0.0),
            }
        out |= {
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
    out["model.norm.weight"] = full(h, 0.0)
    return out


def write_folder(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """`config.json`, the byte-level tokenizer and `model.safetensors` into `path`, through
    `checkpoint.model_folder` (renamed into place last, never over a folder of other files)."""
    from safetensors.torch import save_file

    taken = f"{path}: exists and is not a benchmark model; pick another --out"
    with checkpoint.model_folder(path, taken=taken) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return path


def ensure_models(size: str, out: Path | None = None) -> dict[str, Path]:
    """`{"hybrid": folder, "dense": folder}` for `size`, written unless already there
    with the same config (under `out`, default beside the built-in model's cache)."""
    if size not in SIZES:
        raise NInferError(f"--size {size}: expected one of {', '.join(SIZES)}")
    shape = SIZES[size]
    base = Path(out) if out else builtin_model_dir().parent / "bench-context"
    made = {}
    for name, config, draw in (
        ("hybrid", hybrid_config(shape), hybrid_state_dict),
        ("dense", dense_config(shape), checkpoint.state_dict),
    ):
        path = base / f"{name}-{size}"
        if not checkpoint.is_current(path, config):
            write_folder(path, config, draw(config))
        made[name] = path
    return made
