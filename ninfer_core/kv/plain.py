"""`PlainKVStore`: K and V kept as they are, in one float storage dtype."""

from __future__ import annotations

import torch

from ninfer_core.kv.layout import KVLayout
from ninfer_core.kv.pages import KVPages, PagePool


class PlainKVStore:
    """Per layer, K and V pages stored head-major: `[Hkv, num_blocks, block_size, D]`.

    Head-major because attention consumes `[Hkv, L, D]`: gathering a sequence's pages
    along the block axis then yields that shape with no transpose copy. One
    allocation holds every layer (`[2, L, Hkv, NB, BS, D]`). The pool starts zeroed:
    padded block-table entries point at page 0, and masked-out keys must stay finite.
    """

    #: K and V are stored as given (the `KVStore` contract's default).
    rotation = None
    #: `gather` casts from the storage dtype, nothing more (the contract's default).
    gather_scratch_bytes = None

    def __init__(
        self,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.layout = layout
        self._raw_pages: dict[int, KVPages] = {}  # `raw_pages`, per layer
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.device = torch.device(device)
        hkv, nb, bs, d = layout.num_kv_heads, layout.num_blocks, layout.block_size, layout.head_dim
        self.pool = torch.zeros(2, layout.num_layers, hkv, nb, bs, d, dtype=dtype, device=device)
        #: Per layer `[Hkv, NB, BS, D]` page views, for kernels that read the pages directly.
        self.k = list(self.pool[0].unbind(0))
        self.v = list(self.pool[1].unbind(0))
        # Flat slot views `[Hkv, NB * BS, D]`: slot s is block s // BS, offset s % BS.
        self._k_flat = [t.view(hkv, nb * bs, d) for t in self.k]
        self._v_flat = [t.view(hkv, nb * bs, d) for t in self.v]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens. slots: [T] int64; k, v: [T, Hkv, D] in any float dtype."""
        self._k_flat[layer].index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        self._v_flat[layer].index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))

    def write_layers(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens of every layer. slots: [T] int64; k, v: [L, T, Hkv, D]: two
        copies in all, where layer by layer takes two a layer."""
        _, layers, hkv, nb, bs, d = self.pool.shape
        flat = self.pool.view(2, layers, hkv, nb * bs, d)
        flat[0].index_copy_(2, slots, k.transpose(1, 2).to(self.dtype))
        flat[1].index_copy_(2, slots, v.transpose(1, 2).to(self.dtype))

    def raw_pages(self, layer: int) -> KVPages:
        """Layer `layer`'s live K and V pages as `[NB, BS, Hkv, D]` views (strided: the
        pool is head-major underneath), for kernels that read them in place."""
        pages = self._raw_pages.get(layer)
        if pages is None:  # views of pools fixed at build time: described once a layer
            pages = self._raw_pages[layer] = self._describe_pages(layer)
        return pages

    def _describe_pages(self, layer: int) -> KVPages:
        d = self.layout.head_dim
        bits = self.dtype.itemsize * 8

        def pool(pages: torch.Tensor) -> PagePool:  # [Hkv, NB, BS, D] -> [NB, BS, Hkv, D]
            return PagePool(pages.permute(1, 2, 0, 3), None, "float", bits, d)

        return KVPages(pool(self.k[layer]), pool(self.v[layer]), d)

    def gather_heads(
        self,
        layer: int,
        block_table: torch.Tensor,
        length: int | None = None,
        *,
        rotated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read pages back head-major. block_table: [nb] or [B, nb] -> [(B,) Hkv, L, D].
        (`rotated` changes nothing: this store keeps K and V as given.)

        `length` (a host int, so no device sync) trims the token axis; pages are
        read whole, which is why padded table entries must name a real page.
        """
        _, _, hkv, _, bs, d = self.pool.shape
        if torch.compiler.is_compiling() and block_table.dim() == 2:
            # Traced (the compiled decode step): pages indexed whole along their own axis,
            # so the generated gather copies each page's [BS, D] rows with vector loads;
            # through the flat rows below it computed every element's index apart
            # (about twice the time of the step's attention).
            b, nb = block_table.shape
            pages = self.pool[:, layer]  # [2, Hkv, NB, BS, D]
            kv = pages[:, :, block_table.reshape(-1)].view(2, hkv, b, nb * bs, d)
            kv = kv.transpose(1, 2).to(self.compute_dtype)  # [2, B, Hkv, nb*BS, D]
            if length is not None:
                kv = kv[..., :length, :]
            return kv[0], kv[1]
        # K and V of the layer as flat rows of BS*D, both in one index_select: whole rows
        # move (about 3x faster on the CPU than selecting along a dim of the 4-D pool),
        # and a decode step pays one dispatch for both instead of one each.
        rows = self.pool[:, layer].flatten(3)  # [2, Hkv, NB, BS*D]
        if block_table.dim() == 1:
            kv = rows.index_select(2, block_table).view(2, hkv, -1, d)  # [2, Hkv, nb*BS, D]
        else:
            b, nb = block_table.shape
            kv = rows.index_select(2, block_table.reshape(-1))  # [2, Hkv, B*nb, BS*D]
            kv = kv.view(2, hkv, b, nb * bs, d).transpose(1, 2)  # [2, B, Hkv, nb*BS, D]
        if length is not None and length < kv.shape[-2]:
            kv = kv[..., :length, :]
        # Contiguous, in one pass: a strided K/V makes the CPU bf16 matmul of a decode row
        # 3-5x slower than a copy costs, and a dtype change already copies (into a
        # contiguous tensor, since the trimmed view has gaps).
        kv = kv.to(self.compute_dtype)
        if not kv.is_contiguous():
            kv = kv.contiguous()
        return kv[0], kv[1]

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read pages back token-major. block_table: [nb] or [B, nb] -> [(B,) L, Hkv, D]."""
        k, v = self.gather_heads(layer, block_table, length)
        return k.transpose(-3, -2), v.transpose(-3, -2)

    def save_pages(self, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of pages `blocks` ([n]) of every layer: one `[2, L, Hkv, n, BS, D]` tensor."""
        return (self.pool.index_select(3, blocks),)

    def load_pages(self, blocks: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> None:
        """Put `save_pages`' copies back, into pages `blocks` (as many as were saved)."""
        self.pool.index_copy_(3, blocks, saved[0])
