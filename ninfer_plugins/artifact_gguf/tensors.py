"""GGUF tensors under the Hugging Face names the dense family loads, in torch's layout.

* Names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ... (`hf_name`).
* Shapes: ggml lists dims contiguous-first (`[cols, rows]`); torch's order is the reverse.
* Rows: llama.cpp's converter permutes the rows of Q and K of Llama-style models
  (`LlamaModel.permute`: each head's two rotary halves interleaved); `unpermute` undoes it.
* Types: F32, F16 and BF16 load as they are stored. A 2-D Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0
  matrix can stay in its blocks as a `QuantizedTensor` of ours (Q4G32, Q4G32M, Q5G32,
  Q5G32M, W8G32: the same values; IQ4_NL's indices as IQ4G32), and a Q2_K .. Q6_K or
  IQ4_XS one in its codes (Q2G16M, Q3G16, Q4G32M, Q5G32M, Q6G16, IQ4G32: sub-block scales
  rounded once to fp16; `ninfer_core.quant.ggml`); every other quantized type, and any
  tensor the artifact asks for dense, is dequantized to float32 by `gguf.quants.dequantize`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from ninfer_plugins.artifact_gguf.file import GGUFFormatError

if TYPE_CHECKING:
    from ninfer_core.quant.tensor import QuantizedTensor

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

#: Tensors that change the model in a way the config cannot say: refused, not ignored.
_REFUSED = {
    "rope_freqs.weight": "per-frequency RoPE factors (Llama 3.1 style scaling stored as a "
    "tensor) are not supported yet",
}

#: Stored types loaded as they are (torch dtype), and the quantized types dequantized.
_DENSE = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_QUANTIZED_NAMES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4",
)  # fmt: skip
QUANTIZED = frozenset(
    GGMLQuantizationType[n] for n in _QUANTIZED_NAMES if n in GGMLQuantizationType.__members__
)
SUPPORTED_TYPES = frozenset(_DENSE) | QUANTIZED


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; an unknown one keeps its GGUF name."""
    if gguf_name in _REFUSED:
        raise GGUFFormatError(f"tensor {gguf_name!r}: {_REFUSED[gguf_name]}")
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK:
        return gguf_name
    return f"model.layers.{match[1]}.{_BLOCK[match[2]]}.{match[3]}"


def check_type(tensor: ReaderTensor) -> None:
    """Refuse a tensor whose stored type this reader cannot turn into numbers."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise GGUFFormatError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which NInfer cannot "
            "read; supported: " + ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        )


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """The logical shape in torch's order (ggml lists the contiguous dim first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def kept_format(tensor: ReaderTensor) -> str | None:
    """Our weight format for `tensor` kept in its ggml codes (`Q4G32`, `Q4G32M`, `W8G32`,
    `Q6G16`, ...), or None where it loads dense: a type `ggml.kept_format` does not keep,
    or not a matrix. Headers only; nothing is read."""
    from ninfer_core.quant import ggml

    if len(tensor.shape) != 2:
        return None
    return ggml.kept_format(tensor.tensor_type.name)


def _keep_quantized(
    tensor: ReaderTensor, shape: tuple[int, ...], heads: int | None, keep_as: str
) -> QuantizedTensor:
    """The tensor kept in its ggml codes as a `QuantizedTensor` of format `keep_as` (rows
    in Hugging Face order: `heads` given means unpermute them).

    The blocks become codes, scales and mins as they are (`from_ggml_blocks`, nothing
    re-quantized), widened into `keep_as` where that is not the type's own format (a fused
    group of mixed types, `ninfer_core.quant.widen`); a block holds part of one row, so
    the Q/K un-permutation moves whole rows (`QuantizedTensor.index_rows`).
    """
    from ninfer_core.errors import ArtifactError
    from ninfer_core.quant.formats import weight_format
    from ninfer_core.quant.ggml import from_ggml_blocks
    from ninfer_core.quant.widen import widen

    try:
        kept = from_ggml_blocks(tensor.tensor_type.name, tensor.data, (shape[0], shape[1]))
        if kept is None:
            raise ArtifactError(f"ggml type {tensor.tensor_type.name} is not kept in its codes")
        kept = widen(kept, weight_format(keep_as))
    except (ArtifactError, ValueError) as exc:
        raise GGUFFormatError(f"tensor {tensor.name!r}: {exc}") from None
    if heads is None:
        return kept
    order = unpermute(torch.arange(shape[0]), heads, tensor.name)  # new row i = old order[i]
    return kept.index_rows(order)


def load(tensor: ReaderTensor, heads: int | None, *, keep_as: str | None) -> Any:
    """The tensor as the model holds it: a `QuantizedTensor` of format `keep_as` when that
    is given (`kept_format`, or the common format of a mixed fused group), else dense
    (`dense`). `heads`: undo llama.cpp's Q/K row permutation for that many heads."""
    shape = torch_shape(tensor)
    if keep_as is not None:
        return _keep_quantized(tensor, shape, heads, keep_as)
    weight = dense(tensor)
    return weight if heads is None else unpermute(weight, heads, tensor.name)


def dense(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor in torch's shape: F32/F16/BF16 as stored, quantized types as float32.
    A new tensor (the file's map is read-only and shared)."""
    shape = torch_shape(tensor)
    kind = tensor.tensor_type
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        out = torch.from_numpy(np.array(tensor.data, copy=True))
    elif kind == GGMLQuantizationType.BF16:  # gguf-py maps BF16 as raw bytes
        out = torch.from_numpy(np.array(tensor.data, copy=True)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, kind), np.float32))
    return out.reshape(shape)


def unpermute(weight: torch.Tensor, n_head: int, name: str) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows `[d0, d(h), d1, d(h+1), ...]` (pairs
    interleaved) back to `[d0, d1, ..., d(h), ...]` (two halves), for a weight [rows, cols]
    or a bias [rows]; works on any row-major layout of rows (dense or whole blocks)."""
    rows = weight.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise GGUFFormatError(
            f"tensor {name!r} has {rows} rows, not a multiple of 2 x {n_head} heads"
        )
    rest = weight.shape[1:]
    # GGUF rows: [head, half_dim, 2] -> Hugging Face rows: [head, 2, half_dim]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )
