"""`PlainKVStore`: K and V kept as they are, in one float storage dtype."""

from __future__ import annotations

import torch

from ninfer_core.kv.layout import KVLayout


class PlainKVStore:
    """Per layer, K and V pages `[num_blocks, block_size, Hkv, D]` in `dtype`.

    One allocation holds every layer (`[2, L, NB, BS, Hkv, D]`) so the pool is a
    single contiguous buffer; `k[layer]` / `v[layer]` are views that kernels reading
    the plain format directly may use. The pool starts zeroed: padded block-table
    entries point at page 0, and masked-out keys must still be finite.
    """

    def __init__(
        self,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.device = torch.device(device)
        pages = layout.page_shape
        self.pool = torch.zeros(2, layout.num_layers, *pages, dtype=dtype, device=device)
        self.k = list(self.pool[0].unbind(0))
        self.v = list(self.pool[1].unbind(0))
        # Flat slot views: slot s lives at [s // block_size, s % block_size].
        flat = (layout.num_slots, layout.num_kv_heads, layout.head_dim)
        self._k_flat = [t.view(flat) for t in self.k]
        self._v_flat = [t.view(flat) for t in self.v]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens. slots: [T] int64; k, v: [T, Hkv, D] in any float dtype."""
        self._k_flat[layer].index_copy_(0, slots, k.to(self.dtype))
        self._v_flat[layer].index_copy_(0, slots, v.to(self.dtype))

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read pages back. block_table: [nb] or [B, nb] -> k, v: [(B,) L, Hkv, D].

        `length` (a host int, so no device sync) trims the token axis; pages are
        read whole, which is why padded table entries must name a real page.
        """
        lead = block_table.shape[:-1]
        k = self.k[layer][block_table].flatten(len(lead), len(lead) + 1)
        v = self.v[layer][block_table].flatten(len(lead), len(lead) + 1)
        if length is not None:
            k, v = k[..., :length, :, :], v[..., :length, :, :]
        return k.to(self.compute_dtype), v.to(self.compute_dtype)
