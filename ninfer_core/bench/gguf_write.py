"""Writing GGUF files as llama.cpp's `convert_hf_to_gguf.py` does, from Hugging Face names.

The pieces of a converter: llama.cpp's tensor names, Q/K rows permuted for Llama (so its
interleaved RoPE sees Hugging Face's half-split heads), the `{arch}.*` hyperparameters of a
`config.json`, and a byte-level BPE `tokenizer.json` as `tokenizer.ggml.*` keys. Used by
`ninfer_core.bench.peer_gguf` for real checkpoints and by the GGUF tests for tiny models.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ninfer_core.errors import NInferError

#: llama.cpp's converter reorders Q/K rows for these (`LlamaModel.permute`).
PERMUTED_QK = frozenset({"llama", "mistral"})
# `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)
NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4


_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf: str) -> str:
    """llama.cpp's name for a Hugging Face tensor (`model.layers.3.mlp.up_proj.weight` ->
    `blk.3.ffn_up.weight`)."""
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.<weight|bias>
    module = ".".join(parts[3:-1])
    if parts[:2] != ["model", "layers"] or module not in _BLOCK:
        raise NInferError(f"tensor {hf!r} has no llama.cpp name here")
    return f"blk.{parts[2]}.{_BLOCK[module]}.{parts[-1]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rotary halves interleaved row-wise."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# --------------------------------------------------------------------------
# Writing: hyperparameters, tensors, vocabulary
# --------------------------------------------------------------------------


def _rope_theta(config: Mapping[str, Any]) -> float:
    """Plain RoPE's base; scaled RoPE (llama3, yarn) is refused rather than dropped."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type", "default")
    if kind != "default":
        raise NInferError(f"rope scaling {kind!r} is not written here; only plain RoPE")
    return float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)


def add_hparams(w: Any, config: Mapping[str, Any]) -> None:
    """The `{arch}.*` keys llama.cpp's converter writes from a `config.json` dict."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads") or heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(_rope_theta(config))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])


def add_tensor(w: Any, name: str, a: np.ndarray, kind: Any) -> None:
    """`a` (float32) stored as ggml type `kind`: F32, F16, or quantized by gguf-py."""
    import gguf

    q = gguf.GGMLQuantizationType
    if kind == q.F32:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    elif kind == q.F16:
        w.add_tensor(name, a.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)


def add_weights(
    w: Any,
    arch: str,
    config: Mapping[str, Any],
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    matrices: Any = None,
    types: Mapping[str, Any] | None = None,
) -> None:
    """Hugging Face `(name, float32 array)` pairs under llama.cpp's names. Each is stored as
    `types[gguf name]` when given, else matrices as `matrices` (default F16, as the
    converter's `--outtype f16`) and vectors (norms, biases) as F32."""
    import gguf

    q = gguf.GGMLQuantizationType
    matrices = q.F16 if matrices is None else matrices
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for name, a in tensors:
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue  # llama.cpp writes no output.weight for a tied head
        if arch in PERMUTED_QK and ".q_proj." in name:
            a = permute(a, heads)
        if arch in PERMUTED_QK and ".k_proj." in name:
            a = permute(a, kv_heads)
        g = gguf_name(name)
        kind = types[g] if types and g in types else matrices if a.ndim == 2 else q.F32
        add_tensor(w, g, a, kind)


@dataclass
class Vocab:
    """A byte-level BPE vocabulary as `tokenizer.ggml.*` holds it."""

    tokens: list[str]
    types: list[int]
    merges: list[str]


def _looks_special(token: str) -> bool:
    """llama.cpp's `does_token_look_special` for the shapes that occur in BPE vocabularies."""
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def bpe_vocab(doc: Mapping[str, Any], size: int | None = None) -> Vocab:
    """A `tokenizer.json` (parsed) as tokens by id, their types and the merges; ids up to
    `size` (the model's vocabulary) the tokenizer lacks become `[PAD{id}]`, UNUSED, as
    llama.cpp's converter pads them."""
    model = doc["model"]
    if model.get("type") != "BPE":
        raise NInferError(f"tokenizer model {model.get('type')!r}: only BPE is written here")
    added = {t["id"]: t for t in doc.get("added_tokens", [])}
    by_id = {i: t for t, i in model["vocab"].items()}
    n = max(size or 0, 1 + max([*by_id, *added]))
    tokens, types = [], []
    for i in range(n):
        if i in added:
            text = added[i]["content"]
            special = added[i].get("special") or _looks_special(text)
            tokens.append(text)
            types.append(CONTROL if special else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return Vocab(tokens, types, merges)


def add_vocab(
    w: Any,
    vocab: Vocab,
    *,
    pre: str,
    bos: int | None,
    eos: int | None,
    pad: int | None = None,
    add_bos: bool = False,
    template: str | None = None,
) -> None:
    """The `tokenizer.*` keys of a GPT-2 style (byte-level BPE) vocabulary."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id),
                       (pad, w.add_pad_token_id)):  # fmt: skip
        if value is not None:
            add(value)
    w.add_add_bos_token(add_bos)
    if template:
        w.add_chat_template(template)


def write_file(w: Any) -> None:
    """Header, metadata and tensors to the writer's path, then close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
