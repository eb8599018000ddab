"""KV codec `fp8`: K and V as float8 e4m3 values with one fp16 scale per 64 values.

Native fp8 conversion arrives with SM89 (Ada); on older GPUs the codec is refused at
startup, naming the codecs that do run there, rather than failing deep in the engine.
On the CPU it is emulated with torch's float8 casts, so tests and CPU serving work.
"""

from __future__ import annotations

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.kv.quant import FP8
from ninfer_core.kv.quantized import QuantizedKVCodec
from ninfer_core.support import Support

#: Oldest CUDA SM with fp8 conversion instructions (Ada, e.g. the RTX 4090).
MIN_SM = 89


class Fp8KVCodec(QuantizedKVCodec):
    def supports(self, device: DeviceInfo) -> Support:
        if device.cuda is None:
            return Support.yes("emulated on the CPU with torch float8 casts")
        sm = device.cuda.sm_version
        if sm < MIN_SM:
            return Support.no(
                f"fp8 KV needs SM{MIN_SM} or newer (this GPU is SM{sm}); "
                "use --kv-dtype int8 or rk8v4"
            )
        return Support.yes(f"SM{sm} converts fp8 natively")


@hookimpl
def register_kv_codecs() -> list[QuantizedKVCodec]:
    return [Fp8KVCodec("fp8", "K and V float8 e4m3, fp16 scale per 64 values", FP8, FP8)]
