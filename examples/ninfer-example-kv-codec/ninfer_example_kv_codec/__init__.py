"""`example-bf16`: the smallest complete KV codec, written against `ninfer_core` alone.

Keys and values are stored as bfloat16 in a token-major pool of its own. It stores exactly
what the built-in `bf16` codec stores (round to nearest bfloat16), on purpose: a greedy
generation with `--kv-dtype example-bf16` must then give the same tokens as `--kv-dtype bf16`,
which is how its test proves the plugin is wired end to end. Copy it and change `write` and
`gather` to encode your own way.

It implements only the required members of the `KVStore` contract (`write`, token-major
`gather`); the optional ones are declared at their defaults, so the attention kernels
transpose what `gather` returns, K and V are taken as stored, unrotated, and `ninfer plan`
counts a plain cast to the compute dtype for gathering.
"""

from __future__ import annotations

import torch

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.kv.layout import KVLayout
from ninfer_core.support import Support

STORAGE = torch.bfloat16


class TokenMajorBF16Store:
    """One pool `[2 (K, V), layers, blocks, block_size, Hkv, D]`: flat slot `s` of a layer is
    page `s // block_size`, row `s % block_size`, so a write is one `index_copy_`."""

    # Optional `KVStore` members, declared at the contract's defaults (the host refuses a
    # store that leaves one undeclared, so a misspelt member never goes unnoticed).
    gather_heads = None  # attention transposes `gather`'s token-major result
    rotation = None  # K and V are stored as given
    gather_scratch_bytes = None  # `gather` only casts bfloat16 to the compute dtype
    #: Layer by layer only (`write`): the compiled decode step needs a store that has it.
    write_layers = None
    #: No raw page copies: a hybrid model's prefix cache resumes at block boundaries only.
    save_pages = load_pages = None
    #: No in-place page access: GPU attention kernels that read pages (Triton) refuse it.
    raw_pages = None

    def __init__(self, layout: KVLayout, device: torch.device | str, compute_dtype: torch.dtype):
        self.layout = layout
        self.dtype = STORAGE
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        # Zeroed: padded block-table entries point at page 0 and must read back finite.
        shape = (2, layout.num_layers, *layout.page_shape)
        self.pool = torch.zeros(shape, dtype=STORAGE, device=self.device)

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T] int64 flat slots; k, v: [T, Hkv, D] in any float dtype."""
        for kv, x in enumerate((k, v)):
            self.pool[kv, layer].flatten(0, 1).index_copy_(0, slots, x.to(STORAGE))

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """block_table: [nb] or [B, nb] -> k, v: [(B,) L, Hkv, D] in `compute_dtype`; whole
        pages, trimmed to `length` tokens when given."""
        lead = block_table.dim() - 1
        out = []
        for kv in (0, 1):
            x = self.pool[kv, layer][block_table].flatten(lead, lead + 1)
            if length is not None:
                x = x[..., :length, :, :]
            out.append(x.to(self.compute_dtype))
        return out[0], out[1]


class ExampleBF16Codec:
    name = "example-bf16"
    description = "example plugin: K/V as bfloat16 in a token-major store (as bf16 stores them)"

    def supports(self, device: DeviceInfo) -> Support:
        # A refusal always says why: `ninfer probe` and the startup error show the reason.
        if device.cuda is not None and device.cuda.sm_version < 80:
            return Support.no(
                f"example-bf16 needs SM80 or newer for bfloat16; {device.cuda.name} is "
                f"SM{device.cuda.sm_version} (use fp16)"
            )
        return Support.yes()

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """What the memory planner sizes the pool by: K and V, every layer and KV head."""
        return 2 * num_layers * num_kv_heads * head_dim * STORAGE.itemsize

    def allocate(
        self,
        layout: KVLayout,
        device: torch.device | str,
        compute_dtype: torch.dtype | None = None,
    ) -> TokenMajorBF16Store:
        """`gather` returns `compute_dtype` (the model's; None: bfloat16)."""
        return TokenMajorBF16Store(layout, device, compute_dtype or STORAGE)

    def __repr__(self) -> str:  # how `ninfer generate` and refusal messages name it
        return f"ExampleBF16Codec({self.name})"


@hookimpl
def register_kv_codecs() -> list[ExampleBF16Codec]:
    return [ExampleBF16Codec()]
