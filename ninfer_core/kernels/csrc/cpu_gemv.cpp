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
#include <optional>
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


// ---------------------------------------------------------------- 4-bit weights
//
// `gemv_q4`: weights of 4-bit codes u (0..15) in blocks of 32 columns, w = d * u + m with
// an fp16 scale d and min m per block (a symmetric format passes no mins: m = -8 d).
// A block's 16 code bytes hold columns j (low nibble) and j + 16 (high), as ggml's
// Q4_0/Q4_1 do. x is quantized per call to int8 per block of 32 (scale max|x| / 127,
// llama.cpp's Q8 activations), and `vpdpbusd` multiplies codes and x as exact integers:
// four blocks (64 code bytes) a step, each block's sums landing in four lanes, which are
// then scaled by d * dx in fp32. The min term uses the sums of the quantized x.

// x, quantized and laid out to match the codes, per row: per chunk of four blocks, 64
// bytes of the blocks' columns 0..15 (`lo`) and 64 of columns 16..31 (`hi`); per block
// the scale `dx` and the sum `sx` of the quantized values; and `sym`, per chunk, each
// lane's share of -8 * sum(xq), the start of a symmetric format's integer sums (there
// w = d * (u - 8): the -8 is folded into the integers). Rows are padded to whole groups
// of 16 blocks with zeros.
struct QuantX {
  int64_t chunks;  // per row, a multiple of 4
  std::vector<int8_t> lo, hi;
  std::vector<float> dx, sx;
  std::vector<int32_t> sym;
};

inline __m512 bf16_to_ps(const uint16_t* p) {  // 16 bf16 -> 16 fp32 (exact)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

void quantize_x(const uint16_t* x, int64_t M, int64_t K, QuantX& q) {
  const int64_t nb = K / 32, chunks = (nb + 15) / 16 * 4;
  q.chunks = chunks;
  q.lo.assign(M * chunks * 64, 0);
  q.hi.assign(M * chunks * 64, 0);
  q.dx.assign(M * chunks * 4, 0.f);
  q.sx.assign(M * chunks * 4, 0.f);
  q.sym.assign(M * chunks * 16, 0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 v0 = bf16_to_ps(x + m * K + b * 32), v1 = bf16_to_ps(x + m * K + b * 32 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // Round to nearest even (the default rounding mode), then narrow to int8.
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      const int64_t at = m * chunks * 64 + b * 16;
      _mm_storeu_si128((__m128i*)(q.lo.data() + at), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128((__m128i*)(q.hi.data() + at), _mm512_cvtsepi32_epi8(q1));
      // The min term multiplies the quantized x's sum, so the error of a dot product is
      // the weights times x's rounding error, as with the codes' term.
      const float dx = amax / 127.f;
      q.dx[m * chunks * 4 + b] = dx;
      q.sx[m * chunks * 4 + b] = dx * float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      // Lane l of a chunk sums bytes 4l..4l+3 of lo and of hi: block b's lanes are
      // 4 (b % 4) .. 4 (b % 4) + 3, each taking four of its columns from each half.
      const int8_t* lo = q.lo.data() + at;
      const int8_t* hi = q.hi.data() + at;
      for (int l = 0; l < 4; ++l) {
        int32_t sum = 0;
        for (int j = 0; j < 4; ++j) sum += lo[4 * l + j] + hi[4 * l + j];
        q.sym[m * chunks * 16 + b * 4 + l] = -8 * sum;
      }
    }
  }
}

// One weight row against one quantized x row: 16 blocks (four chunks) a step, their
// scales d * dx computed once, each chunk's four lanes per block scaled by a permute.
template <bool kMins>
inline float dot_q4(const uint8_t* codes, const uint16_t* d, const uint16_t* mn, int64_t nb,
                    const QuantX& q, int64_t m) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i spread[4] = {
      _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
      _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4),
      _mm512_set_epi32(11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8),
      _mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12)};
  const int8_t* xlo = q.lo.data() + m * q.chunks * 64;
  const int8_t* xhi = q.hi.data() + m * q.chunks * 64;
  const float* dx = q.dx.data() + m * q.chunks * 4;
  const float* sx = q.sx.data() + m * q.chunks * 4;
  const int32_t* sym = q.sym.data() + m * q.chunks * 16;
  __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const int64_t left = std::min<int64_t>(16, nb - b);
    const __mmask16 smask = (__mmask16)((1u << left) - 1);
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(smask, d + b));
    const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(dx + b));
    if (kMins)
      macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(smask, mn + b)),
                             _mm512_loadu_ps(sx + b), macc);
    for (int c = 0; c < 4 && 4 * c < left; ++c) {
      const int64_t blocks = std::min<int64_t>(4, left - 4 * c);
      const __mmask64 cmask = blocks == 4 ? ~0ull : (1ull << (16 * blocks)) - 1;
      const int64_t at = (b + 4 * c) * 16;
      const __m512i v = _mm512_maskz_loadu_epi8(cmask, codes + at);
      const __m512i lo = _mm512_and_si512(v, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      const __m512i init = kMins ? _mm512_setzero_si512() : _mm512_loadu_si512(sym + (b + 4 * c) * 4);
      __m512i isum = _mm512_dpbusd_epi32(init, lo, _mm512_loadu_si512(xlo + at));
      isum = _mm512_dpbusd_epi32(isum, hi, _mm512_loadu_si512(xhi + at));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(spread[c], scale), acc);
    }
  }
  return _mm512_reduce_add_ps(kMins ? _mm512_add_ps(acc, macc) : acc);
}

at::Tensor gemv_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   const std::optional<at::Tensor>& mins) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && scales.dim() == 2,
              "gemv_q4: x [M, K], codes [N, K / 2], scales [N, K / 32]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && codes.size(1) * 2 == K && scales.size(0) == N &&
                  scales.size(1) == nb,
              "gemv_q4: x [M, K] with K a multiple of 32, codes [N, K / 2], scales [N, K / 32]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && codes.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kHalf,
              "gemv_q4: bf16 x, uint8 codes, fp16 scales");
  TORCH_CHECK(!mins || (mins->sizes() == scales.sizes() && mins->scalar_type() == at::kHalf),
              "gemv_q4: mins like scales");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scales.contiguous();
  const at::Tensor mc = mins ? mins->contiguous() : at::Tensor();
  thread_local QuantX q;  // reused across calls: no allocation per call
  quantize_x(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, q);
  at::Tensor y = at::empty({M, N}, xc.options());
  const auto* cp = cc.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(sc.data_ptr());
  const auto* mp = mins ? reinterpret_cast<const uint16_t*>(mc.data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const QuantX& qx = q;
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m)
        yp[m * N + n] = to_bf16(mp ? dot_q4<true>(cp + n * K / 2, dp + n * nb, mp + n * nb, nb, qx, m)
                                   : dot_q4<false>(cp + n * K / 2, dp + n * nb, nullptr, nb, qx, m));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_q4(Tensor x, Tensor codes, Tensor scales, Tensor? mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(ninfer_cpu, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_q4", &gemv_q4);
}
