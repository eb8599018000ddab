"""KV codec `rk8v4`: Hadamard-rotated K in int8 and rotated V in int4, group-64 fp16 scales.

The rotation spreads outlier channels over the whole head vector before quantizing,
which is what lets V survive 4 bits; keys keep 8 bits because softmax amplifies score
errors. At D = 128 a token costs 200 bytes per KV head against fp16's 512.
"""

from __future__ import annotations

from ninfer_core import hookimpl
from ninfer_core.kv.quant import INT4, INT8
from ninfer_core.kv.quantized import QuantizedKVCodec


@hookimpl
def register_kv_codecs() -> list[QuantizedKVCodec]:
    return [
        QuantizedKVCodec(
            "rk8v4",
            "Hadamard-rotated K int8 and V int4 (two per byte), fp16 scale per 64 values",
            INT8,
            INT4,
            rotate=True,
        )
    ]
