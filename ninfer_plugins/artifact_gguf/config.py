"""A Hugging Face style `config.json` dict from a GGUF file's `{arch}.*` metadata.

The keys are llama.cpp's (`convert_hf_to_gguf.py` writes them from the original
`config.json`); the values are checked for type here and for range by the model family,
like any `config.json`.
"""

from __future__ import annotations

from typing import Any

from ninfer_plugins.artifact_gguf.file import GGUFFormatError
from ninfer_plugins.artifact_gguf.metadata import Metadata

#: `general.architecture` -> the transformers class a dense family builds.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: llama.cpp's converter reorders the rows of Q and K for these (`LlamaModel.permute`), to
#: rotate interleaved pairs; the reader puts them back in Hugging Face's half-split order.
PERMUTED_QK = frozenset({"llama", "mistral"})

#: `{arch}.rope.scaling.type` -> transformers' `rope_type`.
_ROPE_TYPES = {"linear": "linear", "yarn": "yarn"}


def architecture(meta: Metadata) -> str:
    """`general.architecture`, refused with the supported list when we do not build it."""
    arch = meta.str("general.architecture")
    if arch is None:
        raise GGUFFormatError("no general.architecture in the metadata")
    if arch not in ARCHITECTURES:
        raise GGUFFormatError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(sorted(ARCHITECTURES))
        )
    return arch


def _rope_scaling(meta: Metadata, arch: str) -> dict[str, Any] | None:
    kind = meta.str(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in _ROPE_TYPES:
        raise GGUFFormatError(f"{arch}.rope.scaling.type {kind!r} is not supported")
    scaling: dict[str, Any] = {
        "rope_type": _ROPE_TYPES[kind],
        "factor": meta.float(f"{arch}.rope.scaling.factor", 1.0),
    }
    original = meta.int(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    for key in ("beta_fast", "beta_slow"):
        value = meta.float(f"{arch}.rope.scaling.yarn_{key}")
        if value is not None:
            scaling[key] = value
    return scaling


def hf_config(
    meta: Metadata, arch: str, tensor_rows: dict[str, int], tokens: int | None
) -> dict[str, Any]:
    """The `config.json` dict for a supported `arch`.

    `tensor_rows`: rows of the GGUF tensors by GGUF name (`token_embd.weight`, ...), for what
    the metadata leaves to the tensors (vocabulary size, tied head, biases). `tokens`: the
    length of `tokenizer.ggml.tokens`, when present.
    """
    heads = meta.int(f"{arch}.attention.head_count")
    hidden = meta.int(f"{arch}.embedding_length")
    if heads is None or hidden is None:
        raise GGUFFormatError(f"{arch}.attention.head_count and .embedding_length are required")
    head_dim = meta.int(f"{arch}.attention.key_length")
    rotary = meta.int(f"{arch}.rope.dimension_count")
    if head_dim is None:
        head_dim = rotary if rotary is not None else (hidden // heads if heads else None)
    if rotary is not None and rotary != head_dim:
        raise GGUFFormatError(
            f"{arch}.rope.dimension_count={rotary} differs from the head size {head_dim}: "
            "partial rotary embeddings are not supported"
        )
    value_dim = meta.int(f"{arch}.attention.value_length")
    if value_dim is not None and value_dim != head_dim:
        raise GGUFFormatError(
            f"{arch}.attention.value_length={value_dim} differs from key_length={head_dim}"
        )
    vocab = meta.int(f"{arch}.vocab_size", tensor_rows.get("token_embd.weight") or tokens)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.int(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.int(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.float(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.int(f"{arch}.context_length", 4096),
        # llama.cpp writes no output.weight when the head is the embedding
        "tie_word_embeddings": "output.weight" not in tensor_rows,
        # what `load_tensor` hands out for quantized tensors (dequantized)
        "torch_dtype": "float32",
        "bos_token_id": meta.int("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.int("tokenizer.ggml.eos_token_id"),
    }
    if (pad := meta.int("tokenizer.ggml.padding_token_id")) is not None:
        config["pad_token_id"] = pad
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling
    if arch in ("llama", "mistral"):
        # Llama's attention_bias means q, k, v and o all have one
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_rows
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_rows
    if arch == "mistral" and (window := meta.int("mistral.attention.sliding_window")):
        config["sliding_window"] = window
    return config
