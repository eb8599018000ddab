"""KV codec `int8`: K and V as int8 codes, one fp16 scale per 64 values of a head vector.

About half the bytes of fp16 (132 instead of 256 per head vector at D = 128), and runs
wherever torch does: quantizing and dequantizing are plain tensor ops.
"""

from __future__ import annotations

from ninfer_core import hookimpl
from ninfer_core.kv.quant import INT8
from ninfer_core.kv.quantized import QuantizedKVCodec


@hookimpl
def register_kv_codecs() -> list[QuantizedKVCodec]:
    return [
        QuantizedKVCodec(
            "int8", "K and V int8, one fp16 scale per 64 values (~1.03 bytes per value)", INT8, INT8
        )
    ]
