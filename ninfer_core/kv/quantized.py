"""`QuantizedKVStore`: K and V as group-quantized codes plus fp16 scales, paged.

Per layer, K and V each have a code pool `[num_blocks, block_size, Hkv, W]` (W bytes
of codes per head vector) and a scale pool `[num_blocks, block_size, Hkv, D / G]`,
both indexed by the same flat slot, so a page of codes and its scales move together
and the block manager needs to know nothing about the encoding. `write` quantizes on
store; `gather` dequantizes whole pages back to `compute_dtype`.

With `rotate=True` (rk8v4) K and V are multiplied by the head-dim Hadamard matrix H
before quantizing, and `gather` rotates them back (`x_rot · Hᵀ`), so the attention
kernels see ordinary K and V and need no change. A fused kernel instead reads the
rotated codes in place (`raw_pages`, with the store's `rotation`), rotates q by H
(scores are unchanged: `qH · kH = q · k`) and the attention output by Hᵀ
(`softmax(s) · VH · Hᵀ = softmax(s) · V`): one rotation per query and output row
instead of one per cached token.
"""

from __future__ import annotations

import torch

from ninfer_core.device import DeviceInfo
from ninfer_core.kv.hadamard import HeadRotation
from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.pages import KVPages, PagePool
from ninfer_core.kv.quant import Fp8Quantizer, GroupQuantizer, group_size
from ninfer_core.support import Support


def check_head_dim(head_dim: int, *quantizers: GroupQuantizer) -> None:
    """Packed codes need whole bytes per group; raise with the reason otherwise."""
    for q in quantizers:
        if group_size(head_dim) % q.values_per_byte:
            raise ValueError(
                f"{q.name} KV codes pack {q.values_per_byte} values per byte; head dim "
                f"{head_dim} does not split into groups of whole bytes"
            )


class QuantizedKVStore:
    """Paged K/V codes and scales for all layers, one allocation per pool."""

    #: Bytes per cached value that gathering needs beside the two compute-dtype outputs
    #: (the `KVStore` contract's member): V's codes and two fp32 decode temporaries (codes
    #: as floats, then times the scales), and K's fp32 decode, which `gather` still holds
    #: while V decodes. Measured on the CPU: 15.5 bytes per value in all, with bf16 outputs.
    gather_scratch_bytes = 12

    def __init__(
        self,
        layout: KVLayout,
        k_quant: GroupQuantizer,
        v_quant: GroupQuantizer,
        *,
        rotate: bool = False,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        d = layout.head_dim
        check_head_dim(d, k_quant, v_quant)
        self.layout = layout
        self._raw_pages: dict[int, KVPages] = {}  # `raw_pages`, per layer
        self.quant = (k_quant, v_quant)
        self.dtype = k_quant.code_dtype  # storage dtype of K codes, for reports
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        self.rotation = HeadRotation(d, device) if rotate else None
        pages = layout.page_shape[:-1]  # [NB, BS, Hkv]
        n_groups = d // group_size(d)
        # codes[kv]: [L, NB, BS, Hkv, W]; scales[kv]: [L, NB, BS, Hkv, D/G] fp16.
        self.codes = [
            torch.zeros(
                layout.num_layers, *pages, q.code_width(d), dtype=q.code_dtype, device=device
            )
            for q in self.quant
        ]
        self.scales = [
            torch.zeros(layout.num_layers, *pages, n_groups, dtype=torch.float16, device=device)
            for _ in self.quant
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.codes, *self.scales))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and store new tokens. slots: [T] int64; k, v: [T, Hkv, D] any float."""
        for kv, x in enumerate((k, v)):
            if self.rotation is not None:
                x = self.rotation.forward(x)
            codes, scales = self.quant[kv].encode(x)  # [T, Hkv, W], [T, Hkv, D/G]
            self.codes[kv][layer].flatten(0, 1).index_copy_(0, slots, codes)
            self.scales[kv][layer].flatten(0, 1).index_copy_(0, slots, scales)

    def write_layers(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and store new tokens of every layer (a compiled step's K/V, returned by
        its graph). slots: [T] int64; k, v: [L, T, Hkv, D]: one encode and two copies per
        pool for all layers, the codes `write` would store layer by layer."""
        for kv, x in enumerate((k, v)):
            if self.rotation is not None:
                x = self.rotation.forward(x)
            codes, scales = self.quant[kv].encode(x)  # [L, T, Hkv, W], [L, T, Hkv, D/G]
            self.codes[kv].flatten(1, 2).index_copy_(1, slots, codes)
            self.scales[kv].flatten(1, 2).index_copy_(1, slots, scales)

    def raw_pages(self, layer: int) -> KVPages:
        """Layer `layer`'s live code and scale pools, as stored (rotated for rk8v4), for
        kernels that dequantize inside: `[NB, BS, Hkv, W]` codes, `[NB, BS, Hkv, D/G]`
        fp16 scales."""
        pages = self._raw_pages.get(layer)
        if pages is None:  # views of pools fixed at build time: described once a layer
            pages = self._raw_pages[layer] = self._describe_pages(layer)
        return pages

    def _describe_pages(self, layer: int) -> KVPages:
        d = self.layout.head_dim
        pools = []
        for kv, quant in enumerate(self.quant):
            fp8 = isinstance(quant, Fp8Quantizer)
            pools.append(
                PagePool(
                    self.codes[kv][layer],
                    self.scales[kv][layer],
                    "fp8_e4m3" if fp8 else "int",
                    8 // quant.values_per_byte,
                    group_size(d),
                    quant,
                )
            )
        return KVPages(pools[0], pools[1], d, self.rotation)

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize pages. block_table: [nb] or [B, nb] -> k, v: [(B,) L, Hkv, D].

        The token axis is trimmed to `length` before dequantizing, so the padding of
        the last page costs no arithmetic.
        """
        return self._gather(layer, block_table, length, heads_first=False, rotated=False)

    def gather_heads(
        self,
        layer: int,
        block_table: torch.Tensor,
        length: int | None = None,
        *,
        rotated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `gather`, head-major: k, v: [(B,) Hkv, L, D], contiguous.

        With `rotated`, K and V stay in the rotated space they are stored in (for
        `rotation`-aware attention, which rotates the query instead: one vector per
        head instead of the whole context). Without a rotation it changes nothing.
        """
        return self._gather(layer, block_table, length, heads_first=True, rotated=rotated)

    def _gather(
        self,
        layer: int,
        block_table: torch.Tensor,
        length: int | None,
        *,
        heads_first: bool,
        rotated: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lead = block_table.dim() - 1
        out = []
        for kv in (0, 1):
            codes = self.codes[kv][layer][block_table].flatten(lead, lead + 1)
            scales = self.scales[kv][layer][block_table].flatten(lead, lead + 1)
            if length is not None:
                codes, scales = codes[..., :length, :, :], scales[..., :length, :, :]
            if heads_first:  # move the narrow codes, not the dequantized floats
                codes = codes.transpose(-3, -2).contiguous()
                scales = scales.transpose(-3, -2).contiguous()
            x = self.quant[kv].decode(codes, scales)  # [..., L, Hkv, D] or [..., Hkv, L, D]
            if self.rotation is not None and not rotated:
                x = self.rotation.inverse(x)
            out.append(x.to(self.compute_dtype))
        return out[0], out[1]

    def save_pages(self, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of pages `blocks` ([n]) of every layer, as stored: K and V codes, then
        K and V scales, each `[L, n, BS, Hkv, ...]`, so a restore is bit-exact."""
        return tuple(t.index_select(1, blocks) for t in (*self.codes, *self.scales))

    def load_pages(self, blocks: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> None:
        """Put `save_pages`' copies back, into pages `blocks` (as many as were saved)."""
        for t, copy in zip((*self.codes, *self.scales), saved, strict=True):
            t.index_copy_(1, blocks, copy)


class QuantizedKVCodec:
    """A codec plugin object: which quantizer for K and for V, rotated or not."""

    def __init__(
        self,
        name: str,
        description: str,
        k_quant: GroupQuantizer,
        v_quant: GroupQuantizer,
        *,
        rotate: bool = False,
    ) -> None:
        self.name, self.description = name, description
        self.k_quant, self.v_quant, self.rotate = k_quant, v_quant, rotate

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes("plain torch integer ops: any CPU or GPU")

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Codes and fp16 scales of K and V, every layer and KV head, for one token."""
        per_head = self.k_quant.bytes_per_vector(head_dim) + self.v_quant.bytes_per_vector(head_dim)
        return num_layers * num_kv_heads * per_head

    def allocate(
        self,
        layout: KVLayout,
        device: torch.device | str,
        compute_dtype: torch.dtype | None = None,
    ) -> QuantizedKVStore:
        """A zeroed store; `gather` returns `compute_dtype` (default fp32: pass the model's)."""
        return QuantizedKVStore(
            layout,
            self.k_quant,
            self.v_quant,
            rotate=self.rotate,
            device=device,
            compute_dtype=compute_dtype or torch.float32,
        )

    def __repr__(self) -> str:
        return f"QuantizedKVCodec({self.name})"
