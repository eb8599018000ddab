// Decode attention over paged K/V for x86 CPUs with AVX512: each query row against the
// keys of its own sequence, read in place from the page pool through the block table.
//
// A decode row reads its whole context once per layer (Hkv * L * D keys and as many
// values), a few FMAs per element: at Qwen3-0.6B's shapes and a 512-token context that is
// 56 MB a step, as much as the 4-bit weights. The compiled graph's own fused reduction
// gathered the pages and summed one key score at a time, at 6-7 GB/s. Here a task owns
// one (row, KV head, chunk of 128 keys): the chunk's keys are widened to fp32 sixteen at
// a time, each query head of the group scores all sixteen with FMAs, and one transposing
// add tree turns the sixteen partial vectors into sixteen scores; the chunk's softmax is
// exact, its weighted values are summed in registers, and chunks are merged by their
// maxima at the end.
//
// The chunking depends only on a row's own context, never on the batch or the thread
// count, so a row computes bit for bit the same in a decode step and in a speculative
// round (`width` rows a sequence: row j sees the round's rows 0..j-1 as the keys a lone
// decode would find in the pool, and its own key last).
//
// Coded pages (`ninfer_cpu::decode_attention_coded`: int8 K, int8 or int4 V, one fp16
// scale per group of 64 values, `kv/quant.py`) are decoded sixteen values at a time as
// they are read, into the same registers the float pages widen into: no decoded copy of
// the context is made. A rotated store's (rk8v4) query and output are turned by the
// caller (`cpu_attention.py`), one vector a row.
//
// Registered as torch operators (`ninfer_cpu::decode_attention`, `..._coded`), so a
// compiled decode step calls them from C++. Built at run time by `ninfer_core/kernels/cpu_gemv.py`.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace {

constexpr int64_t kChunk = 128;  // keys a task owns
constexpr int64_t kMaxGroup = 16;  // query heads per KV head

// Sixteen values widened to fp32.
template <typename T>
inline __m512 widen16(const T* p);

template <>
inline __m512 widen16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <>
inline __m512 widen16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <>
inline __m512 widen16(const float* p) {
  return _mm512_loadu_ps(p);
}

// Thirty-two values widened to two fp32 vectors in `Pair<T>`'s lane order, and put back
// in order by `Pair<T>::store`. bf16 splits each 32-bit lane into its two halves (even
// elements shifted up, odd ones masked): one load and two bit operations for 32 values,
// where widening in order takes two loads, two extensions and two shifts.
template <typename T>
struct Pair {
  static void load(const T* p, __m512& a, __m512& b) {
    a = widen16(p);
    b = widen16(p + 16);
  }
  static void store(float* out, __m512 a, __m512 b) {
    _mm512_storeu_ps(out, a);
    _mm512_storeu_ps(out + 16, b);
  }
};

template <>
struct Pair<at::BFloat16> {
  static void load(const at::BFloat16* p, __m512& even, __m512& odd) {
    const __m512i raw = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(0xffff0000)));
  }
  static void store(float* out, __m512 even, __m512 odd) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(even, hi, odd));
  }
};

// Sixteen int8 codes widened to fp32.
inline __m512 widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 broadcast_half(const at::Half* p) {
  return _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)));
}

// Values of a head dim D sharing one scale in a coded pool: gcd(64, D) (`kv/quant.py`).
template <int64_t D>
constexpr int64_t kGroup = D < 64 ? D : 64;

// How a pool's head rows are read: `KCode`/`VCode` are their element types, `k_width` and
// `v_width` their elements a head row; `key16` gives key values [16j, 16j + 16) in fp32,
// `value32` values [d0, d0 + 32) as two vectors in the lane order `store32` puts back.
// Float rows as stored, with no scales:
template <typename T>
struct FloatRows {
  using KCode = T;
  using VCode = T;
  static constexpr bool coded = false;
  static constexpr int64_t k_width(int64_t D) { return D; }
  static constexpr int64_t v_width(int64_t D) { return D; }
  template <int64_t D>
  static __m512 key16(const T* k, const at::Half*, int j) { return widen16(k + j * 16); }
  template <int64_t D>
  static void value32(const T* v, const at::Half*, int64_t d0, __m512& a, __m512& b) {
    Pair<T>::load(v + d0, a, b);
  }
  static void store32(float* out, __m512 a, __m512 b) { Pair<T>::store(out, a, b); }
};

// int8 K codes, each group's codes times its fp16 scale (exact in fp32). V in int8
// (`V4 = false`) or in int4, stored +8, two a byte: element 2i in the low nibble of byte
// i, 2i + 1 in the high one, so one byte load gives the even elements and the odd ones,
// put back in order as bf16 pairs are.
template <bool V4>
struct CodedRows {
  using KCode = int8_t;
  using VCode = std::conditional_t<V4, uint8_t, int8_t>;
  static constexpr bool coded = true;
  static constexpr int64_t k_width(int64_t D) { return D; }
  static constexpr int64_t v_width(int64_t D) { return V4 ? D / 2 : D; }
  template <int64_t D>
  static __m512 key16(const int8_t* k, const at::Half* scales, int j) {
    return _mm512_mul_ps(widen_i8(k + j * 16), broadcast_half(scales + j * 16 / kGroup<D>));
  }
  template <int64_t D>
  static void value32(const VCode* v, const at::Half* scales, int64_t d0, __m512& a, __m512& b) {
    const __m512 s = broadcast_half(scales + d0 / kGroup<D>);  // 32 values: one group
    if constexpr (V4) {
      const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + d0 / 2)));
      const __m512i eight = _mm512_set1_epi32(8);
      const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(raw, _mm512_set1_epi32(15)), eight);
      const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(raw, 4), eight);
      a = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), s);
      b = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), s);
    } else {
      a = _mm512_mul_ps(widen_i8(v + d0), s);
      b = _mm512_mul_ps(widen_i8(v + d0 + 16), s);
    }
  }
  static void store32(float* out, __m512 a, __m512 b) {
    if constexpr (V4) Pair<at::BFloat16>::store(out, a, b);
    else Pair<float>::store(out, a, b);
  }
};

// exp(x) for x <= 0 (scores less their maximum): Cody-Waite reduction by ln 2 and a
// degree-6 polynomial (cephes' expf), scaled back by 2^n; within 2 ulp of expf.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Lane i of the result is the sum of v[i]'s sixteen lanes: pairs, then quads within each
// 128-bit lane, then the four 128-bit lanes (45 shuffles and adds for 16 sums).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// What every task reads; element strides of the [NB, BS, Hkv, W] code (or value) views
// and of the [NB, BS, Hkv, D / group] scale views (coded pools only).
template <typename C>
struct Inputs {
  using KCode = typename C::KCode;
  using VCode = typename C::VCode;
  const float* q = nullptr;  // [R, H, D]
  const at::BFloat16* q_bf16 = nullptr;  // q itself when it is bf16 (and so are the pages)
  const KCode* k_pages = nullptr;
  const VCode* v_pages = nullptr;
  int64_t k_block = 0, k_slot = 0, k_head = 0, v_block = 0, v_slot = 0, v_head = 0;
  const at::Half* k_scales = nullptr;
  const at::Half* v_scales = nullptr;
  int64_t ks_block = 0, ks_slot = 0, ks_head = 0, vs_block = 0, vs_slot = 0, vs_head = 0;
  const KCode* k_new = nullptr;  // [R, Hkv, k_width]
  const VCode* v_new = nullptr;  // [R, Hkv, v_width]
  const at::Half* k_new_scales = nullptr;  // [R, Hkv, D / group]
  const at::Half* v_new_scales = nullptr;
  const int64_t* table = nullptr;  // [B, P]
  const int64_t* context = nullptr;  // [B]: row 0's keys, its own included
  int64_t H = 0, Hkv = 0, G = 0, P = 0, block_size = 0, width = 0, groups = 0;
  float scale = 0.0f;
};

// One task's keys: positions [k0, k1) of row r under KV head h, as K and V row pointers
// (and their scale rows, for coded pools).
template <typename C>
struct ChunkRows {
  const typename C::KCode* k[kChunk];
  const typename C::VCode* v[kChunk];
  const at::Half* ks[kChunk];
  const at::Half* vs[kChunk];
  int64_t count = 0;

  ChunkRows(const Inputs<C>& in, int64_t D, int64_t r, int64_t h, int64_t k0, int64_t k1) {
    const int64_t b = r / in.width, row0 = b * in.width;
    const int64_t first_new = in.context[b] - 1;  // the round's first own key
    const int64_t* pages = in.table + b * in.P;
    // Cached keys page by page (no division per key), then this round's rows, where a
    // lone decode would find them in the pool.
    const int64_t cached_end = std::min(k1, first_new);
    int64_t p = k0;
    while (p < cached_end) {
      const int64_t page = pages[p / in.block_size], slot0 = p % in.block_size;
      const int64_t n = std::min(in.block_size - slot0, cached_end - p);
      const auto* kp = in.k_pages + page * in.k_block + h * in.k_head;
      const auto* vp = in.v_pages + page * in.v_block + h * in.v_head;
      for (int64_t s = slot0; s < slot0 + n; ++s, ++count) {
        k[count] = kp + s * in.k_slot;
        v[count] = vp + s * in.v_slot;
        if constexpr (C::coded) {
          ks[count] = in.k_scales + page * in.ks_block + h * in.ks_head + s * in.ks_slot;
          vs[count] = in.v_scales + page * in.vs_block + h * in.vs_head + s * in.vs_slot;
        }
      }
      p += n;
    }
    for (; p < k1; ++p, ++count) {
      const int64_t row = (row0 + p - first_new) * in.Hkv + h;
      k[count] = in.k_new + row * C::k_width(D);
      v[count] = in.v_new + row * C::v_width(D);
      if constexpr (C::coded) {
        ks[count] = in.k_new_scales + row * in.groups;
        vs[count] = in.v_new_scales + row * in.groups;
      }
    }
  }

  const at::Half* k_scales(int64_t i) const {
    if constexpr (C::coded) return ks[i];
    return nullptr;
  }
  const at::Half* v_scales(int64_t i) const {
    if constexpr (C::coded) return vs[i];
    return nullptr;
  }
};

// Asks for the K rows of keys [from, to) and the V rows of [from - 16, to - 16) ahead.
// Pages sit anywhere in the pool, a few KB each: the hardware prefetcher loses the
// stream at every page, so each block of sixteen keys asks for the next block's keys and
// its own values (summed once the chunk's scores are known); a coded row's scales too.
template <typename C, int64_t D>
inline void prefetch_rows(const ChunkRows<C>& rows, int64_t from, int64_t to) {
  // cache lines of a K and of a V row
  constexpr int64_t kKLines = (C::k_width(D) * sizeof(typename C::KCode) + 63) / 64;
  constexpr int64_t kVLines = (C::v_width(D) * sizeof(typename C::VCode) + 63) / 64;
  for (int64_t i = from; i < std::min(to, rows.count); ++i) {
    for (int64_t line = 0; line < kKLines; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(rows.k[i]) + 64 * line, _MM_HINT_T0);
    if constexpr (C::coded) _mm_prefetch(reinterpret_cast<const char*>(rows.ks[i]), _MM_HINT_T0);
  }
  for (int64_t i = std::max<int64_t>(0, from - 16); i < std::min(to - 16, rows.count); ++i) {
    for (int64_t line = 0; line < kVLines; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(rows.v[i]) + 64 * line, _MM_HINT_T1);
    if constexpr (C::coded) _mm_prefetch(reinterpret_cast<const char*>(rows.vs[i]), _MM_HINT_T1);
  }
}

// Scores of the chunk's keys for each query head of the group: [G][kChunk], scaled. bf16
// q over bf16 keys: `vdpbf16ps` multiplies pairs exactly and sums them in fp32, reading
// the keys as stored; otherwise the keys are widened to fp32 once per sixteen and every
// head of the group multiplies them with FMAs.
template <typename C, int ND>
void score_chunk(const Inputs<C>& in, const ChunkRows<C>& rows, int64_t head0, float* scores) {
  constexpr int64_t D = ND * 16;
  constexpr bool kBf16 = std::is_same_v<C, FloatRows<at::BFloat16>>;
  alignas(64) float keys[16 * D];
  const bool pairs = kBf16 && in.q_bf16 != nullptr;
  prefetch_rows<C, D>(rows, 0, 16);
  for (int64_t kb = 0; kb < rows.count; kb += 16) {
    const int64_t nk = std::min<int64_t>(16, rows.count - kb);
    prefetch_rows<C, D>(rows, kb + 16, kb + 32);
    if constexpr (kBf16 && ND % 2 == 0) {
      if (pairs) {
        for (int64_t g = 0; g < in.G; ++g) {
          const at::BFloat16* q = in.q_bf16 + (head0 + g) * D;
          __m512bh qg[ND / 2];
          for (int j = 0; j < ND / 2; ++j) qg[j] = (__m512bh)_mm512_loadu_si512(q + j * 32);
          __m512 dots[16];
          for (int i = 0; i < 16; ++i) {
            const at::BFloat16* k = rows.k[kb + (i < nk ? i : 0)];
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < ND / 2; ++j)
              acc = _mm512_dpbf16_ps(acc, qg[j], (__m512bh)_mm512_loadu_si512(k + j * 32));
            dots[i] = acc;
          }
          const __m512 sc = _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(in.scale));
          _mm512_mask_storeu_ps(scores + g * kChunk + kb, first(nk), sc);
        }
        continue;
      }
    }
    for (int64_t i = 0; i < 16; ++i)
      for (int j = 0; j < ND; ++j)
        _mm512_store_ps(keys + i * D + j * 16,
                        i < nk ? C::template key16<D>(rows.k[kb + i], rows.k_scales(kb + i), j)
                               : _mm512_setzero_ps());
    for (int64_t g = 0; g < in.G; ++g) {
      const float* q = in.q + (head0 + g) * D;
      __m512 qg[ND];
      for (int j = 0; j < ND; ++j) qg[j] = _mm512_loadu_ps(q + j * 16);
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) {
        __m512 acc = _mm512_mul_ps(qg[0], _mm512_load_ps(keys + i * D));
        for (int j = 1; j < ND; ++j)
          acc = _mm512_fmadd_ps(qg[j], _mm512_load_ps(keys + i * D + j * 16), acc);
        dots[i] = acc;
      }
      const __m512 sc = _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(in.scale));
      _mm512_mask_storeu_ps(scores + g * kChunk + kb, first(nk), sc);
    }
  }
}

// scores -> exp(score - max) in place; returns the max and the sum of the exponentials.
inline void softmax_parts(float* s, int64_t n, float* max_out, float* sum_out) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = neg_inf;
  for (int64_t i = 0; i < n; i += 16)
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(neg_inf, first(std::min<int64_t>(16, n - i)), s + i));
  const float mx = _mm512_reduce_max_ps(m);
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first(std::min<int64_t>(16, n - i));
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, e));
    _mm512_mask_storeu_ps(s + i, k, e);
  }
  *max_out = mx;
  *sum_out = _mm512_reduce_add_ps(total);
}

// out[g][d0 .. d0 + 32 * NP) = sum over the chunk's keys of weight[g][key] * V[key]:
// GB query heads and NP pairs of vectors of the head dim in registers.
template <typename C, int64_t D, int GB, int NP>
void weigh_values(const ChunkRows<C>& rows, const float* weights, int64_t d0, float* out,
                  int64_t out_stride) {
  __m512 acc[GB][2 * NP];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 2 * NP; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < rows.count; ++i) {
    __m512 v[2 * NP];
    for (int j = 0; j < NP; ++j)
      C::template value32<D>(rows.v[i], rows.v_scales(i), d0 + j * 32, v[2 * j], v[2 * j + 1]);
    for (int g = 0; g < GB; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g * kChunk + i]);
      for (int j = 0; j < 2 * NP; ++j) acc[g][j] = _mm512_fmadd_ps(w, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NP; ++j)
      C::store32(out + g * out_stride + d0 + j * 32, acc[g][2 * j], acc[g][2 * j + 1]);
}

// The group's heads over the head dim in blocks of sixteen accumulators: two heads by
// 128 values, or four by 64.
template <typename C, int ND>
void weigh_group(const ChunkRows<C>& rows, const float* weights, int64_t G, float* out,
                 int64_t out_stride) {
  constexpr int NP = ND / 2;  // pairs of vectors in the head dim
  constexpr int kWide = NP >= 4 ? 4 : NP;  // pairs in one block when G <= 2
  constexpr int kNarrow = NP >= 2 ? 2 : NP;  // pairs in one block otherwise
  const bool wide = G <= 2;
  const int64_t heads = wide ? 2 : 4;
  for (int64_t d0 = 0; d0 < ND * 16; d0 += 32 * (wide ? kWide : kNarrow))
    for (int64_t g = 0; g < G; g += heads) {
      const float* w = weights + g * kChunk;
      float* o = out + g * out_stride;
      const int64_t gb = std::min(heads, G - g);
      if (wide) {
        if (gb == 1) weigh_values<C, ND * 16, 1, kWide>(rows, w, d0, o, out_stride);
        else weigh_values<C, ND * 16, 2, kWide>(rows, w, d0, o, out_stride);
      } else {
        switch (gb) {
          case 1: weigh_values<C, ND * 16, 1, kNarrow>(rows, w, d0, o, out_stride); break;
          case 2: weigh_values<C, ND * 16, 2, kNarrow>(rows, w, d0, o, out_stride); break;
          case 3: weigh_values<C, ND * 16, 3, kNarrow>(rows, w, d0, o, out_stride); break;
          default: weigh_values<C, ND * 16, 4, kNarrow>(rows, w, d0, o, out_stride); break;
        }
      }
    }
}

// Task (r, h, c): partial [G][D + 2]: the chunk's unnormalised weighted values, then its
// score maximum and its sum of exponentials (max -inf and sum 0 for a chunk past the row).
template <typename C, int ND>
void attend_chunk(const Inputs<C>& in, int64_t r, int64_t h, int64_t c, float* part) {
  constexpr int64_t D = ND * 16;
  const int64_t n = in.context[r / in.width] + r % in.width;  // the row's keys
  const int64_t k0 = c * kChunk, k1 = std::min(n, k0 + kChunk);
  if (k0 >= n) {
    for (int64_t g = 0; g < in.G; ++g) {
      part[g * (D + 2) + D] = -std::numeric_limits<float>::infinity();
      part[g * (D + 2) + D + 1] = 0.0f;
    }
    return;
  }
  const ChunkRows<C> rows(in, D, r, h, k0, k1);
  alignas(64) float scores[kMaxGroup * kChunk];
  score_chunk<C, ND>(in, rows, r * in.H + h * in.G, scores);
  for (int64_t g = 0; g < in.G; ++g)
    softmax_parts(scores + g * kChunk, rows.count, part + g * (D + 2) + D,
                  part + g * (D + 2) + D + 1);
  weigh_group<C, ND>(rows, scores, in.G, part, D + 2);
}

// Chunks of (r, h, g) merged by their maxima: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) s_c,
// summed in fp32 and rounded once to the output's dtype (q's: as `Tensor.to` rounds).
template <typename O>
void merge_chunks(const float* part, int64_t chunks, int64_t G, int64_t D, O* out) {
  alignas(64) float acc[256];
  for (int64_t g = 0; g < G; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part[(c * G + g) * (D + 2) + D]);
    float total = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = part + (c * G + g) * (D + 2);
      if (p[D + 1] == 0.0f) continue;
      const float w = chunks == 1 ? 1.0f : std::exp(p[D] - mx);
      total += w * p[D + 1];
      for (int64_t d = 0; d < D; ++d) acc[d] += w * p[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<O>(acc[d] * inv);
  }
}

template <typename C, int ND, typename O>
void run(const Inputs<C>& in, int64_t R, int64_t chunks, float* part, O* out) {
  constexpr int64_t D = ND * 16;
  const int64_t tasks = R * in.Hkv * chunks, part_size = in.G * (D + 2);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t % chunks, rh = t / chunks;
      attend_chunk<C, ND>(in, rh / in.Hkv, rh % in.Hkv, c, part + t * part_size);
    }
  });
  // Merging reads each partial once: a few thousand floats a layer at batch 1, less than
  // waking the other threads costs, so small steps merge on this one.
  const int64_t merge_grain = std::max<int64_t>(1, 16384 / (chunks * part_size));
  at::parallel_for(0, R * in.Hkv, merge_grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      merge_chunks(part + t * chunks * part_size, chunks, in.G, D, out + t * in.G * D);
  });
}

template <typename C, typename O>
void dispatch(const Inputs<C>& in, int64_t R, int64_t D, int64_t chunks, float* part, O* out) {
  switch (D) {
    case 32: run<C, 2>(in, R, chunks, part, out); break;
    case 64: run<C, 4>(in, R, chunks, part, out); break;
    case 128: run<C, 8>(in, R, chunks, part, out); break;
    default: run<C, 16>(in, R, chunks, part, out); break;
  }
}

// Checks the block table and the contexts against the pool (every page a row reads is
// named and exists) and returns the chunks the longest row's keys fill.
int64_t checked_chunks(const at::Tensor& table, const at::Tensor& context, int64_t NB,
                       int64_t BS, int64_t width) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong &&
                  context.dim() == 1 && context.scalar_type() == at::kLong &&
                  context.size(0) == table.size(0) && table.is_contiguous() &&
                  context.is_contiguous(),
              "decode_attention: table [B, P] and context [B], int64");
  const int64_t B = table.size(0), P = table.size(1);
  const int64_t* ctx = context.data_ptr<int64_t>();
  const int64_t* tab = table.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t cached = ctx[b] - 1;
    TORCH_CHECK(cached >= 0 && (cached + BS - 1) / BS <= P,
                "decode_attention: a context longer than its page table");
    for (int64_t i = 0; i < (cached + BS - 1) / BS; ++i)
      TORCH_CHECK(tab[b * P + i] >= 0 && tab[b * P + i] < NB, "decode_attention: page out of range");
    longest = std::max(longest, ctx[b] + width - 1);
  }
  return std::max<int64_t>(1, (longest + kChunk - 1) / kChunk);
}

void check_shapes(const at::Tensor& q, int64_t Hkv, int64_t D, int64_t B, int64_t width) {
  TORCH_CHECK(q.dim() == 3 && at::isFloatingType(q.scalar_type()), "decode_attention: q [R, H, D]");
  TORCH_CHECK(width >= 1 && q.size(0) == B * width, "decode_attention: q has B * width rows");
  TORCH_CHECK(q.size(2) == D && (D == 32 || D == 64 || D == 128 || D == 256),
              "decode_attention: head dim 32, 64, 128 or 256");
  TORCH_CHECK(q.size(1) % Hkv == 0 && q.size(1) / Hkv <= kMaxGroup,
              "decode_attention: at most 16 query heads a KV head");
}

// The tasks over `in` (its pools and new rows set by the caller) -> [R, H, D] in q's dtype.
template <typename C>
at::Tensor launch(Inputs<C> in, const at::Tensor& q, const at::Tensor& table,
                  const at::Tensor& context, int64_t NB, int64_t BS, int64_t width, double scale) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  // bf16 q over bf16 pages is read as it is (`vdpbf16ps`); the FMA path takes q in fp32.
  const bool q_pairs = std::is_same_v<C, FloatRows<at::BFloat16>> && q.scalar_type() == at::kBFloat16;
  const at::Tensor qb = q.contiguous(), qc = q_pairs ? qb : q.to(at::kFloat).contiguous();
  const int64_t chunks = checked_chunks(table, context, NB, BS, width);
  in.q = q_pairs ? nullptr : qc.data_ptr<float>();
  in.q_bf16 = q_pairs ? reinterpret_cast<const at::BFloat16*>(qb.data_ptr()) : nullptr;
  in.table = table.data_ptr<int64_t>();
  in.context = context.data_ptr<int64_t>();
  in.H = H;
  in.G = H / in.Hkv;
  in.P = table.size(1);
  in.block_size = BS;
  in.width = width;
  in.scale = static_cast<float>(scale);
  at::Tensor part = at::empty({R * in.Hkv * chunks * in.G * (D + 2)}, q.options().dtype(at::kFloat));
  at::Tensor out = at::empty({R, H, D}, q.options());  // in q's dtype: no conversion after
  float* parts = part.data_ptr<float>();
  switch (q.scalar_type()) {
    case at::kBFloat16: dispatch<C>(in, R, D, chunks, parts, out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: dispatch<C>(in, R, D, chunks, parts, out.data_ptr<at::Half>()); break;
    case at::kFloat: dispatch<C>(in, R, D, chunks, parts, out.data_ptr<float>()); break;
    default: TORCH_CHECK(false, "decode_attention: q of bf16, fp16 or fp32");
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pages,
                            const at::Tensor& v_pages, const at::Tensor& table,
                            const at::Tensor& context, const at::Tensor& k_new,
                            const at::Tensor& v_new, int64_t width, double scale) {
  TORCH_CHECK(k_pages.dim() == 4 && v_pages.sizes() == k_pages.sizes(),
              "decode_attention: pages [NB, BS, Hkv, D], K and V alike");
  TORCH_CHECK(k_pages.scalar_type() == v_pages.scalar_type() &&
                  k_new.scalar_type() == k_pages.scalar_type() &&
                  v_new.scalar_type() == k_pages.scalar_type(),
              "decode_attention: new K/V in the pages' dtype");
  TORCH_CHECK(k_pages.stride(3) == 1 && v_pages.stride(3) == 1,
              "decode_attention: the head dim of the pages must be contiguous");
  const int64_t NB = k_pages.size(0), BS = k_pages.size(1), Hkv = k_pages.size(2);
  const int64_t D = k_pages.size(3);
  check_shapes(q, Hkv, D, table.size(0), width);
  const int64_t R = q.size(0);
  TORCH_CHECK(k_new.sizes() == at::IntArrayRef({R, Hkv, D}) && v_new.sizes() == k_new.sizes(),
              "decode_attention: new K/V [R, Hkv, D]");
  const at::Tensor kn = k_new.contiguous(), vn = v_new.contiguous();
  const at::Tensor tc = table.contiguous(), cc = context.contiguous();
  auto typed = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Inputs<FloatRows<T>> in;
    in.k_pages = reinterpret_cast<const T*>(k_pages.data_ptr());
    in.v_pages = reinterpret_cast<const T*>(v_pages.data_ptr());
    in.k_block = k_pages.stride(0), in.k_slot = k_pages.stride(1), in.k_head = k_pages.stride(2);
    in.v_block = v_pages.stride(0), in.v_slot = v_pages.stride(1), in.v_head = v_pages.stride(2);
    in.k_new = reinterpret_cast<const T*>(kn.data_ptr());
    in.v_new = reinterpret_cast<const T*>(vn.data_ptr());
    in.Hkv = Hkv;
    return launch(in, q, tc, cc, NB, BS, width, scale);
  };
  switch (k_pages.scalar_type()) {
    case at::kBFloat16: return typed(static_cast<at::BFloat16*>(nullptr));
    case at::kHalf: return typed(static_cast<at::Half*>(nullptr));
    case at::kFloat: return typed(static_cast<float*>(nullptr));
    default: TORCH_CHECK(false, "decode_attention: pages of bf16, fp16 or fp32");
  }
  return at::Tensor();
}

// Coded pages: K int8 codes [NB, BS, Hkv, D], V int8 [.., D] or int4 uint8 [.., D / 2],
// each with fp16 scales [NB, BS, Hkv, D / group]; this step's rows coded alike ([R, Hkv,
// W] codes, [R, Hkv, D / group] scales), as the store will write them.
at::Tensor decode_attention_coded(const at::Tensor& q, const at::Tensor& k_codes,
                                  const at::Tensor& k_scales, const at::Tensor& v_codes,
                                  const at::Tensor& v_scales, const at::Tensor& table,
                                  const at::Tensor& context, const at::Tensor& k_new,
                                  const at::Tensor& k_new_scales, const at::Tensor& v_new,
                                  const at::Tensor& v_new_scales, int64_t width, double scale) {
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.scalar_type() == at::kChar,
              "decode_attention_coded: K codes int8 [NB, BS, Hkv, D]");
  const int64_t NB = k_codes.size(0), BS = k_codes.size(1), Hkv = k_codes.size(2);
  const int64_t D = k_codes.size(3);
  check_shapes(q, Hkv, D, table.size(0), width);
  const int64_t R = q.size(0);
  const bool v4 = v_codes.scalar_type() == at::kByte;
  TORCH_CHECK((v4 || v_codes.scalar_type() == at::kChar) && v_codes.dim() == 4 &&
                  v_codes.sizes().slice(0, 3) == k_codes.sizes().slice(0, 3) &&
                  v_codes.size(3) == (v4 ? D / 2 : D),
              "decode_attention_coded: V codes int8 [NB, BS, Hkv, D] or int4 uint8 [.., D / 2]");
  const int64_t groups = D / (D < 64 ? D : 64);
  for (const at::Tensor* s : {&k_scales, &v_scales})
    TORCH_CHECK(s->scalar_type() == at::kHalf && s->dim() == 4 &&
                    s->sizes().slice(0, 3) == k_codes.sizes().slice(0, 3) && s->size(3) == groups,
                "decode_attention_coded: scales fp16 [NB, BS, Hkv, D / 64]");
  for (const at::Tensor* t : {&k_codes, &v_codes, &k_scales, &v_scales})
    TORCH_CHECK(t->stride(3) == 1, "decode_attention_coded: a head row must be contiguous");
  TORCH_CHECK(k_new.scalar_type() == k_codes.scalar_type() &&
                  k_new.sizes() == at::IntArrayRef({R, Hkv, D}) &&
                  v_new.scalar_type() == v_codes.scalar_type() &&
                  v_new.sizes() == at::IntArrayRef({R, Hkv, v_codes.size(3)}) &&
                  k_new_scales.scalar_type() == at::kHalf && v_new_scales.scalar_type() == at::kHalf &&
                  k_new_scales.sizes() == at::IntArrayRef({R, Hkv, groups}) &&
                  v_new_scales.sizes() == k_new_scales.sizes(),
              "decode_attention_coded: new K/V coded as the pages, [R, Hkv, W] and scales");
  const at::Tensor kn = k_new.contiguous(), vn = v_new.contiguous();
  const at::Tensor ksn = k_new_scales.contiguous(), vsn = v_new_scales.contiguous();
  const at::Tensor tc = table.contiguous(), cc = context.contiguous();
  auto typed = [&](auto tag) {
    using C = decltype(tag);
    using VCode = typename C::VCode;
    Inputs<C> in;
    in.k_pages = k_codes.data_ptr<int8_t>();
    in.v_pages = reinterpret_cast<const VCode*>(v_codes.data_ptr());
    in.k_block = k_codes.stride(0), in.k_slot = k_codes.stride(1), in.k_head = k_codes.stride(2);
    in.v_block = v_codes.stride(0), in.v_slot = v_codes.stride(1), in.v_head = v_codes.stride(2);
    in.k_scales = reinterpret_cast<const at::Half*>(k_scales.data_ptr());
    in.v_scales = reinterpret_cast<const at::Half*>(v_scales.data_ptr());
    in.ks_block = k_scales.stride(0), in.ks_slot = k_scales.stride(1), in.ks_head = k_scales.stride(2);
    in.vs_block = v_scales.stride(0), in.vs_slot = v_scales.stride(1), in.vs_head = v_scales.stride(2);
    in.k_new = kn.data_ptr<int8_t>();
    in.v_new = reinterpret_cast<const VCode*>(vn.data_ptr());
    in.k_new_scales = reinterpret_cast<const at::Half*>(ksn.data_ptr());
    in.v_new_scales = reinterpret_cast<const at::Half*>(vsn.data_ptr());
    in.Hkv = Hkv;
    in.groups = groups;
    return launch(in, q, tc, cc, NB, BS, width, scale);
  };
  return v4 ? typed(CodedRows<true>{}) : typed(CodedRows<false>{});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ninfer_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor table, "
      "Tensor context, Tensor k_new, Tensor v_new, int width, float scale) -> Tensor");
  m.def(
      "decode_attention_coded(Tensor q, Tensor k_codes, Tensor k_scales, Tensor v_codes, "
      "Tensor v_scales, Tensor table, Tensor context, Tensor k_new, Tensor k_new_scales, "
      "Tensor v_new, Tensor v_new_scales, int width, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ninfer_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_coded", &decode_attention_coded);
}
