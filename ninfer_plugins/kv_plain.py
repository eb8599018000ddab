"""KV codecs `fp16`, `bf16` and `fp32`: keys and values stored as plain floats."""

from __future__ import annotations

import torch

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.plain import PlainKVStore
from ninfer_core.support import Support


class PlainKVCodec:
    """One float storage dtype; `bytes_per_token` counts K and V over all layers."""

    def __init__(self, name: str, dtype: torch.dtype, description: str, min_sm: int = 0) -> None:
        self.name, self.dtype, self.description = name, dtype, description
        #: Oldest CUDA SM with native arithmetic for this dtype (0: any).
        self.min_sm = min_sm

    def supports(self, device: DeviceInfo) -> Support:
        if device.cuda is not None and device.cuda.sm_version < self.min_sm:
            return Support.no(
                f"{self.name} KV cache needs SM{self.min_sm} or newer; {device.cuda.name} is "
                f"SM{device.cuda.sm_version} (use fp16)"
            )
        return Support.yes()

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * self.dtype.itemsize

    def allocate(
        self,
        layout: KVLayout,
        device: torch.device | str,
        compute_dtype: torch.dtype | None = None,
    ) -> PlainKVStore:
        """A zeroed store; `gather` returns `compute_dtype` (default: the storage dtype)."""
        return PlainKVStore(layout, self.dtype, device, compute_dtype)

    def __repr__(self) -> str:
        return f"PlainKVCodec({self.name})"


@hookimpl
def register_kv_codecs() -> list[PlainKVCodec]:
    return [
        PlainKVCodec("fp16", torch.float16, "keys and values in float16 (2 bytes per value)"),
        PlainKVCodec(
            "bf16", torch.bfloat16, "keys and values in bfloat16 (2 bytes per value)", min_sm=80
        ),
        PlainKVCodec("fp32", torch.float32, "keys and values in float32, for reference runs"),
    ]
