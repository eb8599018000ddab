"""Paged KV cache: the page layout and the stores that hold keys and values.

A store owns, per layer, a pool of `num_blocks` pages of `block_size` token slots.
Every codec's store (`PlainKVStore` for fp16/bf16/fp32, `QuantizedKVStore` for int8,
rk8v4 and fp8) has the same
small interface, so the model and the kernels never care how K and V are encoded:

- `write(layer, slots[T], k[T, Hkv, D], v[T, Hkv, D])`: encode and store new tokens at
  flat slot indices (`block * block_size + offset`);
- `gather(layer, block_table[..., nb], length=None) -> (k, v)`: decode whole pages back to
  `compute_dtype` as `[..., L, Hkv, D]`, `L = length or nb * block_size`;
- `layout`, `dtype` (storage), `compute_dtype`, `nbytes`.

A store may also offer `gather_heads(...) -> [..., Hkv, L, D]`, the layout attention
consumes, when it can produce it without a transpose copy (the plain store keeps its
pages head-major for this; the quantized store transposes the narrow codes before
decoding them). A store whose K and V are stored rotated (`rotation` not None, rk8v4)
must also take `gather_heads(..., rotated=True)`, which skips the inverse rotation:
attention then rotates the query and the output instead of the whole context.
"""

import torch

from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.plain import PlainKVStore
from ninfer_core.kv.quantized import QuantizedKVStore

#: KV codec for `--kv-dtype auto` once the model is loaded: keep its own precision.
AUTO_KV_CODEC = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def kv_codec_name(kv_dtype: str, compute_dtype: torch.dtype) -> str:
    """The codec `--kv-dtype` names; `auto` keeps the model's compute precision."""
    return AUTO_KV_CODEC[compute_dtype] if kv_dtype == "auto" else kv_dtype


__all__ = ["AUTO_KV_CODEC", "KVLayout", "PlainKVStore", "QuantizedKVStore"]
