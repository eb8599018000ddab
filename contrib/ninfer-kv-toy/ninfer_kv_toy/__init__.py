"""`toy-int16`: an example KV codec living outside NInfer.

Keys and values are stored as int16 codes with one fp32 scale per (token, head):
`code = round(x / scale)`, `scale = max|x| / 32767`. It keeps the same contract
as NInfer's built-in codecs (`ninfer_core.plugin_types.KVCodec` and `KVStore`), so
the attention kernels use it unchanged.
"""

from __future__ import annotations

import torch

from ninfer_core import hookimpl
from ninfer_core.support import Support

QMAX = 32767


class Int16KVStore:
    """Per layer: codes [NB, BS, Hkv, D] int16 and scales [NB, BS, Hkv, 1] fp32."""

    # Optional members of NInfer's `KVStore` contract this store does without: no
    # head-major gather (attention transposes `gather`'s output), no rotation, no
    # decode scratch declared (the workspace estimate counts a cast from int16).
    gather_heads = None
    rotation = None
    gather_scratch_bytes = None
    #: Layer by layer only (`write`): the compiled decode step needs a store that has it.
    write_layers = None
    #: No raw page copies: a hybrid model's prefix cache resumes at block boundaries only.
    save_pages = load_pages = None
    #: No in-place page access: GPU attention kernels that read pages (Triton) refuse it.
    raw_pages = None

    def __init__(self, layout, device, compute_dtype: torch.dtype) -> None:
        self.layout = layout
        self.dtype = torch.int16
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        shape = (layout.num_layers, *layout.page_shape)
        self.codes = torch.zeros(2, *shape, dtype=torch.int16, device=device)
        self.scales = torch.zeros(2, *shape[:-1], 1, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def _flat(self, t: torch.Tensor, kv: int, layer: int) -> torch.Tensor:
        return t[kv, layer].flatten(0, 1)  # [NB * BS, Hkv, ...]: a view

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T]; k, v: [T, Hkv, D]."""
        for kv, x in enumerate((k, v)):
            x = x.float()
            scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / QMAX
            codes = torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int16)
            self._flat(self.codes, kv, layer).index_copy_(0, slots, codes)
            self._flat(self.scales, kv, layer).index_copy_(0, slots, scale)

    def gather(self, layer: int, block_table: torch.Tensor, length: int | None = None):
        """block_table: [nb] or [B, nb] -> k, v: [(B,) L, Hkv, D] in compute_dtype."""
        lead = len(block_table.shape) - 1
        out = []
        for kv in (0, 1):
            codes = self.codes[kv, layer][block_table].flatten(lead, lead + 1)
            scales = self.scales[kv, layer][block_table].flatten(lead, lead + 1)
            x = codes.float() * scales
            if length is not None:
                x = x[..., :length, :, :]
            out.append(x.to(self.compute_dtype))
        return out[0], out[1]


class ToyInt16Codec:
    name = "toy-int16"
    description = "example plugin: int16 codes + fp32 scale per token and head (CPU only)"

    def supports(self, device) -> Support:
        if device.cuda is not None:
            return Support.no("toy-int16 is an example codec for the CPU only")
        return Support.yes()

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * num_kv_heads * (2 * head_dim + 4)

    def allocate(self, layout, device, compute_dtype: torch.dtype | None = None):
        """`gather` returns `compute_dtype` (None: float32)."""
        return Int16KVStore(layout, device, compute_dtype or torch.float32)


@hookimpl
def register_kv_codecs():
    return [ToyInt16Codec()]
