"""ggml's Q4_0, Q4_1 and Q8_0 blocks -> `QuantizedTensor`, exactly (no re-quantizing).

A GGUF tensor of one of these types is a row-major run of 32-weight blocks along each
row (ggml's `ne[0]`, torch's last dimension), each block little-endian:

| ggml type | block bytes | layout                                   | weight `i` of the block    |
|-----------|-------------|------------------------------------------|----------------------------|
| Q8_0      | 34          | fp16 d, int8 q[32]                       | `q[i] * d`                 |
| Q4_0      | 18          | fp16 d, u8 qs[16]                        | `(nib(i) - 8) * d`         |
| Q4_1      | 20          | fp16 d, fp16 m, u8 qs[16]                | `nib(i) * d + m`           |

with `nib(i) = qs[i] & 15` for `i < 16` and `qs[i - 16] >> 4` for `i >= 16`: byte `j`
holds weights `j` and `j + 16`, not two neighbours. (ggml's reference dequantizer is
`gguf.quants` in the `gguf` package; the tests check against it.)

They map onto our formats (`formats.py`) value for value:

- Q8_0 -> W8G32: code `q`, scale `d`. Our 8-bit codes run over -128 .. 127, so a block
  holding -128 (ggml's quantizer writes -127 .. 127, but a file may hold any byte) is
  kept as it is and dequantizes to `-128 * d`, as ggml's does.
- Q4_0 -> Q4G32: code `nib - 8`, scale `d`; the stored nibble is `nib` itself.
- Q4_1 -> Q4G32M: stored value `nib`, scale `d`, min `m`.

Only the nibble order changes (ours holds neighbours `2k, 2k + 1` in byte `k`); scales
and mins are the blocks' fp16 bit patterns, moved, never rounded. Any other ggml type
(F16, BF16, the K-quants, Q5_0, ...) gives None: the reader dequantizes those itself.

A reader that reorders rows afterwards (llama.cpp's q/k row permutation) does it with
`QuantizedTensor.index_rows`, which moves codes, scales and mins row by row.
"""

from __future__ import annotations

import sys

import torch

from ninfer_core.errors import ArtifactError
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import QuantizedTensor

#: ggml type name -> (our format, bytes per 32-weight block, fp16 fields before the codes).
GGML_FORMATS: dict[str, tuple[str, int, int]] = {
    "Q4_0": ("Q4G32", 18, 1),
    "Q4_1": ("Q4G32M", 20, 2),
    "Q8_0": ("W8G32", 34, 1),
}
#: Weights per ggml block.
BLOCK = 32
#: Bytes of blocks converted at a time (each chunk is copied once, then rearranged).
_CHUNK_BYTES = 1 << 22


def from_ggml_blocks(
    type_name: str, raw: bytes | bytearray | memoryview | torch.Tensor, shape: tuple[int, int]
) -> QuantizedTensor | None:
    """The `[rows, cols]` tensor whose ggml blocks (type `type_name`: "Q4_0", "Q4_1",
    "Q8_0") are `raw` -- bytes, a buffer such as a numpy uint8 array (read-only ones
    included; it is only read), or a uint8 tensor -- as a `QuantizedTensor` of the same
    values; None for a ggml type we do not keep quantized.

    `cols` must be a multiple of 32 (ggml's own rule) and `raw` exactly the blocks'
    bytes, `rows * cols / 32 * block bytes`; otherwise `ArtifactError`."""
    spec = GGML_FORMATS.get(type_name)
    if spec is None:
        return None
    fmt_name, block_bytes, n_fp16 = spec
    if len(shape) != 2:
        raise ValueError(
            f"ggml {type_name}: pass a 2-D [rows, cols] shape (stack leading dimensions "
            f"into rows), not {list(shape)}"
        )
    if sys.byteorder != "little":  # the fp16 fields are little-endian
        raise ArtifactError("ggml blocks are little-endian; this host is big-endian")
    rows, cols = int(shape[0]), int(shape[1])
    if cols % BLOCK:
        raise ArtifactError(
            f"ggml {type_name} tensor of shape {[rows, cols]}: a row of {cols} weights is "
            f"not a whole number of {BLOCK}-weight blocks"
        )
    groups = cols // BLOCK
    row_bytes = groups * block_bytes
    data = _ByteSource(raw)
    if len(data) != rows * row_bytes:
        raise ArtifactError(
            f"ggml {type_name} tensor of shape {[rows, cols]} takes {rows * row_bytes} bytes "
            f"({rows * groups} blocks of {block_bytes}), got {len(data)}"
        )
    fmt = weight_format(fmt_name)
    packed = torch.empty(rows, cols * fmt.bits // 8, dtype=torch.uint8)
    fields = torch.empty(n_fp16, rows, groups, dtype=torch.float16)  # d (and m)
    step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, rows if row_bytes else 0, step):
        end = min(rows, start + step)
        # [r, groups, block_bytes]: a writable copy of this chunk's blocks
        blocks = data.chunk(start * row_bytes, end * row_bytes).view(-1, groups, block_bytes)
        head = blocks[..., : 2 * n_fp16].contiguous().view(torch.float16)  # [r, g, n_fp16]
        fields[:, start:end] = head.permute(2, 0, 1)
        qs = blocks[..., 2 * n_fp16 :]
        codes = _q8_codes(qs) if fmt.bits == 8 else _q4_codes(qs)  # [r, groups, 32 or 16]
        packed[start:end] = codes.reshape(end - start, -1)
    mins = fields[1] if fmt.mins else None
    return QuantizedTensor(fmt, (rows, cols), packed, fields[0], mins)


def _q8_codes(qs: torch.Tensor) -> torch.Tensor:
    """int8 two's complement bytes -> offset-binary (`code + 128`): flip the top bit."""
    return qs ^ 0x80


def _q4_codes(qs: torch.Tensor) -> torch.Tensor:
    """ggml's nibble order -> ours, per block of 16 bytes `b`.

    ggml: weight `j` is `b[j] & 15`, weight `j + 16` is `b[j] >> 4`. Ours: byte `k` holds
    weight `2k` (low nibble) and `2k + 1` (high). So our bytes 0..7 take the low nibbles
    of `b[2k]`, `b[2k + 1]`; our bytes 8..15 take their high nibbles."""
    pairs = qs.reshape(*qs.shape[:-1], 8, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    low = (even & 0x0F) | (odd << 4)  # weights 0..15
    high = (even >> 4) | (odd & 0xF0)  # weights 16..31
    return torch.cat((low, high), dim=-1)


class _ByteSource:
    """`raw` as something to cut byte ranges from, each handed out as a fresh uint8
    tensor (torch warns on views of read-only buffers, and the blocks are only read)."""

    def __init__(self, raw: bytes | bytearray | memoryview | torch.Tensor) -> None:
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        if isinstance(raw, torch.Tensor):
            if raw.dtype != torch.uint8:
                raise ValueError(f"ggml blocks must be uint8 bytes, not {raw.dtype}")
            self._tensor = raw.reshape(-1)
            return
        try:
            self._view = memoryview(raw).cast("B")
        except TypeError:
            raise ValueError(
                "ggml blocks must be bytes, a C-contiguous buffer or a uint8 tensor, "
                f"not {type(raw).__name__}"
            ) from None

    def __len__(self) -> int:
        return self._tensor.numel() if self._tensor is not None else self._view.nbytes

    def chunk(self, start: int, end: int) -> torch.Tensor:
        if self._tensor is not None:
            return self._tensor[start:end].cpu()
        return torch.frombuffer(bytearray(self._view[start:end]), dtype=torch.uint8)
