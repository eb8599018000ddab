"""ggml blocks -> `QuantizedTensor`: Q4_0..Q8_0 and IQ4_NL exactly; the K-quants' codes
(Q2_K..Q6_K) and IQ4_XS's too.

A GGUF tensor of one of these types is a row-major run of 32-weight blocks along each
row (ggml's `ne[0]`, torch's last dimension), each block little-endian:

| ggml type | block bytes | layout                     | weight `i` of the block        |
|-----------|-------------|----------------------------|--------------------------------|
| Q8_0      | 34          | fp16 d, int8 q[32]         | `q[i] * d`                     |
| Q4_0      | 18          | fp16 d, u8 qs[16]          | `(nib(i) - 8) * d`             |
| Q4_1      | 20          | fp16 d, fp16 m, u8 qs[16]  | `nib(i) * d + m`               |
| Q5_0      | 22          | fp16 d, u32 qh, u8 qs[16]  | `(nib(i) + 16 hb(i) - 16) * d` |
| Q5_1      | 24          | fp16 d, fp16 m, u32 qh, u8 qs[16] | `(nib(i) + 16 hb(i)) * d + m` |

with `nib(i) = qs[i] & 15` for `i < 16` and `qs[i - 16] >> 4` for `i >= 16`: byte `j`
holds weights `j` and `j + 16`, not two neighbours; `hb(i)` is bit `i` of `qh`. (ggml's
reference dequantizer is `gguf.quants` in the `gguf` package; the tests check against it.)

They map onto our formats (`formats.py`) value for value:

- Q8_0 -> W8G32: code `q`, scale `d`. Our 8-bit codes run over -128 .. 127, so a block
  holding -128 (ggml's quantizer writes -127 .. 127, but a file may hold any byte) is
  kept as it is and dequantizes to `-128 * d`, as ggml's does.
- Q4_0 -> Q4G32: code `nib - 8`, scale `d`; the stored nibble is `nib` itself.
- Q4_1 -> Q4G32M: stored value `nib`, scale `d`, min `m`.
- Q5_0 -> Q5G32: code `nib + 16 hb - 16`, scale `d` (llama.cpp's Q4_K_M writes Q5_0
  where a row is not a whole number of 256-weight super-blocks, as SmolLM2's 576 columns
  are not).
- Q5_1 -> Q5G32M: stored value `nib + 16 hb`, scale `d`, min `m`.
- IQ4_NL (fp16 d, 16 nibble bytes in Q4_0's order) -> IQ4G32: weight `v[nib(i)] * d`,
  where `v` is a code book of sixteen integers in -127 .. 113 (`formats.IQ4_BOOK`); the
  stored index is `nib` itself, scale `d`.

Only the nibble order changes (ours holds neighbours `2k, 2k + 1` in byte `k`); scales
and mins are the blocks' fp16 bit patterns, moved, never rounded.

The K-quant types, the bulk of llama.cpp's Q2_K, Q3_K_*, Q4_K_*, Q5_K_* and Q6_K files,
keep their codes too, and so does IQ4_XS. Each 256-weight super-block holds an fp16 `d`
(and `dmin`) and small integer scales per sub-block:

| ggml type | bytes | sub-blocks | weight of sub-block `j`          | code u | our format |
|-----------|-------|------------|----------------------------------|--------|------------|
| Q4_K      | 144   | 8 of 32    | `u * (d * sc[j]) - dmin * mn[j]` | 0..15  | Q4G32M     |
| Q5_K      | 176   | 8 of 32    | `u * (d * sc[j]) - dmin * mn[j]` | 0..31  | Q5G32M     |
| Q6_K      | 210   | 16 of 16   | `(u - 32) * (d * sc[j])`         | 0..63  | Q6G16      |
| Q3_K      | 110   | 16 of 16   | `(u - 4) * (d * (sc[j] - 32))`   | 0..7   | Q3G16      |
| Q2_K      | 84    | 16 of 16   | `u * (d * sc[j]) - dmin * mn[j]` | 0..3   | Q2G16M     |
| IQ4_XS    | 136   | 8 of 32    | `v[u] * (d * (sc[j] - 32))`      | 0..15  | IQ4G32     |

(Q4_K's and Q5_K's `sc` and `mn` are 6-bit, Q6_K's `sc` int8, Q3_K's and IQ4_XS's `sc`
6-bit, Q2_K's `sc` and `mn` 4-bit; IQ4_XS's `v` is IQ4_NL's code book.)

The codes are kept as they are (IQ4_XS's nibbles as the code book's indices). The
sub-block products `d * sc[j]` and `dmin * mn[j]` are exact in fp32; ours are fp16, so
each is rounded once: at most 2^-11 of the scale for a normal fp16 value (ggml's own Q8_0
scales are fp16 too), against 2^-9 of every weight had the tensor been dequantized to
bf16. A product past fp16's range fails the load with the tensor named.

Any other ggml type (F16, BF16, the IQ1-IQ3 types, ...) gives None: the reader
dequantizes those itself.

A reader that reorders rows afterwards (llama.cpp's q/k row permutation) does it with
`QuantizedTensor.index_rows`, which moves codes, scales and mins row by row.
"""

from __future__ import annotations

import sys

import torch

from ninfer_core.errors import ArtifactError
from ninfer_core.quant.codes import pack_codes
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import QuantizedTensor

#: ggml type name -> (our format, bytes per 32-weight block, fp16 fields before the codes).
GGML_FORMATS: dict[str, tuple[str, int, int]] = {
    "Q4_0": ("Q4G32", 18, 1),
    "Q4_1": ("Q4G32M", 20, 2),
    "Q8_0": ("W8G32", 34, 1),
    "Q5_0": ("Q5G32", 22, 1),
    "Q5_1": ("Q5G32M", 24, 2),
    "IQ4_NL": ("IQ4G32", 18, 1),
}
#: ggml K-quant type name -> (our format, bytes per 256-weight super-block).
K_FORMATS: dict[str, tuple[str, int]] = {
    "Q4_K": ("Q4G32M", 144),
    "Q6_K": ("Q6G16", 210),
    "Q5_K": ("Q5G32M", 176),
    "Q3_K": ("Q3G16", 110),
    "Q2_K": ("Q2G16M", 84),
    "IQ4_XS": ("IQ4G32", 136),
}
#: Weights per ggml block, and per K-quant super-block.
BLOCK = 32
SUPER_BLOCK = 256


def kept_format(type_name: str) -> str | None:
    """Our format for a matrix ggml stores as `type_name`, kept in its codes; None for a
    type the reader dequantizes."""
    if type_name in GGML_FORMATS:
        return GGML_FORMATS[type_name][0]
    if type_name in K_FORMATS:
        return K_FORMATS[type_name][0]
    return None


#: Bytes of blocks converted at a time (each chunk is copied once, then rearranged).
_CHUNK_BYTES = 1 << 22


def from_ggml_blocks(
    type_name: str, raw: bytes | bytearray | memoryview | torch.Tensor, shape: tuple[int, int]
) -> QuantizedTensor | None:
    """The `[rows, cols]` tensor whose ggml blocks (type `type_name`, one `kept_format`
    names: "Q4_0", "Q5_K", ...) are `raw` -- bytes, a buffer such as a numpy uint8 array
    (read-only ones included; it is only read), or a uint8 tensor -- as a
    `QuantizedTensor` of the same codes; None for a ggml type we do not keep quantized.

    `cols` must be a multiple of the type's block (32, or 256 for a K-quant: ggml's own
    rule) and `raw` exactly the blocks' bytes; otherwise `ArtifactError`."""
    fmt_name = kept_format(type_name)
    if fmt_name is None:
        return None
    if len(shape) != 2:
        raise ValueError(
            f"ggml {type_name}: pass a 2-D [rows, cols] shape (stack leading dimensions "
            f"into rows), not {list(shape)}"
        )
    if sys.byteorder != "little":  # the fp16 fields are little-endian
        raise ArtifactError("ggml blocks are little-endian; this host is big-endian")
    rows, cols = int(shape[0]), int(shape[1])
    k_quant = type_name in K_FORMATS
    block, block_bytes = (
        (SUPER_BLOCK, K_FORMATS[type_name][1]) if k_quant else (BLOCK, GGML_FORMATS[type_name][1])
    )
    if cols % block:
        raise ArtifactError(
            f"ggml {type_name} tensor of shape {[rows, cols]}: a row of {cols} weights is "
            f"not a whole number of {block}-weight blocks"
        )
    groups = cols // block
    row_bytes = groups * block_bytes
    data = _ByteSource(raw)
    if len(data) != rows * row_bytes:
        raise ArtifactError(
            f"ggml {type_name} tensor of shape {[rows, cols]} takes {rows * row_bytes} bytes "
            f"({rows * groups} blocks of {block_bytes}), got {len(data)}"
        )
    fmt = weight_format(fmt_name)
    packed = torch.empty(rows, cols * fmt.bits // 8, dtype=torch.uint8)
    n_fields = 2 if fmt.mins else 1
    fields = torch.empty(n_fields, rows, cols // fmt.group, dtype=torch.float16)  # d (and m)
    convert = _K_CONVERTERS[type_name] if k_quant else _blocks_converter(type_name)
    step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, rows if row_bytes else 0, step):
        end = min(rows, start + step)
        # [r, groups, block_bytes]: a writable copy of this chunk's blocks
        blocks = data.chunk(start * row_bytes, end * row_bytes).view(-1, groups, block_bytes)
        codes, chunk_fields = convert(blocks)
        packed[start:end] = codes.reshape(end - start, -1)
        for i, values in enumerate(chunk_fields):
            fields[i, start:end] = _fp16_fields(values.reshape(end - start, -1), type_name)
    mins = fields[1] if fmt.mins else None
    return QuantizedTensor(fmt, (rows, cols), packed, fields[0], mins)


_Converted = tuple[torch.Tensor, tuple[torch.Tensor, ...]]


def _blocks_converter(type_name: str):
    """A 32-weight block type (`GGML_FORMATS`): [r, groups, block bytes] -> our packed
    codes per block, and the fp16 d (and m) fields as stored."""
    n_fp16 = GGML_FORMATS[type_name][2]
    codes_of = _CODES[type_name]

    def convert(blocks: torch.Tensor) -> _Converted:
        head = blocks[..., : 2 * n_fp16].contiguous().view(torch.float16)  # [r, g, n_fp16]
        codes = codes_of(blocks[..., 2 * n_fp16 :])  # [r, groups, 32 or 16]
        return codes, tuple(head[..., i] for i in range(n_fp16))

    return convert


def _fp16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian fp16 at byte `at` of each super-block, as fp32 [r, g, 1]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).to(torch.float32)


def _q4_k(blocks: torch.Tensor) -> _Converted:
    """Q4_K super-blocks [r, g, 144] (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and
    mins, 128 code bytes) -> Q4G32M codes, and per 32 weights the scale `d * sc` and the
    min `-dmin * mn` in fp32 (exact).

    The 12 bytes hold eight 6-bit (sc, mn) pairs: pairs 0..3 are the low six bits of
    bytes 0..3 (sc) and 4..7 (mn); pairs 4..7 take their low four bits from the nibbles of
    bytes 8..11 (sc low, mn high) and their top two from the top bits of bytes 0..7
    (`_k_scales_mins`). Code bytes come in four runs of 32 (`_k_nibbles`)."""
    u = _k_nibbles(blocks[..., 16:144]).reshape(-1, 256)  # 0..15, a super-block a row
    return pack_codes(u.to(torch.int16) - 8, 4), _k_scales_mins(blocks)


def _q5_k(blocks: torch.Tensor) -> _Converted:
    """Q5_K super-blocks [r, g, 176] (fp16 d, fp16 dmin, the 12 scale bytes of Q4_K, 32
    bytes of high bits, 128 of nibbles) -> Q5G32M codes (stored values `u`, 0..31), and
    Q4_K's scales and mins per 32 weights.

    The nibbles run as Q4_K's; weight `j` of sub-block `k` takes its fifth bit from bit
    `k` of high byte `j`."""
    u = _k_nibbles(blocks[..., 48:176]) | (_k_high_bits(blocks[..., 16:48]) << 4)
    return pack_codes(u.reshape(-1, 256).to(torch.int16) - 16, 5), _k_scales_mins(blocks)


def _k_high_bits(hbytes: torch.Tensor) -> torch.Tensor:
    """32 bytes of high bits a super-block [r, g, 32] (Q3_K's and Q5_K's) -> its 256 bits
    in weight order: weight `32 b + j` (j < 32) is bit `b` of byte `j`."""
    bits = torch.arange(8, dtype=torch.uint8)[:, None]  # [8, 1]
    return ((hbytes[..., None, :] >> bits) & 1).reshape(*hbytes.shape[:-1], 256)


def _k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's per-32 scale `d * sc` and min `-dmin * mn` in fp32 (exact), from
    the fp16 `d`, `dmin` at bytes 0 and 2 and the 12 bytes of 6-bit (sc, mn) pairs at 4."""
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    packed_scales = blocks[..., 4:16].to(torch.int32)
    lo, mid, top = packed_scales[..., 0:4], packed_scales[..., 4:8], packed_scales[..., 8:12]
    sc = torch.cat((lo & 63, (top & 15) | ((lo >> 2) & 48)), dim=-1)  # [r, g, 8]
    mn = torch.cat((mid & 63, (top >> 4) | ((mid >> 2) & 48)), dim=-1)
    return d * sc.to(torch.float32), -dmin * mn.to(torch.float32)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 code bytes a super-block [r, g, 128] -> its 256 low nibbles in weight order:
    four runs of 32 bytes, run `i`'s low nibbles sub-block `2i`, its high ones `2i + 1`."""
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat((runs & 15, runs >> 4), dim=-2).reshape(*qs.shape[:-1], 256)


def _q6_k(blocks: torch.Tensor) -> _Converted:
    """Q6_K super-blocks [r, g, 210] (128 bytes of low nibbles, 64 of high bit pairs, 16
    int8 scales, fp16 d) -> Q6G16 codes (`u - 32`), and per 16 weights the scale `d * sc`
    in fp32 (exact).

    Weight `i` of a super-block (`i = 128 h + 64 s + j`, j < 64) takes its low four bits
    from nibble `s` of low byte `64 h + j`; with `i = 128 h + 32 t + j` (j < 32), its top
    two from bits `2t, 2t + 1` of high byte `32 h + j` (`gguf.quants.Q6_K`)."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64)
    low = torch.cat((ql & 15, ql >> 4), dim=-2).reshape(*lead, 256)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2).reshape(*lead, 256)
    u = low | (high << 4)  # 0..63, code u - 32
    sc = blocks[..., 192:208].contiguous().view(torch.int8).to(torch.float32)  # [r, g, 16]
    return pack_codes(u.reshape(-1, 256).to(torch.int16) - 32, 6), (_fp16(blocks, 208) * sc,)


def _q3_k(blocks: torch.Tensor) -> _Converted:
    """Q3_K super-blocks [r, g, 110] (32 bytes of high bits, 64 of 2-bit pairs, 12 of
    6-bit scales, fp16 d) -> Q3G16 codes (`q - 4`), and per 16 weights the scale
    `d * (sc - 32)` in fp32 (exact).

    Weight `i = 32 b + j` (j < 32) takes its third bit from bit `b` of high byte `j`
    (`_k_high_bits`); a set bit adds 4, so `q = pair + 4 hbit` runs 0..7 and the code is
    `q - 4` (`gguf.quants.Q3_K`). Scale `k`'s low four bits are nibble `k // 8` of byte
    `k % 8`, its top two bits `2 (k // 4)` of byte `8 + k % 4`."""
    q = _k_pairs(blocks[..., 32:96]) | (_k_high_bits(blocks[..., 0:32]) << 2)  # 0..7
    packed = blocks[..., 96:108]
    low = torch.cat((packed[..., 0:8] & 15, packed[..., 0:8] >> 4), dim=-1)  # [r, g, 16]
    top = torch.cat([(packed[..., 8:12] >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    sc = (low | (top << 4)).to(torch.float32) - 32
    return pack_codes(q.reshape(-1, 256).to(torch.int16) - 4, 3), (_fp16(blocks, 108) * sc,)


def _q2_k(blocks: torch.Tensor) -> _Converted:
    """Q2_K super-blocks [r, g, 84] (16 bytes of 4-bit scale and min pairs, 64 of 2-bit
    codes, fp16 d and dmin) -> Q2G16M stored values `u` (0..3), and per 16 weights the
    scale `d * (s & 15)` and min `-dmin * (s >> 4)` in fp32 (exact)."""
    packed = blocks[..., 0:16]
    sc, mn = (packed & 15).to(torch.float32), (packed >> 4).to(torch.float32)
    codes = pack_codes(_k_pairs(blocks[..., 16:80]).reshape(-1, 256).to(torch.int16) - 2, 2)
    return codes, (_fp16(blocks, 80) * sc, -_fp16(blocks, 82) * mn)


def _k_pairs(qs: torch.Tensor) -> torch.Tensor:
    """64 bytes of 2-bit codes a super-block [r, g, 64] -> its 256 codes in weight order:
    weight `128 h + 32 s + j` (j < 32) is bits `2s, 2s + 1` of byte `32 h + j`."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]  # [4, 1]
    runs = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    return ((runs >> shifts) & 3).reshape(*qs.shape[:-1], 256)


def _iq4_xs(blocks: torch.Tensor) -> _Converted:
    """IQ4_XS super-blocks [r, g, 136] (fp16 d, 2 bytes of high scale bits, 4 of low
    ones, 128 code bytes: IQ4_NL's 16 a sub-block of 32) -> IQ4G32 indices, and per
    32 weights the scale `d * (sc - 32)` in fp32 (exact). Sub-block `k`'s 6-bit `sc`:
    nibble `k % 2` of byte `k // 2` of the low bytes, bits `2k, 2k + 1` of the
    little-endian 16-bit high field above them."""
    lead = blocks.shape[:-1]
    # IQ4_NL's nibbles a sub-block, in Q4_0's order: the indices, moved as Q4_0's
    codes = _q4_codes(blocks[..., 8:136].reshape(*lead, 8, 16)).reshape(*lead, 128)
    low_bytes = blocks[..., 4:8]
    low = torch.stack((low_bytes & 15, low_bytes >> 4), dim=-1).reshape(*lead, 8)
    high_field = blocks[..., 2].to(torch.int32) | (blocks[..., 3].to(torch.int32) << 8)
    shifts = 2 * torch.arange(8, dtype=torch.int32)
    high = (high_field[..., None] >> shifts) & 3
    sc = (low.to(torch.int32) | (high << 4)).to(torch.float32) - 32
    return codes, (_fp16(blocks, 0) * sc,)


_K_CONVERTERS = {
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k,
    "IQ4_XS": _iq4_xs,
}  # fmt: skip


def _fp16_fields(values: torch.Tensor, type_name: str) -> torch.Tensor:
    """Scales or mins -> fp16: ggml's fp16 fields as they are; a K-quant's fp32 products
    rounded once (one correctly rounded cast), refused past fp16's range."""
    if values.dtype == torch.float16:
        return values
    out = values.to(torch.float16)
    if not torch.isfinite(out).all():
        worst = float(values.abs().max())
        raise ArtifactError(
            f"ggml {type_name}: a sub-block scale of {worst:.6g} is beyond fp16's range "
            "(65504), which our formats hold"
        )
    return out


def _q8_codes(qs: torch.Tensor) -> torch.Tensor:
    """int8 two's complement bytes -> offset-binary (`code + 128`): flip the top bit."""
    return qs ^ 0x80


def _q5_codes(rest: torch.Tensor) -> torch.Tensor:
    """Q5_0's and Q5_1's 4 bytes of high bits and 16 of nibbles -> `q = nib(j) | (bit j of
    the little-endian qh) << 4` (0..31, `nib` as Q4_0's), per block, packed as 5-bit codes
    `q - 16`: Q5_0's code (`w = (q - 16) d`), and Q5_1's stored value `q` (`w = q d + m`)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((rest[..., 0:4, None] >> shifts) & 1).reshape(*rest.shape[:-1], 32)
    qs = rest[..., 4:]
    q = torch.cat((qs & 15, qs >> 4), dim=-1) | (high << 4)
    return pack_codes(q.reshape(-1, 32).to(torch.int16) - 16, 5)


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


#: Code converters of the 32-weight block types (`_blocks_converter`).
_CODES = {
    "Q4_0": _q4_codes,
    "Q4_1": _q4_codes,
    "Q8_0": _q8_codes,
    "Q5_0": _q5_codes,
    "Q5_1": _q5_codes,
    "IQ4_NL": _q4_codes,  # indices into the code book, in Q4_0's nibble order
}
