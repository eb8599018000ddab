// Decode GEMVs for x86 CPUs with AVX512-BF16: y[m, n] = sum_k x[m, k] * w[n, k].
//
// A decode step multiplies one row (or a few) by every weight matrix, so it is bound by
// how fast the weights stream from memory. Each thread walks its share of the weight rows
// in memory order, one row at a time, so its reads are one sequential stream the
// hardware prefetcher follows: about 30 GB/s at SmolLM2's shapes and 43 GB/s at
// Qwen3-0.6B's on 2 threads, against 22 and 32 for eight rows read side by side (eight
// short streams, the next block prefetched by hand) and 31 and 49 for a bare read of the
// same bytes. Products are pairs of bf16 summed in fp32 by `vdpbf16ps`; rows of x beyond
// the first re-read the weight row from L1, not from memory.
//
// Registered as torch operators (`ninfer_cpu::...`), so a compiled graph calls them
// from C++ without Python. Built at run time by `ninfer_core/kernels/cpu_gemv.py`.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch rounds
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu)) return (bits >> 16) | 0x40;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline __m512 dp(__m512 acc, const uint16_t* w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
}

// One x row against one weight row: four accumulators over 128 columns a step (to hide
// the multiply's latency), then 32 at a time, then the tail masked.
inline float dot_row(const uint16_t* x, const uint16_t* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    a0 = dp(a0, w + k, x + k);
    a1 = dp(a1, w + k + 32, x + k + 32);
    a2 = dp(a2, w + k + 64, x + k + 64);
    a3 = dp(a3, w + k + 96, x + k + 96);
  }
  for (; k + 32 <= K; k += 32) a0 = dp(a0, w + k, x + k);
  if (k < K) {
    const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k),
                          (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemv_bf16: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "gemv_bf16: bf16 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv_bf16: CPU tensors");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = wc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // Rows in blocks of 8 per task: whole cache lines of y per thread.
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = to_bf16(dot_row(xp + m * K, wp + n * K, K));
  });
  return y;
}


// fp32 rows: sixteen FMAs a vector, four accumulators over 64 columns a step.
inline float dot_row_f32(const float* x, const float* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
  if (k < K) {
    const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
    a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + k), _mm512_maskz_loadu_ps(mask, x + k), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// y = x w^T for fp32 x [M, K] and w [N, K]: the bf16 GEMV's row walk (`gemv_bf16`) over
// fp32 weights. torch's fp32 matmul of one row goes to a BLAS that runs its own threads
// beside torch's: the built-in model's fp32 decode used 68-77% of its two threads.
at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemv_f32: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "gemv_f32: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv_f32: CPU tensors");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = wc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot_row_f32(xp + m * K, wp + n * K, K);
  });
  return y;
}

// ------------------------------------------------------- 4- and 8-bit weights
//
// `gemv_q4`: weights of 4-bit codes u (0..15) in blocks of 32 columns, w = d * u + m with
// an fp16 scale d and min m per group of 1-16 blocks or per 16 columns (a symmetric
// format passes no mins: m = -8 d).
// A block's 16 code bytes hold columns j (low nibble) and j + 16 (high), as ggml's
// Q4_0/Q4_1 do, and a row's blocks are interleaved 16 at a time, four bytes of each
// block in turn (`dot_q4`). 5- and 6-bit codes (ggml's Q5_0, Q5_K, Q6_K) add one or two
// planes of high bits to the nibbles (`add_high`): u = nibble + 16 h0 + 32 h1, and a
// symmetric format's m = -16 d or -32 d. A code book (ggml's IQ4_NL and IQ4_XS) maps
// each nibble to u = book value + 128 by a byte shuffle (`book_table`), m = -128 d
// (`symmetric_offset`). `gemv_q8`: 8-bit codes stored u = code + 128, w = d * (u - 128)
// (ggml's Q8_0), or w = d * u + m with mins, a scale (and min) per group of 1-16 blocks or
// per 16 columns (a mixed group's codes). x is quantized per call, per
// block of 32, to two int8 planes (`quantize_x`), and `vpdpbusd` multiplies codes and x
// as exact integers, 64 code bytes at a time: a 4-bit block's sums land in one lane, an
// 8-bit block's in eight. The two planes' sums are joined as integers (256 q + r: a
// shift, where a second conversion and FMA stood), then scaled by d * dx / 256 in fp32.
// A min (and the 4-bit layer's symmetric offset) multiplies the quantized x's sums per
// block (or per 16 columns) in fp32; the 8-bit symmetric offset stays an integer.

// Storage on 64-byte boundaries: every 64-byte load of x's planes then reads one cache
// line, not two.
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
using Plane = std::vector<int8_t, Aligned64<int8_t>>;

// x quantized per block of 32 columns and laid out to match the codes, per row. 4-bit
// layout: per step of 16 blocks, 256 bytes of the blocks' columns 0..15 (`lo`) and 256
// of columns 16..31 (`hi`), interleaved as the codes are. 8-bit layout: `xq`, the
// columns in order. Per block the scale `dx` and `sx`, the quantized values' sum times dx
// (the offset term of a min), and `sx16`, the same per 16 columns.
// `sym` (8-bit), per 32-bit lane of a chunk, -128 times the joined sum of the x that
// lane multiplies (256 q + r): added to the joined sums, so a code's offset never needs
// subtracting. Rows are padded with zeros to whole groups of 16 blocks.
struct QuantX {
  int64_t blocks = 0;  // per row, a multiple of 16
  Plane lo, hi, xq;      // x / dx rounded
  Plane lo2, hi2, xq2;   // what that rounding left, times kFine, rounded
  std::vector<float> dx, sx;
  std::vector<float> sx16;  // sx per 16 columns (a min per 16 multiplies it)
  std::vector<int32_t> sym;
};

inline __m512 bf16_to_ps(const uint16_t* p) {  // 16 bf16 -> 16 fp32 (exact)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// x is carried as two int8 planes: q = round(x / dx), and r = round((x / dx - q) * kFine)
// (at most 127: the rare 128 saturates), so x = dx * (q + r / kFine) to within dx / 512
// (dx / 256 where r saturated): about as close as x's own bf16 rounding, where one int8
// plane alone (llama.cpp's Q8 activations) is off by up to dx / 2 and doubled SmolLM2's
// decode logit error against fp32 (0.020 -> 0.039; llama.cpp 0.029). kFine = 256 joins
// the planes' sums by a shift.
constexpr float kFine = 256.f;
constexpr int kFineShift = 8;
// How far ahead of a row walk the codes are prefetched: the hardware prefetcher stops at
// each 4 KiB page, software prefetches don't (1.1-1.2x on the 0.6B 4-bit matrices).
constexpr int kAhead = 2048;

// The 8-bit offset term of each lane of a block, -128 (256 sum(q) + sum(r)), into `sym`.
inline void lane_sums(const int8_t* q, const int8_t* r, int32_t* sym) {
  for (int l = 0; l < 8; ++l) {
    int32_t sq = 0, sr = 0;
    for (int i = 4 * l; i < 4 * l + 4; ++i) sq += q[i], sr += r[i];
    sym[l] = -128 * ((sq << kFineShift) + sr);
  }
}

void quantize_x(const uint16_t* x, int64_t M, int64_t K, int bits, QuantX& q) {
  const int64_t nb = K / 32, blocks = (nb + 15) / 16 * 16;
  q.blocks = blocks;
  for (auto* v : {&q.lo, &q.hi, &q.lo2, &q.hi2}) v->assign(bits == 4 ? M * blocks * 16 : 0, 0);
  for (auto* v : {&q.xq, &q.xq2}) v->assign(bits == 8 ? M * blocks * 32 : 0, 0);
  q.dx.assign(M * blocks, 0.f);
  q.sx.assign(M * blocks, 0.f);
  q.sx16.assign(M * blocks * 2, 0.f);
  q.sym.assign(bits == 8 ? M * blocks * 8 : 0, 0);
  const __m512 fine = _mm512_set1_ps(kFine);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 v0 = bf16_to_ps(x + m * K + b * 32), v1 = bf16_to_ps(x + m * K + b * 32 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // Round to nearest even (the default rounding mode), then narrow to int8.
      const __m512 s0 = _mm512_mul_ps(v0, inv), s1 = _mm512_mul_ps(v1, inv);
      const __m512i q0 = _mm512_cvtps_epi32(s0), q1 = _mm512_cvtps_epi32(s1);
      // |s - q| <= 1/2, so r lies in -128..128: 128 saturates to 127 here, before the sums.
      const __m512i top = _mm512_set1_epi32(127);
      const __m512i r0 = _mm512_min_epi32(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(s0, _mm512_cvtepi32_ps(q0)), fine)), top);
      const __m512i r1 = _mm512_min_epi32(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(s1, _mm512_cvtepi32_ps(q1)), fine)), top);
      const int64_t row = m * blocks + b;
      // The min term multiplies the quantized x's sum, so the error of a dot product is
      // the weights times x's rounding error, as with the codes' term.
      const float dx = amax / 127.f;
      q.dx[row] = dx;
      q.sx[row] = dx * (float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1))) +
                        float(_mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1))) / kFine);
      q.sx16[2 * row] =
          dx * (float(_mm512_reduce_add_epi32(q0)) + float(_mm512_reduce_add_epi32(r0)) / kFine);
      q.sx16[2 * row + 1] =
          dx * (float(_mm512_reduce_add_epi32(q1)) + float(_mm512_reduce_add_epi32(r1)) / kFine);
      if (bits == 4) {
        // Columns 0..15 to `lo`, 16..31 to `hi`, laid out as the codes: in a whole step
        // of 16 blocks, lane l = b % 16 of chunk c takes columns 4c..4c+3 of each half;
        // in the row's last t < 16 blocks, a block's 16 columns in order (`dot_q4`).
        const bool whole = b < nb / 16 * 16;
        const int64_t at = m * blocks * 16 + (whole ? b / 16 * 256 + (b % 16) * 4 : b * 16);
        const __m128i planes[4] = {_mm512_cvtsepi32_epi8(q0), _mm512_cvtsepi32_epi8(q1),
                                   _mm512_cvtsepi32_epi8(r0), _mm512_cvtsepi32_epi8(r1)};
        int8_t* dst[4] = {q.lo.data() + at, q.hi.data() + at, q.lo2.data() + at, q.hi2.data() + at};
        for (int p = 0; p < 4; ++p) {
          if (!whole) {
            _mm_storeu_si128((__m128i*)dst[p], planes[p]);
            continue;
          }
          alignas(16) int8_t v[16];
          _mm_store_si128((__m128i*)v, planes[p]);
          for (int c = 0; c < 4; ++c) std::memcpy(dst[p] + 64 * c, v + 4 * c, 4);
        }
      } else {
        // Lane l of a chunk (two blocks) sums bytes 4l..4l+3: eight lanes a block.
        int8_t *xq = q.xq.data() + row * 32, *xq2 = q.xq2.data() + row * 32;
        _mm_storeu_si128((__m128i*)xq, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(xq + 16), _mm512_cvtsepi32_epi8(q1));
        _mm_storeu_si128((__m128i*)xq2, _mm512_cvtsepi32_epi8(r0));
        _mm_storeu_si128((__m128i*)(xq2 + 16), _mm512_cvtsepi32_epi8(r1));
        lane_sums(xq, xq2, q.sym.data() + row * 8);
      }
    }
  }
}

// Which of a step's 16 per-block values each lane of chunk `c` takes, where a block takes
// `per` lanes of a chunk and a chunk 16 / per blocks (the 8-bit layouts).
inline __m512i spread(int per, int c) {
  alignas(64) int32_t idx[16];
  for (int l = 0; l < 16; ++l) idx[l] = (16 / per) * c + l / per;
  return _mm512_load_si512(idx);
}

// A row's fp16 scales (or mins) of blocks b .. b + 15 as 16 fp32: one value per group of
// 2^gshift blocks (1-16), loaded once and spread over the group's blocks by `expand`. A
// group of 64 or more keeps one scale per group in memory (Q4G64: 4.25 bits a weight, not
// 4.5 with its scale repeated per block). Shifts, not divisions: a group is a power of
// two blocks, and an `idiv` per step is tens of cycles.
inline __m512 block_values(const uint16_t* d, int64_t b, int64_t left, int gshift, __m512i expand) {
  const int64_t n = (left + (1 << gshift) - 1) >> gshift;
  const __m512 v =
      _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), d + (b >> gshift)));
  return gshift == 0 ? v : _mm512_permutexvar_ps(expand, v);
}

// Values per 16 columns (scales, mins, x's sums) of blocks b .. b + 15 of a row, two a
// block, as two vectors of 16: each block's first half (`lo`, its low nibbles) and its
// second (`hi`).
inline void split_halves(__m512 v0, __m512 v1, __m512& lo, __m512& hi) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  lo = _mm512_permutex2var_ps(v0, even, v1);
  hi = _mm512_permutex2var_ps(v0, odd, v1);
}

// A row's fp16 values per 16 columns of its blocks b .. b + left - 1 (`split_halves`).
inline void half_values(const uint16_t* d, int64_t b, int64_t left, __m512& lo, __m512& hi) {
  const __mmask32 m = left >= 16 ? ~0u : (1u << (2 * left)) - 1u;
  const __m512i raw = _mm512_maskz_loadu_epi16(m, d + 2 * b);
  split_halves(_mm512_cvtph_ps(_mm512_castsi512_si256(raw)),
               _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1)), lo, hi);
}

// The bits of the `n` (at most 8) bytes at `p` as a mask: bit i of byte 0 first. One
// masked load (no bytes past n are read), not a copy of a run-time length.
inline __mmask64 bits_at(const uint8_t* p, int64_t n) {
  if (n == 8) return _cvtu64_mask64(*reinterpret_cast<const uint64_t*>(p));
  const __m128i v = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p);
  return _cvtu64_mask64(static_cast<uint64_t>(_mm_cvtsi128_si64(v)));
}

// A chunk's high-bit planes added to its unpacked codes: `lo` and `hi`, the low and high
// nibbles of its 64 code bytes as bytes. A chunk of `blocks` blocks (4, fewer only at a
// row's end) holds 4 * blocks bytes a plane: the bits of `lo`'s 16 * blocks bytes, then
// `hi`'s, bit i for byte i. Plane p adds 16 << p where its bit is set: one masked add a
// vector, so a 5- or 6-bit code costs its bytes and two or four instructions per 128.
template <int kHigh>
inline void add_high(const uint8_t* high, int64_t blocks, __m512i& lo, __m512i& hi) {
  for (int p = 0; p < kHigh; ++p) {
    const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << p));
    const uint8_t* at = high + 4 * blocks * p;
    lo = _mm512_mask_add_epi8(lo, bits_at(at, 2 * blocks), lo, add);
    hi = _mm512_mask_add_epi8(hi, bits_at(at + 2 * blocks, 2 * blocks), hi, add);
  }
}

// A step's integer sums scaled into `acc`: joined as 256 q + r where that stays below
// 2^24 and converts to fp32 exactly (4-bit codes: at most 256 * 32 * 15 * 127 +
// 32 * 15 * 127), else (`kWide`) converted apart (5- and 6-bit codes reach 2^26, a code
// book's values 2^28). `scale` includes the 1 / 256 of r.
template <bool kWide>
inline __m512 scaled_sums(__m512i q, __m512i r, __m512 scale, __m512 acc) {
  if constexpr (!kWide)
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(q, kFineShift), r)),
                           scale, acc);
  const __m512 coarse = _mm512_mul_ps(scale, _mm512_set1_ps(kFine));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), coarse,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), scale, acc));
}

// The offset m / d of a symmetric 4-bit layer's codes: -8, -16 or -32 for 4-, 5- and
// 6-bit codes (`planes` of high bits), -128 for a code book's values (stored value + 128).
constexpr float symmetric_offset(int planes, bool book) {
  return book ? -128.f : -float(8 << planes);
}

// A code book's 16 stored values (value + 128) in each 128-bit lane, for `vpshufb`: the
// nibbles index it.
inline __m512i book_table(const uint8_t* book) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(book)));
}

// A chunk's 64 code bytes unpacked to the codes u of its low and high nibbles, a byte
// each: the nibbles, plus the high-bit planes of 5- and 6-bit codes (`add_high`), or
// through a code book.
template <int kHigh, bool kBook>
inline void unpack_chunk(__m512i v, const uint8_t* high, int64_t blocks, __m512i table,
                         __m512i& lo, __m512i& hi) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  lo = _mm512_and_si512(v, nib);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  if constexpr (kHigh > 0) add_high<kHigh>(high, blocks, lo, hi);
  if constexpr (kBook) {
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  }
}

// The last t < 16 blocks of a 4-bit row, four blocks (16 lanes) a chunk, block j taking
// lanes 4 (j % 4) .. 4 (j % 4) + 3: each chunk's joined sums scaled by a permute of the
// blocks' scales (`quads`) into `acc`. With a scale per 16 columns (`kPer16`), the low
// nibbles' sums take `scale` and the high ones' `scale_hi`.
// A lane sums at most eight products a plane of x, so 256 q + r stays below 2^24 with
// 6-bit codes too; a code book's values need the sums apart.
template <bool kPer16, int kHigh, bool kBook>
inline __m512 tail_q4(const uint8_t* codes, const uint8_t* high, __m512i table, int64_t t,
                      const int8_t* xlo, const int8_t* xhi, const int8_t* xlo2,
                      const int8_t* xhi2, __m512 scale, __m512 scale_hi, const __m512i* quads,
                      __m512 acc) {
  const __m512i zero = _mm512_setzero_si512();
  for (int c = 0; 4 * c < t; ++c) {
    const int64_t blocks = std::min<int64_t>(4, t - 4 * c);
    const __mmask64 cmask = blocks == 4 ? ~0ull : (1ull << (16 * blocks)) - 1;
    const int64_t at = 64 * c;
    __m512i lo, hi;
    unpack_chunk<kHigh, kBook>(_mm512_maskz_loadu_epi8(cmask, codes + at),
                               high + 16 * kHigh * c, blocks, table, lo, hi);
    const __m512i qlo = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(xlo + at));
    const __m512i rlo = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(xlo2 + at));
    const __m512i qhi = _mm512_dpbusd_epi32(zero, hi, _mm512_loadu_si512(xhi + at));
    const __m512i rhi = _mm512_dpbusd_epi32(zero, hi, _mm512_loadu_si512(xhi2 + at));
    const __m512 s = _mm512_permutexvar_ps(quads[c], scale);
    if constexpr (kPer16) {
      acc = scaled_sums<kBook>(qlo, rlo, s, acc);
      acc = scaled_sums<kBook>(qhi, rhi, _mm512_permutexvar_ps(quads[c], scale_hi), acc);
    } else {
      acc = scaled_sums<kBook>(_mm512_add_epi32(qlo, qhi), _mm512_add_epi32(rlo, rhi), s, acc);
    }
  }
  return acc;
}

// One 4-bit weight row against one quantized x row, 16 blocks a step. The codes of a
// step are interleaved (`Q4GemvLinear`): its chunk c (64 bytes) holds, in lane l, bytes
// 4c..4c+3 of block l. Each lane so sums one block's products, exactly, over the step's
// four chunks and both planes of x, and the step scales them with one conversion and one
// FMA: 1.15-1.2x the codes a second from cache of a layout with a block per four lanes
// (a permute, conversion and FMA per chunk); streamed from memory, the same. The t < 16
// blocks left at a row's end (SmolLM2's 576 columns: 18 blocks) keep that layout, a
// block's 16 bytes in order and four blocks a chunk (`tail_q4`): interleaved, they would
// take four chunks' multiplies for one chunk's codes.
//
// With a scale (and min) per 16 columns (`kPer16`: ggml's Q3_K and Q2_K), a block's low
// nibbles are its first 16 columns and its high ones the other 16, so the low and high
// sums stay apart (each below 2^24 too) and take their own scale.
//
// 5- and 6-bit codes (`kHigh` planes of high bits, `add_high`) take the same steps, their
// planes' bits added to the unpacked nibbles; the planes of a row's block b start at byte
// 4 kHigh b of its `high` row, a chunk's 16 kHigh bytes after the last. A code book
// (`kBook`) shuffles the nibbles into its values.
template <bool kMins, bool kPer16, int kHigh, bool kBook>
inline float dot_q4(const uint8_t* codes, const uint8_t* high, const uint8_t* book,
                    const uint16_t* d, const uint16_t* mn, int64_t nb, int gshift,
                    __m512i expand, const QuantX& q, int64_t m, const __m512i* quads) {
  constexpr bool kWide = kHigh > 0 || kBook;
  const __m512i table = kBook ? book_table(book) : _mm512_setzero_si512();
  const int8_t* xlo = q.lo.data() + m * q.blocks * 16;
  const int8_t* xhi = q.hi.data() + m * q.blocks * 16;
  const int8_t* xlo2 = q.lo2.data() + m * q.blocks * 16;
  const int8_t* xhi2 = q.hi2.data() + m * q.blocks * 16;
  const float* dx = q.dx.data() + m * q.blocks;
  const float* sx = q.sx.data() + m * q.blocks;
  const float* sx16 = q.sx16.data() + m * q.blocks * 2;
  const __m512 unfine = _mm512_set1_ps(1.f / kFine);
  const __m512 off = _mm512_set1_ps(symmetric_offset(kHigh, kBook));
  __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const int64_t left = std::min<int64_t>(16, nb - b);
    const __m512 dxs = _mm512_mul_ps(_mm512_loadu_ps(dx + b), unfine);
    __m512 scale, scale_hi = _mm512_setzero_ps();
    if constexpr (kPer16) {
      // x rows are padded to 16 blocks: sx16[2b .. 2b + 31] exist.
      __m512 dlo, dhi, mlo, mhi, xlo16, xhi16;
      half_values(d, b, left, dlo, dhi);
      if (kMins) {
        half_values(mn, b, left, mlo, mhi);
      } else {
        mlo = _mm512_mul_ps(dlo, off), mhi = _mm512_mul_ps(dhi, off);
      }
      split_halves(_mm512_loadu_ps(sx16 + 2 * b), _mm512_loadu_ps(sx16 + 2 * b + 16), xlo16, xhi16);
      macc = _mm512_fmadd_ps(mhi, xhi16, _mm512_fmadd_ps(mlo, xlo16, macc));
      scale = _mm512_mul_ps(dlo, dxs), scale_hi = _mm512_mul_ps(dhi, dxs);
    } else {
      const __m512 dw = block_values(d, b, left, gshift, expand);
      scale = _mm512_mul_ps(dw, dxs);
      const __m512 mterm = kMins ? block_values(mn, b, left, gshift, expand) : _mm512_mul_ps(dw, off);
      macc = _mm512_fmadd_ps(mterm, _mm512_loadu_ps(sx + b), macc);
    }
    const int64_t at = b * 16;  // codes and x's planes: 256 bytes a step of 16 blocks
    if (left < 16) {
      acc = tail_q4<kPer16, kHigh, kBook>(codes + at, high + 4 * kHigh * b, table, left,
                                          xlo + at, xhi + at, xlo2 + at, xhi2 + at, scale,
                                          scale_hi, quads, acc);
      break;
    }
    // Four sums, two chains of dependent `vpdpbusd` each: a plane of x by half the codes.
    __m512i q0 = _mm512_setzero_si512(), q1 = q0, r0 = q0, r1 = q0;
    for (int c = 0; c < 4; ++c) {
      const uint8_t* chunk = codes + at + 64 * c;
      _mm_prefetch((const char*)chunk + kAhead, _MM_HINT_T0);
      __m512i lo, hi;
      unpack_chunk<kHigh, kBook>(_mm512_loadu_si512(chunk),
                                 high + 4 * kHigh * b + 16 * kHigh * c, 4, table, lo, hi);
      q0 = _mm512_dpbusd_epi32(q0, lo, _mm512_loadu_si512(xlo + at + 64 * c));
      q1 = _mm512_dpbusd_epi32(q1, hi, _mm512_loadu_si512(xhi + at + 64 * c));
      r0 = _mm512_dpbusd_epi32(r0, lo, _mm512_loadu_si512(xlo2 + at + 64 * c));
      r1 = _mm512_dpbusd_epi32(r1, hi, _mm512_loadu_si512(xhi2 + at + 64 * c));
    }
    if constexpr (kPer16)
      acc = scaled_sums<kWide>(q1, r1, scale_hi, scaled_sums<kWide>(q0, r0, scale, acc));
    else
      acc = scaled_sums<kWide>(_mm512_add_epi32(q0, q1), _mm512_add_epi32(r0, r1), scale, acc);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc, macc));
}

// One chunk of 8-bit codes, blocks `blk` and `blk + 1` of a row (only the first where
// `left` is 1), against x's planes: per 32-bit lane, the joined sums 256 q + r as fp32,
// with the symmetric offset added (`sym`) unless the format has mins.
template <bool kMins>
inline __m512 chunk_q8(const uint8_t* codes, int64_t blk, int64_t left, const int8_t* xq,
                       const int8_t* xq2, const int32_t* sym) {
  const __mmask64 cmask = left >= 2 ? ~0ull : (1ull << 32) - 1;
  const int64_t at = blk * 32;
  _mm_prefetch((const char*)(codes + at) + kAhead, _MM_HINT_T0);
  const __m512i v = _mm512_maskz_loadu_epi8(cmask, codes + at);
  __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(xq + at));
  isum = _mm512_slli_epi32(isum, kFineShift);
  if (!kMins) isum = _mm512_add_epi32(isum, _mm512_loadu_si512(sym + blk * 8));
  isum = _mm512_dpbusd_epi32(isum, v, _mm512_loadu_si512(xq2 + at));
  return _mm512_cvtepi32_ps(isum);
}

// One 8-bit weight row (stored codes u = code + 128, 0..255, w = d * (u - 128); with
// mins, w = d * u + m, the min multiplying x's block sums in fp32 as in `dot_q4`): 16
// blocks (eight chunks of two) a step.
template <bool kMins>
inline float dot_q8(const uint8_t* codes, const uint16_t* d, const uint16_t* mn, int64_t nb,
                    int gshift, __m512i expand, const QuantX& q, int64_t m, const __m512i* lanes) {
  const int8_t* xq = q.xq.data() + m * q.blocks * 32;
  const int8_t* xq2 = q.xq2.data() + m * q.blocks * 32;
  const float* dx = q.dx.data() + m * q.blocks;
  const float* sx = q.sx.data() + m * q.blocks;
  const int32_t* sym = q.sym.data() + m * q.blocks * 8;
  const __m512 unfine = _mm512_set1_ps(1.f / kFine);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const int64_t left = std::min<int64_t>(16, nb - b);
    const __m512 dw = block_values(d, b, left, gshift, expand);
    const __m512 scale = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_loadu_ps(dx + b)), unfine);
    if (kMins)
      macc = _mm512_fmadd_ps(block_values(mn, b, left, gshift, expand), _mm512_loadu_ps(sx + b), macc);
    for (int c = 0; c < 8 && 2 * c < left; ++c) {
      const __m512 s = chunk_q8<kMins>(codes, b + 2 * c, left - 2 * c, xq, xq2, sym);
      if (c & 1) acc1 = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(lanes[c], scale), acc1);
      else acc0 = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(lanes[c], scale), acc0);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), macc));
}

// One 8-bit weight row with a scale per 16 columns (ggml's Q6_K sub-blocks, whose codes
// widen to 8 bits): 8 blocks of x (16 weight scales, four chunks of two blocks) a step.
// A lane's four columns lie in one sub-block, so the sums are those of `dot_q8`; only the
// scale each lane takes differs: sub-block 4c + l / 4 (`lanes`: four lanes a sub-block),
// times x's scale of its block of 32 (`pairs`: lane l takes block l / 2). A min per 16
// multiplies x's sums per 16 columns.
template <bool kMins>
inline float dot_q8_16(const uint8_t* codes, const uint16_t* d, const uint16_t* mn, int64_t nb,
                       const QuantX& q, int64_t m, const __m512i* lanes, __m512i pairs) {
  const int8_t* xq = q.xq.data() + m * q.blocks * 32;
  const int8_t* xq2 = q.xq2.data() + m * q.blocks * 32;
  const float* dx = q.dx.data() + m * q.blocks;
  const float* sx16 = q.sx16.data() + m * q.blocks * 2;
  const int32_t* sym = q.sym.data() + m * q.blocks * 8;
  const __m512 unfine = _mm512_set1_ps(1.f / kFine);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 8) {
    const int64_t left = std::min<int64_t>(8, nb - b);
    const __mmask16 dmask = (__mmask16)((1u << (2 * left)) - 1);
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(dmask, d + 2 * b));
    if (kMins)  // x rows are padded to 16 blocks: sx16[2b .. 2b + 15] exist
      macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(dmask, mn + 2 * b)),
                             _mm512_loadu_ps(sx16 + 2 * b), macc);
    // x rows are padded to 16 blocks and b is a multiple of 8: dx[b .. b + 7] exist.
    const __m512 dxs = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(dx + b)));
    const __m512 scale = _mm512_mul_ps(_mm512_mul_ps(dw, dxs), unfine);
    for (int c = 0; c < 4 && 2 * c < left; ++c) {
      const __m512 s = chunk_q8<kMins>(codes, b + 2 * c, left - 2 * c, xq, xq2, sym);
      if (c & 1) acc1 = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(lanes[c], scale), acc1);
      else acc0 = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(lanes[c], scale), acc0);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), macc));
}

// The planes of high bits of a 4-bit weight's codes (0, 1 or 2: 4-, 5- or 6-bit codes),
// from `high` [N, planes * K / 8], checked against codes [N, K / 2].
int high_planes(const char* name, const std::optional<at::Tensor>& high, int64_t N, int64_t K) {
  if (!high) return 0;
  TORCH_CHECK(high->dim() == 2 && high->scalar_type() == at::kByte && high->is_contiguous() &&
                  high->size(0) == N && K > 0 && K % 32 == 0 &&
                  (high->size(1) == K / 8 || high->size(1) == K / 4),
              name, ": high bits, contiguous uint8 [N, K / 8] (5-bit codes) or [N, K / 4] (6-bit)");
  return static_cast<int>(high->size(1) * 8 / K);
}

// A 4-bit weight's code book (16 stored values, value + 128), or null; checked against
// its other inputs: a code book maps plain nibbles, with no planes and no mins.
const uint8_t* code_book(const char* name, const std::optional<at::Tensor>& book, int planes,
                         bool mins) {
  if (!book) return nullptr;
  TORCH_CHECK(book->dim() == 1 && book->numel() == 16 && book->scalar_type() == at::kByte &&
                  book->is_contiguous() && planes == 0 && !mins,
              name, ": a code book is 16 uint8 values (value + 128), without high bits or mins");
  return book->data_ptr<uint8_t>();
}

// The checks and the row loop both GEMVs over codes share.
at::Tensor gemv_codes(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& high,
                      const std::optional<at::Tensor>& book, int bits) {
  const char* name = bits == 4 ? "gemv_q4" : "gemv_q8";
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && scales.dim() == 2, name,
              ": x [M, K], codes [N, K * bits / 8], scales [N, K / group]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / 32;
  const int64_t groups = scales.size(1), gb = groups > 0 && nb % groups == 0 ? nb / groups : 0;
  const bool per16 = nb > 0 && groups == 2 * nb;  // a scale per 16 columns
  TORCH_CHECK(K % 32 == 0 && codes.size(1) * 8 == K * bits && scales.size(0) == N &&
                  ((gb > 0 && 16 % gb == 0) || per16),
              name, ": x [M, K] with K a multiple of 32, codes [N, K * bits / 8], scales [N, K / group] ",
              "with a group of 16, 32, 64, 128, 256 or 512 columns");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && codes.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kHalf,
              name, ": bf16 x, uint8 codes, fp16 scales");
  TORCH_CHECK(!mins || (mins->sizes() == scales.sizes() && mins->scalar_type() == at::kHalf),
              name, ": mins like scales");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scales.contiguous();
  const at::Tensor mc = mins ? mins->contiguous() : at::Tensor();
  const int planes = high_planes(name, high, N, K);
  const auto* hp = planes ? high->data_ptr<uint8_t>() : nullptr;
  const int64_t high_bytes = K / 8 * planes;
  const uint8_t* bp = code_book(name, book, planes, mins.has_value());
  TORCH_CHECK(!bp || !per16, name, ": a code book takes a scale per 32 columns or more");
  thread_local QuantX q;  // reused across calls: no allocation per call
  quantize_x(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, bits, q);
  at::Tensor y = at::empty({M, N}, xc.options());
  const auto* cp = cc.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(sc.data_ptr());
  const auto* mp = mins ? reinterpret_cast<const uint16_t*>(mc.data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const QuantX& qx = q;
  // 8-bit codes: the lanes a block takes in a chunk (eight), 8 chunks a step of 16 blocks.
  __m512i lanes[8];
  for (int c = 0; c < 8; ++c) lanes[c] = spread(8, c);
  alignas(64) int32_t idx[16];
  for (int l = 0; l < 16; ++l) idx[l] = per16 ? 0 : l / gb;  // per16 takes `quads`
  const __m512i expand = _mm512_load_si512(idx);
  for (int l = 0; l < 16; ++l) idx[l] = l / 2;
  const __m512i pairs = _mm512_load_si512(idx);
  __m512i quads[4];  // four lanes a value: 4-bit tails, and 8-bit scales per 16 columns
  for (int c = 0; c < 4; ++c) quads[c] = spread(4, c);
  const int g = gb > 0 ? __builtin_ctzll(gb) : 0;  // gb is 1, 2, 4, 8 or 16
  const int64_t row_bytes = K * bits / 8;
  // Each kind of row gets a loop of its own (one instantiation of `rows`), chosen once
  // here rather than per row; `mins` says at compile time whether the format has mins
  // (the row's mins pointer is null without them).
  auto rows = [&](auto dot) {
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m)
          yp[m * N + n] = to_bf16(dot(cp + n * row_bytes, hp ? hp + n * high_bytes : nullptr,
                                      dp + n * groups, mp ? mp + n * groups : nullptr, m));
    });
  };
  using Row = const uint8_t*;
  using Values = const uint16_t*;
  // A 4-bit row's loop for 0, 1 or 2 planes of high bits or a code book, chosen at
  // compile time.
  auto nibbles = [&](auto mins, auto per16_kind, auto high_kind, auto book_kind) {
    constexpr bool kMins = decltype(mins)::value, kPer16 = decltype(per16_kind)::value;
    constexpr int kHigh = decltype(high_kind)::value;
    constexpr bool kBook = decltype(book_kind)::value;
    rows([&](Row c, Row h, Values d, Values mn, int64_t m) {
      return dot_q4<kMins, kPer16, kHigh, kBook>(c, h, bp, d, mn, nb, g, expand, qx, m, quads);
    });
  };
  auto by_planes = [&](auto mins, auto per16_kind) {
    using Plain = std::false_type;
    if (bp)  // checked: no planes, no mins, no scale per 16
      nibbles(std::false_type{}, std::false_type{}, std::integral_constant<int, 0>{},
              std::true_type{});
    else if (planes == 2)
      nibbles(mins, per16_kind, std::integral_constant<int, 2>{}, Plain{});
    else if (planes == 1)
      nibbles(mins, per16_kind, std::integral_constant<int, 1>{}, Plain{});
    else
      nibbles(mins, per16_kind, std::integral_constant<int, 0>{}, Plain{});
  };
  auto by_kind = [&](auto mins) {
    constexpr bool kMins = decltype(mins)::value;
    if (per16 && bits == 4)
      by_planes(mins, std::true_type{});
    else if (per16)
      rows([&](Row c, Row, Values d, Values mn, int64_t m) {
        return dot_q8_16<kMins>(c, d, mn, nb, qx, m, quads, pairs);
      });
    else if (bits == 8)
      rows([&](Row c, Row, Values d, Values mn, int64_t m) {
        return dot_q8<kMins>(c, d, mn, nb, g, expand, qx, m, lanes);
      });
    else
      by_planes(mins, std::false_type{});
  };
  if (mp)
    by_kind(std::true_type{});
  else
    by_kind(std::false_type{});
  return y;
}

at::Tensor gemv_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& high,
                   const std::optional<at::Tensor>& book) {
  return gemv_codes(x, codes, scales, mins, high, book, 4);
}

at::Tensor gemv_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   const std::optional<at::Tensor>& mins) {
  return gemv_codes(x, codes, scales, mins, std::nullopt, std::nullopt, 8);
}

// ------------------------------------------------ prefill rows from the codes
//
// A prefill chunk multiplies bf16 rows of the weight; these operators dequantize them
// from the GEMVs' own codes: w = u * d + m (without mins, m = `symmetric_offset` d for
// the 4-bit layer, -128 d for the 8-bit one) in fp32, rounded once, as
// `QuantizedTensor.dequantize` computes it (u * d is exact: 8 by 11 bits at most, so one
// FMA rounds as u * d + m does). torch's ops over the interleaved nibbles took 0.33 G
// weights/s, a third of a 512-row chunk's GEMM time.

// Rows start .. start + n of codes [N, K * bits / 8] with fp16 scales (and mins) per
// group of 16 * 2^gshift columns, and where their values go: checked once for both widths.
struct DequantRows {
  int64_t K, groups;
  int gshift;
  const uint8_t* codes;  // row start
  const uint16_t* scales;
  const uint16_t* mins;  // or null
  at::Tensor out;  // [n, K], bf16 or fp32
  uint16_t* out16;
  float* out32;

  DequantRows(const char* name, const at::Tensor& c, const at::Tensor& s,
              const std::optional<at::Tensor>& m, int64_t start, int64_t n, bool bf16, int bits) {
    TORCH_CHECK(c.dim() == 2 && c.scalar_type() == at::kByte && c.is_contiguous() &&
                    s.dim() == 2 && s.scalar_type() == at::kHalf && s.is_contiguous() &&
                    s.size(0) == c.size(0),
                name, ": contiguous uint8 codes [N, K * bits / 8] and fp16 scales [N, groups]");
    TORCH_CHECK(!m || (m->sizes() == s.sizes() && m->scalar_type() == at::kHalf &&
                       m->is_contiguous()),
                name, ": mins like scales");
    K = c.size(1) * 8 / bits, groups = s.size(1);
    const int64_t per = groups > 0 && K % groups == 0 ? K / groups / 16 : 0;  // 16s a group
    TORCH_CHECK(K % (bits == 4 ? 32 : 16) == 0 && per > 0 && (per & (per - 1)) == 0, name,
                ": whole blocks and groups of 16, 32, 64, ... columns");
    TORCH_CHECK(start >= 0 && n >= 0 && start + n <= c.size(0), name, ": rows out of range");
    gshift = __builtin_ctzll(per);
    codes = c.data_ptr<uint8_t>() + start * c.size(1);
    scales = reinterpret_cast<const uint16_t*>(s.data_ptr()) + start * groups;
    mins = m ? reinterpret_cast<const uint16_t*>(m->data_ptr()) + start * groups : nullptr;
    out = at::empty({n, K}, c.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
    out16 = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
    out32 = bf16 ? nullptr : out.data_ptr<float>();
  }

  // Columns k .. k + 15 of row r: sixteen codes u as int32, in group `(k / 16) >> gshift`.
  void put(int64_t r, int64_t k, __m512i u, float offset) const {
    const int64_t g = r * groups + ((k / 16) >> gshift);
    const float d = _cvtsh_ss(scales[g]), m = mins ? _cvtsh_ss(mins[g]) : offset * d;
    const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_set1_ps(d), _mm512_set1_ps(m));
    if (out16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out16 + r * K + k),
                          (__m256i)_mm512_cvtneps_pbh(w));
    else
      _mm512_storeu_ps(out32 + r * K + k, w);
  }
};

// Four vectors' 32-bit lanes transposed 4 x 4 within each 128-bit lane, stored to `out`
// (256 bytes): lane j of vector i takes lane i of each vector's 128-bit lane j, in order.
inline void transpose_lanes(const __m512i* v, uint8_t* out) {
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  _mm512_store_si512(out, _mm512_unpacklo_epi64(t0, t2));
  _mm512_store_si512(out + 64, _mm512_unpackhi_epi64(t0, t2));
  _mm512_store_si512(out + 128, _mm512_unpacklo_epi64(t1, t3));
  _mm512_store_si512(out + 192, _mm512_unpackhi_epi64(t1, t3));
}

// Rows of a `gemv_q4` weight, a chunk of codes at a time unpacked as `dot_q4` reads it
// (`unpack_chunk`: its nibbles, with planes of high bits or through a code book), then
// each block's 32 codes gathered: in a whole step of 16 blocks, columns 4c..4c+3 of block
// l from lane l of chunk c (`_interleave_blocks`), by a transpose (`transpose_lanes`); in
// the row's tail, a block's 16 bytes in order.
at::Tensor dequantize_q4(const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t start, int64_t n,
                         bool bf16, const std::optional<at::Tensor>& high,
                         const std::optional<at::Tensor>& book) {
  const DequantRows rows("dequantize_q4", codes, scales, mins, start, n, bf16, 4);
  const int planes = high_planes("dequantize_q4", high, codes.size(0), rows.K);
  const uint8_t* bp = code_book("dequantize_q4", book, planes, mins.has_value());
  const __m512i table = bp ? book_table(bp) : _mm512_setzero_si512();
  const int64_t high_bytes = rows.K / 8 * planes, nb = rows.K / 32, whole = nb / 16 * 16;
  const uint8_t* hp = planes ? high->data_ptr<uint8_t>() + start * high_bytes : nullptr;
  const float offset = symmetric_offset(planes, bp != nullptr);
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    alignas(64) uint8_t lo[256], hi[256];  // a step's codes, a block's 16 bytes together
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* c = rows.codes + r * (rows.K / 2);
      const uint8_t* h = hp ? hp + r * high_bytes : nullptr;
      for (int64_t b = 0; b < nb; b += 16) {
        const int64_t left = std::min<int64_t>(16, nb - b);
        __m512i l[4], u[4];
        for (int64_t k = 0; 4 * k < left; ++k) {  // the step's chunks
          const int64_t blocks = b < whole ? 4 : std::min<int64_t>(4, left - 4 * k);
          const __mmask64 cmask = blocks == 4 ? ~0ull : (1ull << (16 * blocks)) - 1;
          const __m512i v = _mm512_maskz_loadu_epi8(cmask, c + b * 16 + 64 * k);
          const uint8_t* hk = h ? h + 4 * planes * b + 16 * planes * k : nullptr;
          if (bp)
            unpack_chunk<0, true>(v, hk, blocks, table, l[k], u[k]);
          else if (planes == 2)
            unpack_chunk<2, false>(v, hk, blocks, table, l[k], u[k]);
          else if (planes == 1)
            unpack_chunk<1, false>(v, hk, blocks, table, l[k], u[k]);
          else
            unpack_chunk<0, false>(v, hk, blocks, table, l[k], u[k]);
        }
        if (b < whole) {
          // Chunk k's lane 4j + i holds bytes 4k..4k+3 of block 4j + i: a 4 x 4 transpose
          // of 32-bit lanes within each 128-bit lane puts block 4j + i's 16 bytes in lane
          // j of vector i, stored at 64 i + 16 j.
          transpose_lanes(l, lo);
          transpose_lanes(u, hi);
        } else {  // the tail: a block's 16 bytes in order, chunk k at 64 k
          for (int64_t k = 0; 4 * k < left; ++k) {
            _mm512_store_si512(lo + 64 * k, l[k]);
            _mm512_store_si512(hi + 64 * k, u[k]);
          }
        }
        for (int64_t j = 0; j < left; ++j) {
          const int64_t at = b < whole ? 64 * (j % 4) + 16 * (j / 4) : 16 * j;
          const int64_t k0 = (b + j) * 32;
          rows.put(r, k0, _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(lo + at))), offset);
          rows.put(r, k0 + 16, _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(hi + at))),
                   offset);
        }
      }
    }
  });
  return rows.out;
}

// Rows of a `gemv_q8` weight: stored codes u = code + 128 in column order.
at::Tensor dequantize_q8(const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t start, int64_t n,
                         bool bf16) {
  const DequantRows rows("dequantize_q8", codes, scales, mins, start, n, bf16, 8);
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < rows.K; k += 16) {
        const auto* at = reinterpret_cast<const __m128i*>(rows.codes + r * rows.K + k);
        rows.put(r, k, _mm512_cvtepu8_epi32(_mm_loadu_si128(at)), -128.f);
      }
  });
  return rows.out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_f32(Tensor x, Tensor w) -> Tensor");
  m.def(
      "gemv_q4(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? high=None, "
      "Tensor? book=None) -> Tensor");
  m.def("gemv_q8(Tensor x, Tensor codes, Tensor scales, Tensor? mins) -> Tensor");
  m.def(
      "dequantize_q4(Tensor codes, Tensor scales, Tensor? mins, int start, int n, bool bf16, "
      "Tensor? high=None, Tensor? book=None) -> Tensor");
  m.def(
      "dequantize_q8(Tensor codes, Tensor scales, Tensor? mins, int start, int n, bool bf16) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(ninfer_cpu, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_f32", &gemv_f32);
  m.impl("gemv_q4", &gemv_q4);
  m.impl("gemv_q8", &gemv_q8);
  m.impl("dequantize_q4", &dequantize_q4);
  m.impl("dequantize_q8", &dequantize_q8);
}
