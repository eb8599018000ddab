"""The CPU decode GEMVs of `csrc/cpu_gemv.cpp`, built at run time, and the layers that
run them: `GemvLinear` (dense bf16), `Q4GemvLinear` and `Q8GemvLinear` (group codes),
and `gemv_f32` for plain fp32 matrices (`f32_decodes` says when).

A decode step is bound by how fast its weight matrices stream from memory. Each thread
of these loops reads its weight rows one at a time in memory order, one stream the
hardware prefetcher follows: at SmolLM2's and Qwen3-0.6B's shapes on 2 threads the bf16
loop reads 30 and 43 GB/s out of cache, against 17-19 for oneDNN's GEMV over its packed
layout (docs/performance.md). The loops are C++ registered as torch operators, so a
compiled decode step calls them from its C++ wrapper with no Python in between.

They are built once per machine with torch's extension builder (a C++ compiler and
ninja; cached under torch's extension folder) when the CPU has AVX512-BF16 and VNNI.
Without either, `available()` says why: dense bf16 weights stay on oneDNN
(`OneDNNLinear`) and quantized ones on torch's int4 kernel (`Int4Linear`).
`NINFER_CPU_GEMV=0` turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ninfer_core.kernels.row_chunks import linear_by_row_chunks
from ninfer_core.model.ops import PackedLinear
from ninfer_core.quant.codes import unpack_codes
from ninfer_core.quant.formats import WeightFormat
from ninfer_core.quant.tensor import QuantizedTensor

log = logging.getLogger(__name__)

#: The `ninfer_cpu` operators: these GEMVs, and the paged decode attention
#: (`cpu_attention.py`), one library built and loaded together.
_SOURCES = [str(Path(__file__).with_name("csrc") / name)
            for name in ("cpu_gemv.cpp", "cpu_attention.cpp")]  # fmt: skip
#: `-fopenmp`: `at::parallel_for` is a header template whose threads are OpenMP pragmas,
#: compiled here; without it every call runs on one thread. `-falign-loops=64`: the GEMVs'
#: inner loops start on a cache line, so their speed depends less on where the linker
#: puts them (without it the same 4-bit loop read 29-36 G codes/s from cache, 1 thread,
#: from one build to another).
_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
          "-mavx512vnni", "-mf16c", "-mfma", "-falign-loops=64"]  # fmt: skip


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.cache
def unavailable() -> str | None:
    """Why the GEMV operators can't run in this process, or None once they are built
    and loaded (the first call builds them: seconds, or a minute the first time on a
    machine)."""
    if os.environ.get("NINFER_CPU_GEMV", "1") == "0":
        return "NINFER_CPU_GEMV=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    missing = [f for f in ("avx512_bf16", "avx512_vnni", "f16c", "fma") if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="ninfer_cpu", sources=_SOURCES, extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
            build_directory=str(_build_directory(cpp_extension)),
        )  # fmt: skip
    except Exception as exc:  # no compiler, no ninja, a build error: oneDNN serves
        lines = str(exc).strip().splitlines() or [""]
        said = next((ln for ln in lines if "error:" in ln), lines[0])  # the compiler's
        reason = f"{type(exc).__name__}: {said.strip()[:300]}"
        log.warning("CPU GEMV kernels not built, dense bf16 decode stays on oneDNN: %s", reason)
        return reason
    _register_fake()
    _key_compiled_graphs()
    return None


#: A build lock older than this is left by a builder that died (a build takes a few
#: minutes on 2 cores); torch's builder would wait on it forever.
STALE_LOCK_S = 15 * 60


def _sources_tag() -> str:
    """`ninfer_cpu-<digest>`: the operators' sources and flags, hashed."""
    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(Path(source).read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    return f"ninfer_cpu-{digest.hexdigest()[:16]}"


def _build_directory(cpp_extension) -> Path:
    """Where these sources build: a folder of their own under torch's extension cache, so
    two checkouts (or versions) of NInfer never build over each other's objects, and one
    whose sources are unchanged reuses its build. A lock left by a killed build is
    removed, with a warning, instead of being waited on."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    folder = Path(root) / f"{_sources_tag()}-{python}-torch{torch.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return folder
    if age > STALE_LOCK_S:
        log.warning("removing a stale build lock %s (%.0f min old)", lock, age / 60)
        lock.unlink(missing_ok=True)
    return folder


def _key_compiled_graphs() -> None:
    """Key the compiler's graph cache on these operators' sources. A compiled step calls
    them from C++ by their schema, and inductor's cache does not key on a library's code:
    a graph cached before an operator changed (an argument added, even with a default)
    would call it with the old arguments and crash the process."""
    tag = _sources_tag()
    config = torch.compiler.config
    if tag not in config.cache_key_tag.split():
        config.cache_key_tag = f"{config.cache_key_tag} {tag}".strip()


def available() -> bool:
    return unavailable() is None


def _require() -> None:
    if (reason := unavailable()) is not None:
        raise RuntimeError(f"the CPU GEMV kernels are not available: {reason}")


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ w[N, K].T -> [M, N] bf16, through the built operator."""
    return torch.ops.ninfer_cpu.gemv_bf16(x, w)


def f32_decodes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `x @ w.T` of a plain fp32 matrix takes `gemv_f32`: decode rows (up to
    `GemvLinear.MAX_ROWS`) of fp32 activations on the CPU, a contiguous weight and
    nothing that needs autograd; the caller knows the operators are built (`available`,
    which a compiled graph can't call). torch's fp32 matmul of one row goes to a
    BLAS that runs threads of its own beside torch's: the built-in model's fp32 decode got
    68-77% of its two threads and ran at a quarter of bf16's speed. The weights stay plain
    tensors (the MoE experts index them, the memory plan counts them as loaded)."""
    return (
        x.dim() == 2
        and w.dim() == 2
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.shape[0] <= GemvLinear.MAX_ROWS
        and w.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def gemv_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ w[N, K].T -> [M, N] fp32, through the built operator (the bf16
    GEMV's row walk with fp32 FMAs)."""
    return torch.ops.ninfer_cpu.gemv_f32(x, w)


@functools.cache
def _register_fake() -> None:
    """The operators' shape and dtype rules for the compiler (once, after the library is
    loaded). Inductor's graph cache does not key on these functions: after changing a
    rule, change the operator's schema too (or clear the cache), or a cached graph built
    on the old rule is reused."""

    @torch.library.register_fake("ninfer_cpu::gemv_bf16")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("ninfer_cpu::gemv_f32")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("ninfer_cpu::gemv_q4")
    def _(x, codes, scales, mins, high=None, book=None):
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("ninfer_cpu::gemv_q8")
    def _(x, codes, scales, mins):
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("ninfer_cpu::dequantize_q4")
    def _(codes, scales, mins, start, n, bf16, high=None, book=None):
        dtype = torch.bfloat16 if bf16 else torch.float32
        return codes.new_empty((n, 2 * codes.shape[1]), dtype=dtype)

    @torch.library.register_fake("ninfer_cpu::dequantize_q8")
    def _(codes, scales, mins, start, n, bf16):
        dtype = torch.bfloat16 if bf16 else torch.float32
        return codes.new_empty((n, codes.shape[1]), dtype=dtype)

    @torch.library.register_fake("ninfer_cpu::decode_attention")
    def _(q, k_pages, v_pages, table, context, k_new, v_new, width, scale):
        return q.new_empty(q.shape)  # in q's dtype

    @torch.library.register_fake("ninfer_cpu::decode_attention_coded")
    def _(q, k_codes, k_scales, v_codes, v_scales, table, context, k_new, k_new_scales,
          v_new, v_new_scales, width, scale):  # fmt: skip
        return q.new_empty(q.shape)  # in q's dtype


def _group_supported(group: int) -> bool:
    """Whether the operators take this group width: 1-16 whole blocks of 32 columns that
    tile a step of 16 blocks (32, 64, 128, 256 or 512 columns), a group's one scale
    spread over its blocks in registers; or 16 columns (ggml's Q2_K, Q3_K and Q6_K
    sub-blocks), two scales a block."""
    return group == 16 or (group % 32 == 0 and 16 % (group // 32) == 0)


def codes_supported(
    fmt: WeightFormat, device: torch.device | str, dtype: torch.dtype | None
) -> bool:
    """Whether `codes_linear` runs weights of `fmt` for `dtype` activations on `device`:
    2- to 6- or 8-bit codes in groups the operators take (`_group_supported`), bf16 on
    the CPU, the GEMVs built."""
    return (
        fmt.quantized
        and fmt.bits in (2, 3, 4, 5, 6, 8)
        and _group_supported(fmt.group)
        and dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and available()
    )


def codes_linear(w: QuantizedTensor) -> Q4GemvLinear | Q8GemvLinear:
    """The GEMV layer of a `codes_supported` weight: codes of up to 6 bits on the 4-bit
    GEMV (nibbles, and planes of high bits past 4), 8-bit ones on the 8-bit."""
    return Q4GemvLinear(w) if w.fmt.bits in Q4GemvLinear.TAKES else Q8GemvLinear(w)


def codes_linear_nbytes(fmt: WeightFormat, shape: tuple[int, int]) -> int | None:
    """Bytes `codes_linear` holds beyond the loaded weight, from the shape alone: a 2- to
    6-bit layer's re-laid copy in nibbles and high bits; None for 8 bits, which holds the
    loaded codes and scales."""
    return Q4GemvLinear.nbytes_for(fmt, shape) if fmt.bits in Q4GemvLinear.TAKES else None


class GemvLinear(PackedLinear):
    """A dense bf16 `[out, in]` weight kept row-major: decode rows (up to `MAX_ROWS`) run
    the AVX512-BF16 GEMV, more rows (a prefill chunk) `F.linear`, which reaches within
    10% of oneDNN's packed GEMM at 512 rows here. One copy of the weight serves both."""

    #: Rows of x that still take the GEMV (decode batches, speculative rounds); each row
    #: beyond the first re-reads the weight from cache.
    MAX_ROWS = 16

    def __init__(self, w: torch.Tensor) -> None:
        _require()
        self.weight = w.detach().contiguous()
        self.out_features, self.in_features = (int(n) for n in w.shape)
        self.dtype = w.dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > self.MAX_ROWS:
            return F.linear(x, self.weight, b)
        y = gemv_bf16(x, self.weight)
        return y if b is None else y + b

    def __repr__(self) -> str:
        return f"GemvLinear([{self.out_features}, {self.in_features}], {self.dtype})"


class _CodesGemvLinear(PackedLinear):
    """A group-quantized `[out, in]` weight on a GEMV over its codes: decode rows (up to
    `MAX_ROWS`) run the operator, which carries x as two int8 planes per block of 32
    columns (x / dx rounded, and what that left, finer) and multiplies them with the codes
    as integers (VNNI): 0.17% relative error on a random row, against 0.23% for bf16
    activations through torch's int4 kernel (one plane, as llama.cpp's Q8 activations,
    is 0.5%). More rows (a prefill chunk) dequantize the weight to bf16 a row chunk at a
    time and run dense GEMMs."""

    MAX_ROWS = GemvLinear.MAX_ROWS
    #: Weight elements dequantized at a time on the dense path (8 MiB of bf16).
    DENSE_CHUNK_ELEMS = 1 << 22

    #: The code width this layer's operator takes, and the widths it holds in it.
    BITS: int
    TAKES: tuple[int, ...]
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def __init__(self, w: QuantizedTensor) -> None:
        _require()
        if w.fmt.bits not in self.TAKES or not _group_supported(w.fmt.group):
            widths = "-, ".join(str(b) for b in self.TAKES)
            raise ValueError(
                f"{type(self).__name__} takes {widths}-bit codes in groups of 16, 32, 64, "
                f"128, 256 or 512 columns, not {w.fmt.name}"
            )
        self.out_features, self.in_features = w.shape
        self.padded_in = w.padded_cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def weight_rows(self, start: int, n: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows `start:start + n` dequantized, `[n, padded_in]` in `dtype`, as
        `QuantizedTensor.dequantize` computes them (fp32, exact before one rounding)."""
        bf16 = dtype == torch.bfloat16
        rows = self._dequantize(start, n, bf16)
        return rows if bf16 else rows.to(dtype)

    def _dequantize(self, start: int, n: int, bf16: bool) -> torch.Tensor:
        """`weight_rows` in bf16, or else fp32, by this layer's operator."""
        raise NotImplementedError

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] bf16 -> [T, out] bf16
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if x.shape[0] > self.MAX_ROWS:
            step = max(64, self.DENSE_CHUNK_ELEMS // self.padded_in // 64 * 64)
            return linear_by_row_chunks(
                x, b, self.out_features, step,
                lambda x, start, n: F.linear(x, self.weight_rows(start, n)),
            )  # fmt: skip
        y = self._gemv(x)
        return y if b is None else y + b

    def __repr__(self) -> str:
        mins = " (scale and min)" if self.mins is not None else ""
        return f"{type(self).__name__}([{self.out_features}, {self.in_features}]{mins})"


#: Blocks of 32 columns a step of the 4-bit GEMV interleaves (`_interleave_blocks`).
_STEP_BLOCKS = 16


def _steps(blocks: int) -> list[tuple[int, int]]:
    """A row's blocks as the 4-bit GEMV's steps: (first block, blocks), 16 a step but
    the last."""
    return [(b, min(_STEP_BLOCKS, blocks - b)) for b in range(0, blocks, _STEP_BLOCKS)]


def _interleave_blocks(code_bytes: torch.Tensor) -> torch.Tensor:
    """`[rows, blocks, 16]` code bytes (a block's bytes in order) as the 4-bit GEMV reads
    them, `[rows, blocks * 16]`: in each whole step of 16 blocks, byte 4c + j of block l
    at offset 64c + 4l + j, so each 32-bit lane of the operator's 64-byte loads holds four
    bytes of one block, and a block's sums gather in one lane (`dot_q4`). The t < 16
    blocks left at a row's end stay in order."""
    rows = code_bytes.shape[0]
    parts = [
        code_bytes[:, b : b + t].reshape(rows, t, 4, 4).transpose(1, 2).reshape(rows, 16 * t)
        if t == _STEP_BLOCKS
        else code_bytes[:, b : b + t].reshape(rows, 16 * t)
        for b, t in _steps(code_bytes.shape[1])
    ]
    return torch.cat(parts, dim=1)


def _high_bit_chunks(blocks: int) -> list[torch.Tensor]:
    """The columns of a row's codes in the order `gemv_q4` unpacks them, one tensor per
    chunk of 64 code bytes: the columns of its low nibbles as the operator's 64-byte
    vector holds them, then those of its high nibbles (128 columns; fewer in the row's
    tail, where a chunk holds 16 of each of its up to 4 blocks). A chunk's planes of high
    bits follow this order, a bit a column (`Q4GemvLinear`)."""
    chunks = []
    for b, t in _steps(blocks):
        if t == _STEP_BLOCKS:  # chunk c, lane l, byte i: column 4c + i of block b + l
            c, lane, i = torch.meshgrid(torch.arange(4), torch.arange(16), torch.arange(4),
                                        indexing="ij")  # fmt: skip
            low = list((32 * (b + lane) + 4 * c + i).reshape(4, 64))
        else:  # four blocks a chunk, each block's 16 columns in order
            low = list((32 * b + torch.arange(32 * t).view(t, 32)[:, :16].reshape(-1)).split(64))
        chunks += [torch.cat((cols.reshape(-1), cols.reshape(-1) + 16)) for cols in low]
    return chunks


class Q4GemvLinear(_CodesGemvLinear):
    """A 4-bit `[out, in]` weight (Q4_0, Q4_1, Q4G64, ...) for `ninfer_cpu::gemv_q4`:
    1.15-1.25x torch's int4 kernel over SmolLM2's and Qwen3-0.6B's layers, out of cache.

    Held: the codes re-laid in ggml's block order (a block's 16 bytes hold its columns j
    and j + 16), the blocks interleaved 16 at a time (`_interleave_blocks`), half a byte a
    weight; and a copy of the fp16 scales (and mins), one per group: the operator spreads
    a group's scale over its blocks of 32 in registers, so a group of 64 costs 4.25 bits a
    weight, not the 4.5 of its scale repeated per block.

    2- and 3-bit codes (Q2G16M, Q3G16: ggml's Q2_K and Q3_K, a scale per 16 columns) are
    held as nibbles, 5 or 6 bits a weight with the scales: their stored values where the
    format has mins (`w = u * d + m`), `code + 8` where it is symmetric (`w = (u - 8) d`).

    5- and 6-bit codes (Q5G32, Q5G32M, Q6G16, Q6G64, ...: ggml's Q5_0, Q5_K and Q6_K) keep
    their low four bits as nibbles and the rest in one or two planes of high bits, a bit a
    weight each, in the order the operator unpacks the nibbles (`_high_bit_chunks`; plane p
    of a chunk after plane p - 1). Symmetric codes are stored `code + 16` or `code + 32`
    (`w = (u - 16) d`, `(u - 32) d`). Held so, Q5_K takes 6 bits a weight and Q6_K 7,
    where 8-bit codes took 9.

    A code-book format (IQ4G32: ggml's IQ4_NL and IQ4_XS) keeps its 4-bit indices as the
    nibbles, and the operator shuffles them into the book's values (`book`: value + 128,
    `w = (u - 128) d`): 4.5 bits a weight, where its values as 8-bit codes took 8.5.
    """

    BITS = 4
    TAKES = (2, 3, 4, 5, 6)
    #: Rows converted at a time at load (bounds the int8 codes in flight).
    CHUNK_ROWS = 4096

    def __init__(self, w: QuantizedTensor) -> None:
        super().__init__(w)
        # A scale per 16 over an odd number of 16s: one zero sub-block more (x is 0 there).
        extra = self.padded_in % 32
        self.padded_in += extra
        rows, blocks = self.out_features, self.padded_in // 32
        self.planes = _planes(w.fmt)
        # code -> the value the operator reads: the stored value with mins, else the code
        # plus 8, 16 or 32 (the operator's symmetric offset); a code book's stored index
        offset = -w.fmt.qmin if w.fmt.mins or w.fmt.book else 8 << self.planes
        self.book = None if w.fmt.book is None else _book_values(w.fmt.book)
        self.codes = torch.empty(rows, self.padded_in // 2, dtype=torch.uint8)
        self.high = (
            torch.empty(rows, self.padded_in // 8 * self.planes, dtype=torch.uint8)
            if self.planes
            else None
        )
        chunks = _high_bit_chunks(blocks) if self.planes else []
        for start in range(0, rows, self.CHUNK_ROWS):
            part = w.narrow_rows(start, min(self.CHUNK_ROWS, rows - start))
            codes = unpack_codes(part.packed, 4) if self.book is not None else part.codes()
            u = (F.pad(codes, (0, extra)) + offset).to(torch.uint8)  # 0 .. 2^bits - 1
            nib = (u & 15).view(-1, blocks, 2, 16)
            end = start + u.shape[0]
            self.codes[start:end] = _interleave_blocks(nib[:, :, 0] | (nib[:, :, 1] << 4))
            if self.high is not None:
                self.high[start:end] = _pack_high_bits(u, chunks, self.planes)
        # Copies, not views of the loaded tensors: a tied head's layer then holds what
        # `nbytes_for` says beside the embedding table, which keeps its own (the planner
        # counts both).
        self.scales = F.pad(w.scales, (0, extra // 16)).contiguous()
        self.mins = None if w.mins is None else F.pad(w.mins, (0, extra // 16)).contiguous()

    @staticmethod
    def nbytes_for(fmt: WeightFormat, shape: tuple[int, int]) -> int:
        """`nbytes` of the `Q4GemvLinear` of a `shape` matrix in `fmt`, from the shape."""
        rows, cols = int(shape[0]), int(shape[1])
        padded = fmt.padded_cols(cols)
        groups = padded // fmt.group
        if padded % 32:
            padded, groups = padded + 16, groups + 1
        high = rows * padded // 8 * _planes(fmt)
        return rows * padded // 2 + high + rows * groups * 2 * (2 if fmt.mins else 1)

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.numel() * 2
        high = 0 if self.high is None else self.high.numel()
        return self.codes.numel() + high + self.scales.numel() * 2 + mins

    def _dequantize(self, start: int, n: int, bf16: bool) -> torch.Tensor:
        """`u * d + m` (`m = -8 d`, `-16 d` or `-32 d` for a symmetric format, `-128 d` for
        a code book's values)."""
        return torch.ops.ninfer_cpu.dequantize_q4(
            self.codes, self.scales, self.mins, start, n, bf16, self.high, self.book
        )

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ninfer_cpu.gemv_q4(
            x, self.codes, self.scales, self.mins, self.high, self.book
        )


def _planes(fmt: WeightFormat) -> int:
    """The planes of high bits a `Q4GemvLinear` holds for `fmt`: one per bit beyond 4."""
    return max(0, fmt.bits - 4)


@functools.cache
def _book_values(book: tuple[int, ...]) -> torch.Tensor:
    """A code book as `gemv_q4` takes it: its 16 values plus 128, uint8 (one tensor per
    book, shared by every layer that reads it)."""
    return torch.tensor([v + 128 for v in book], dtype=torch.uint8)


def _pack_high_bits(u: torch.Tensor, chunks: list[torch.Tensor], planes: int) -> torch.Tensor:
    """Codes `u` [rows, K] (uint8) -> their bits 4 .. 3 + planes as `gemv_q4` reads them,
    [rows, planes * K / 8]: per chunk (`_high_bit_chunks`), plane 0's bits in the chunk's
    column order, then plane 1's, eight a byte, the first in bit 0."""
    rows = u.shape[0]
    bits = torch.stack([(u >> (4 + p)) & 1 for p in range(planes)], dim=1)  # [rows, P, K]
    ordered = torch.cat([bits[:, :, cols].reshape(rows, -1) for cols in chunks], dim=1)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (ordered.view(rows, -1, 8) * weights).sum(dim=2, dtype=torch.uint8)


class Q8GemvLinear(_CodesGemvLinear):
    """An 8-bit `[out, in]` weight (W8G32, ggml's Q8_0; W8G16, a mixed fused group) for
    `ninfer_cpu::gemv_q8`: 1.6x torch's int4 kernel over the same codes as two 4-bit
    halves (SmolLM2's head, 49152 x 576: 1.0 against 1.6 ms). It holds the loaded codes
    (stored as `code + 128`, the unsigned operand VNNI multiplies) and scales themselves:
    a tied head shares the embedding's bytes. A format with mins (W8G32M, W8G16M: mixed
    fused groups with an 8-bit part) computes `u * d + m`."""

    BITS = 8
    TAKES = (8,)

    def __init__(self, w: QuantizedTensor) -> None:
        super().__init__(w)
        self.codes = w.packed.contiguous()
        self.scales = w.scales.contiguous()
        self.mins = None if w.mins is None else w.mins.contiguous()
        if self.padded_in % 32:  # W8G16 rows of an odd number of 16s: one zero sub-block more
            self.codes = F.pad(self.codes, (0, 16), value=128)  # x is 0 there: any code
            self.scales = F.pad(self.scales, (0, 1))
            self.mins = None if self.mins is None else F.pad(self.mins, (0, 1))
            self.padded_in += 16

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.numel() * 2
        return self.codes.numel() + self.scales.numel() * 2 + mins

    def _dequantize(self, start: int, n: int, bf16: bool) -> torch.Tensor:
        """`(u - 128) * d`, or `u * d + m` with mins."""
        return torch.ops.ninfer_cpu.dequantize_q8(
            self.codes, self.scales, self.mins, start, n, bf16
        )

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ninfer_cpu.gemv_q8(x, self.codes, self.scales, self.mins)
