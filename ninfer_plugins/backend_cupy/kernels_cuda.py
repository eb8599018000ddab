"""The CUDA C source of the CuPy backend's kernels, as one string NVRTC compiles.

Two kernels per (bits, mins, activation dtype), both reading NInfer's packed codes as
stored (`ninfer_core/quant/formats.py`): per row, a little-endian bit stream of
offset-binary codes (code `i` in bits `[i*bits, (i+1)*bits)`), an fp16 scale per group
and, for an asymmetric format (Q4G32M), an fp16 minimum per group.

- `gemv_<key>`: decode. One warp per output row (`WARPS` rows a block); each lane takes
  chunks of 8 codes (`bits` bytes, inside one group since every group is a multiple of
  8), dequantizes them in fp32 and multiplies them with up to `GEMV_MAX_ROWS` activation
  rows; a warp shuffle sums the lanes. Weights are read once for all the rows.
- `dequant_<key>`: prefill. One thread per 8 codes writes a dense `[rows, cols]` tile
  in the activations' dtype, which cuBLAS (torch.matmul) then multiplies.

Dequantizing is exact in fp32 (`code * scale`; `u * scale + min` rounds once), as
`QuantizedTensor.dequantize` does. The source includes no header (fp16 conversions are
PTX `cvt` instructions, bf16 ones bit operations), so plain NVRTC compiles it without a
CUDA toolkit's include directory.
"""

from __future__ import annotations

#: Activation rows one `gemv` launch multiplies (the accumulators each lane keeps).
GEMV_MAX_ROWS = 8
#: Warps (output rows) per `gemv` block.
WARPS = 4
#: Threads per `dequant` block.
DEQUANT_THREADS = 256
#: Activation dtypes, by the name `kernel_name` takes, and the template tag they get.
ACTIVATIONS = {"f16": 0, "bf16": 1, "f32": 2}
#: (bits, mins) of the code layouts the kernels read.
LAYOUTS = ((4, False), (5, False), (6, False), (8, False), (4, True))


def kernel_name(op: str, bits: int, mins: bool, activation: str) -> str:
    """`gemv_b4m_bf16`: the extern "C" name of `op` for one layout and activation dtype."""
    return f"{op}_b{bits}{'m' if mins else ''}_{activation}"


_PRELUDE = r"""
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define GEMV_MAX_ROWS @GEMV_MAX_ROWS@
#define WARPS @WARPS@

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_float(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}
__device__ __forceinline__ u16 float_to_bf16(float f) {
    // round to nearest even; a NaN stays a (quiet) NaN
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// Activation storage and conversions: DT 0 fp16, 1 bf16, 2 fp32.
template <int DT> struct Act;
template <> struct Act<0> {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return half_to_float(v); }
    static __device__ __forceinline__ T store(float f) { return float_to_half(f); }
};
template <> struct Act<1> {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return bf16_to_float(v); }
    static __device__ __forceinline__ T store(float f) { return float_to_bf16(f); }
};
template <> struct Act<2> {
    typedef float T;
    static __device__ __forceinline__ float load(T v) { return v; }
    static __device__ __forceinline__ T store(float f) { return f; }
};

// Codes 8c .. 8c+7 of a row: 8*BITS bits starting at byte c*BITS. Rows of 4-bit codes
// are multiples of 16 bytes and rows of 8-bit codes multiples of 32 (the host checks
// the base is 16-byte aligned), so those two load whole words.
template <int BITS>
__device__ __forceinline__ u64 load_chunk(const u8* row, int c) {
    const u8* p = row + (size_t)c * BITS;
    if (BITS == 4) return (u64)(*(const u32*)p);
    if (BITS == 8) return *(const u64*)p;
    u64 v = 0;
#pragma unroll
    for (int i = 0; i < BITS; ++i) v |= ((u64)p[i]) << (8 * i);
    return v;
}

// The 8 weights of a chunk in fp32: (u - 2^(BITS-1)) * scale (exact), or for an
// asymmetric format u * scale + min (the product exact, the sum rounded once).
template <int BITS, bool MINS>
__device__ __forceinline__ void dequant8(u64 bits, float scale, float mn, float* w) {
    const u32 mask = (1u << BITS) - 1u;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float u = (float)((u32)(bits >> (j * BITS)) & mask);
        if (MINS) {
            w[j] = __fadd_rn(__fmul_rn(u, scale), mn);
        } else {
            w[j] = __fmul_rn(u - (float)(1 << (BITS - 1)), scale);
        }
    }
}

// y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]) for t < T <= GEMV_MAX_ROWS.
// x: [T, cols], y: [T, rows], row-major; one warp per n.
template <int BITS, bool MINS, int DT>
__device__ __forceinline__ void gemv(
    const u8* packed, const u16* scales, const u16* mins, const void* xv, void* yv,
    const void* bv, int rows, int cols, int T, int group, int has_bias) {
    typedef typename Act<DT>::T A;
    const A* x = (const A*)xv;
    A* y = (A*)yv;
    const A* bias = (const A*)bv;
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (n >= rows) return;  // the whole warp: n is the same for its 32 lanes
    const int padded = ((cols + group - 1) / group) * group;
    const int groups = padded / group;
    const int chunks = padded / 8;
    const u8* row = packed + (size_t)n * (size_t)(padded / 8 * BITS);
    const u16* srow = scales + (size_t)n * groups;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_ROWS; ++t) acc[t] = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        const int k0 = c * 8;
        const int g = k0 / group;
        const float mn = MINS ? half_to_float(mins[(size_t)n * groups + g]) : 0.f;
        float w[8];
        dequant8<BITS, MINS>(load_chunk<BITS>(row, c), half_to_float(srow[g]), mn, w);
        const bool whole = k0 + 8 <= cols;  // else the padded tail of the row
#pragma unroll
        for (int t = 0; t < GEMV_MAX_ROWS; ++t) {
            if (t < T) {
                const A* xr = x + (size_t)t * cols + k0;
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (whole || k0 + j < cols) s += w[j] * Act<DT>::load(xr[j]);
                }
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_ROWS; ++t) {
        if (t < T) {
            float s = acc[t];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            if (lane == 0) {
                if (has_bias) s += Act<DT>::load(bias[n]);
                y[(size_t)t * rows + n] = Act<DT>::store(s);
            }
        }
    }
}

// out: [rows, cols] row-major in the activations' dtype; one thread per 8 codes.
template <int BITS, bool MINS, int DT>
__device__ __forceinline__ void dequant(
    const u8* packed, const u16* scales, const u16* mins, void* outv, int rows, int cols,
    int group) {
    typedef typename Act<DT>::T A;
    A* out = (A*)outv;
    const int padded = ((cols + group - 1) / group) * group;
    const int groups = padded / group;
    const int chunks = padded / 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * chunks) return;
    const int n = (int)(i / chunks);
    const int c = (int)(i % chunks);
    const int k0 = c * 8;
    const int g = k0 / group;
    const u8* row = packed + (size_t)n * (size_t)(padded / 8 * BITS);
    const float mn = MINS ? half_to_float(mins[(size_t)n * groups + g]) : 0.f;
    float w[8];
    dequant8<BITS, MINS>(load_chunk<BITS>(row, c), half_to_float(scales[(size_t)n * groups + g]),
                         mn, w);
    A* o = out + (size_t)n * cols + k0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (k0 + j < cols) o[j] = Act<DT>::store(w[j]);
    }
}

#define NINFER_KERNELS(KEY, BITS, MINS, DT)                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) gemv_##KEY(                     \
        const u8* packed, const u16* scales, const u16* mins, const void* x, void* y,        \
        const void* bias, int rows, int cols, int T, int group, int has_bias) {              \
        gemv<BITS, MINS, DT>(packed, scales, mins, x, y, bias, rows, cols, T, group,         \
                             has_bias);                                                      \
    }                                                                                        \
    extern "C" __global__ void dequant_##KEY(const u8* packed, const u16* scales,            \
                                             const u16* mins, void* out, int rows, int cols, \
                                             int group) {                                    \
        dequant<BITS, MINS, DT>(packed, scales, mins, out, rows, cols, group);               \
    }
"""


def _instances() -> str:
    lines = []
    for bits, mins in LAYOUTS:
        for act, tag in ACTIVATIONS.items():
            key = kernel_name("", bits, mins, act)[1:]  # `b4m_bf16`
            lines.append(f"NINFER_KERNELS({key}, {bits}, {'true' if mins else 'false'}, {tag})")
    return "\n".join(lines) + "\n"


#: The whole translation unit.
SOURCE = (
    _PRELUDE.replace("@GEMV_MAX_ROWS@", str(GEMV_MAX_ROWS)).replace("@WARPS@", str(WARPS))
    + _instances()
)
#: NVRTC options (no include paths: the source needs no header).
OPTIONS: tuple[str, ...] = ("--std=c++14",)
