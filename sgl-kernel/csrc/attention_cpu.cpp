// CPU paged decode attention, registered as torch.ops.sgl_kernel.decode_attention.
//
//   decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
//                    shared_prefix_min_macs=2^23) -> out
//
// One query token per request attends to the keys of its own request, read in place from the KV pool
// through `req_to_token[row, 0:seq_len]` (any page size: only token slot ids are read). The torch path
// gathers every request's keys and values into a padded copy first (`index_select`, ~3.5 GB/s on the
// CI's EPYC for 128-byte rows) and then runs SDPA over the copy; this reads each key and value once.
//
// Work unit: a request and its KV heads (a KV head, or part of one's group, where a request has more than
// 32 query heads), whose query heads are served together, so each key row is read once. Keys go in blocks of kBlock: the
// block's scores for the unit's heads, an online softmax (running max and sum per head, the accumulator
// rescaled when the max grows), then the weighted values. Accumulation is float32 for any KV dtype
// (float32, bfloat16, float16, and float8 e4m3fn / e5m2 for --kv-cache-dtype fp8_e4m3 / fp8_e5m2); q and
// the output are float32 (the backend converts). Units are split with at::parallel_for, so torch's
// thread setting applies. With AVX2, head dims 16, 32 and 64 score eight keys per tree of horizontal adds
// and keep the value sums in registers (block_scores_tree, block_values_avx2: 16 x 1,300 keys, 4 / 2 heads
// of 16, 0.42 -> 0.30 ms; the demo model's 256 x 330 keys, 4 / 2 heads of 32, 4.7 -> 2.9 ms against the
// loop of any head dim). Tests against a float64 reference and the
// SDPA path: test/unit/model/test_attention_backend.py, test/unit/kernels/test_cpu_attention.py.
// Requests of a batch that share their first KV slots (the radix cache's shared prefixes) attend to them
// together first where that work is large (`SharedPrefixes`; `shared_prefix_min_macs`, 0 always, a huge
// value never): 16 requests x 1,024 shared + ~276 own keys, 16 / 2 heads of 256, 9.8 -> 4.9 ms.
// (An extend form of the same loop, query tokens with causal limits, measured 1.5-4x slower than SDPA's
// blocked flash kernel at 8-2,048 query tokens and was not kept: extends stay on SDPA.)
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SGL_ATTN_X86 1
#else
#define SGL_ATTN_X86 0
#endif

namespace sgl_attention {
namespace {

constexpr int64_t kBlock = 64;  // keys per block: the block's scores for 8 heads stay in 2 KB

using sgl_cpu::fast_exp;  // of scores minus their running max (<= 0; exp(-inf) clamps to ~1e-38)

// ---- KV elements to float -------------------------------------------------------------------------------
// Float8 pools (--kv-cache-dtype fp8_e4m3 / fp8_e5m2, stored unscaled) are read through a table of the
// format's 256 values, built at compile time from the OCP definitions; the AVX2 loads below convert eight
// at once. Tests compare both with torch's conversion on every code.
template <typename T>
constexpr bool kFloat8 = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

constexpr float pow2(int e) {
  float v = 1.0f;
  for (; e > 0; --e) v *= 2.0f;
  for (; e < 0; ++e) v *= 0.5f;
  return v;
}

// e4m3fn: bias 7, no infinities, S.1111.111 is NaN. e5m2: bias 15, IEEE infinities and NaNs.
constexpr float float8_value(int bits, int mantissa_bits, int bias, bool ieee_specials) {
  const int exp_max = (1 << (7 - mantissa_bits)) - 1, mant_max = (1 << mantissa_bits) - 1;
  const int e = (bits >> mantissa_bits) & exp_max, m = bits & mant_max;
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  if (ieee_specials && e == exp_max)
    return m == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  if (!ieee_specials && e == exp_max && m == mant_max) return std::numeric_limits<float>::quiet_NaN();
  const float frac = static_cast<float>(m) / static_cast<float>(1 << mantissa_bits);
  return sign * (e == 0 ? frac * pow2(1 - bias) : (1.0f + frac) * pow2(e - bias));
}

template <typename T>
struct Float8Table {
  static constexpr bool kE4M3 = std::is_same_v<T, c10::Float8_e4m3fn>;
  float v[256] = {};
  constexpr Float8Table() {
    for (int b = 0; b < 256; ++b) v[b] = kE4M3 ? float8_value(b, 3, 7, false) : float8_value(b, 2, 15, true);
  }
};
template <typename T>
constexpr Float8Table<T> kFloat8Table{};

template <typename T>
inline __attribute__((always_inline)) float kv_float(const T* x, int64_t i) {
  if constexpr (kFloat8<T>)
    return kFloat8Table<T>.v[reinterpret_cast<const uint8_t*>(x)[i]];
  else
    return static_cast<float>(x[i]);
}

// ---- prefetching the rows a block reads ----------------------------------------------------------------
// A request's keys sit wherever the allocator put them (with --page-size 1, one decode step's slots go to
// all requests in turn, so a request's consecutive keys are a batch apart): each key row is a cache miss
// the hardware prefetcher cannot predict. The score loops ask for the key rows kAhead keys ahead and for
// the value rows of the keys they score (read after the block's softmax). Elements [lo, hi) of each row:
// the unit's KV heads, at most their first kPrefetchBytes (the hardware follows a long row from there).
// A block whose keys sit in consecutive slots (a prefill's, or pages of 64+) is left to the hardware
// prefetcher: asking for its rows as well slowed 16 x 1,300 keys of 8 / 2 heads of 128 by 25 %.
constexpr int64_t kAhead = 8;
constexpr int64_t kPrefetchBytes = 256;

inline bool scattered(const int32_t* slots, int64_t n) { return n > 0 && slots[n - 1] - slots[0] != n - 1; }

template <typename T>
inline __attribute__((always_inline)) void prefetch_rows(const T* buf, const int32_t* slots, int64_t from,
                                                         int64_t to, int64_t slot_stride, int64_t lo, int64_t hi) {
  const int64_t first = lo * static_cast<int64_t>(sizeof(T));
  const int64_t end = std::min<int64_t>(hi * static_cast<int64_t>(sizeof(T)), first + kPrefetchBytes);
  for (int64_t j = from; j < to; ++j) {
    const char* row = reinterpret_cast<const char*>(buf + slots[j] * slot_stride);
    for (int64_t b = first; b < end; b += 64) __builtin_prefetch(row + b, 0, 3);
  }
}

// The requests of one block's score loop, which goes over its n keys kAhead at a time: the first keys on
// construction, then before each group [j0, j0 + kAhead) the keys of the next group and this group's values.
template <typename T>
struct BlockPrefetch {
  const T *k_buf, *v_buf;
  const int32_t* slots;
  int64_t n, slot_stride, lo, hi;
  bool on;

  BlockPrefetch(const T* k, const T* v, const int32_t* s, int64_t count, int64_t stride, int64_t first, int64_t last)
      : k_buf(k), v_buf(v), slots(s), n(count), slot_stride(stride), lo(first), hi(last), on(scattered(s, count)) {
    if (on) prefetch_rows(k_buf, slots, 0, std::min(kAhead, n), slot_stride, lo, hi);
  }

  inline __attribute__((always_inline)) void before(int64_t j0) const {
    if (!on) return;
    const int64_t e = std::min(j0 + kAhead, n);
    prefetch_rows(k_buf, slots, e, std::min(e + kAhead, n), slot_stride, lo, hi);
    prefetch_rows(v_buf, slots, j0, e, slot_stride, lo, hi);
  }
};

// q . k over a head. With a constant head dim that is a multiple of 32, four independent partial sums (four
// AVX2 vectors) instead of one: a single vector accumulator makes a 256-dim dot a chain of 32 dependent FMAs.
template <int kD, typename T>
inline __attribute__((always_inline)) float dot_qk(const float* q, const T* k, int64_t d) {
  constexpr int kLanes = 32;
  if constexpr (kD > 0 && kD % kLanes == 0) {
    float part[kLanes] = {};
    for (int i = 0; i < kD; i += kLanes) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) part[l] += q[i + l] * kv_float(k, i + l);
    }
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int l = 0; l < kLanes; ++l) s += part[l];
    return s;
  } else {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += q[i] * kv_float(k, i);
    return s;
  }
}

#if SGL_ATTN_X86
// Eight keys' q . k at once with AVX2 + FMA, for every KV dtype at head dims 16, 32 and 64: each key's
// products go into one vector (its d / 8 pieces summed lane-wise), then a tree of horizontal adds turns the
// eight vectors into one vector of eight scores. The plain loop above does one horizontal sum per key and
// head; the tree shares them among eight keys. At 128 and 256 the plain loop's four partial sums are
// faster (16 x 1,300 keys, 8 / 2 heads of 128: 3.3 ms against 4.2 ms with the tree), so they keep it.
template <typename T>
SGL_TARGET_AVX2 inline __attribute__((always_inline)) __m256 load8(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the high half of a float32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  } else {  // float8, widened to 16 bits
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
    if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
      return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));  // the high byte of a float16, specials included
    } else {
      // e4m3fn: the sign to bit 15 and the exponent and mantissa under a float16's, which then reads the
      // value / 2^8 (normal and subnormal codes alike: the two biases differ by 8). The NaN codes
      // (S.1111.111) read +-480 that way, which no finite code does (the largest is 448).
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
      const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
      const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f));
      const __m256 nan = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), f), _mm256_set1_ps(480.0f), _CMP_EQ_OQ);
      return _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
    }
  }
}

template <typename T>
constexpr bool kTreeDtype = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                            std::is_same_v<T, c10::Half> || kFloat8<T>;

// KV dtypes whose elements need a conversion GCC does not vectorise on its own (float16 through c10, float8
// through the table): at head dims 128 and 256 they take explicit AVX2 loops (block_scores_converted,
// block_values_converted).
template <typename T>
constexpr bool kConverted = std::is_same_v<T, c10::Half> || kFloat8<T>;

template <typename T, int kD>
SGL_TARGET_AVX2 inline __attribute__((always_inline)) float dot_avx2(const float* q, const T* k) {
  static_assert(kD % 32 == 0, "four vectors per step");
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int c = 0; c < kD; c += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(k + c), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), load8(k + c + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 16), load8(k + c + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 24), load8(k + c + 24), a3);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// A block's scores and weighted values with dot_avx2 (arguments as block_scores_tree's and
// block_values_avx2's; not inlined into the two-instruction-set template, as those).
template <typename T, int kD>
SGL_TARGET_AVX2 void block_scores_converted(const float* q, int64_t rows, const int64_t* kv_off, const int32_t* slots,
                                            int64_t n, const T* k_buf, const T* v_buf, int64_t slot_stride,
                                            float scale, float* scores) {
  const BlockPrefetch<T> fetch(k_buf, v_buf, slots, n, slot_stride, kv_off[0], kv_off[rows - 1] + kD);
  for (int64_t j0 = 0; j0 < n; j0 += kAhead) {
    fetch.before(j0);
    for (int64_t j = j0, e = std::min(j0 + kAhead, n); j < e; ++j) {
      const T* kr = k_buf + slots[j] * slot_stride;
      for (int64_t r = 0; r < rows; ++r) scores[r * kBlock + j] = dot_avx2<T, kD>(q + r * kD, kr + kv_off[r]) * scale;
    }
  }
}

template <typename T, int kD>
SGL_TARGET_AVX2 void block_values_converted(const float* scores, int64_t rows, const int64_t* kv_off,
                                            const int32_t* slots, int64_t n, const T* v_buf, int64_t slot_stride,
                                            float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = v_buf + slots[j] * slot_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 w = _mm256_set1_ps(scores[r * kBlock + j]);
      const T* v = vr + kv_off[r];
      float* a = acc + r * kD;
      for (int c = 0; c < kD; c += 8) _mm256_storeu_ps(a + c, _mm256_fmadd_ps(w, load8(v + c), _mm256_loadu_ps(a + c)));
    }
  }
}

// scores[r * kBlock + j] = scale * q_r . k_j for the block's n keys (row r's KV head at kv_off[r] of a slot
// row); entries n..round_up(n, 8) are written with a repeat of key 0's scores and never read. A call per
// block of keys, not inlined: GCC does not inline an AVX2 function into the template that is compiled
// for both instruction sets.
template <typename T, int kD>
SGL_TARGET_AVX2 void block_scores_tree(
    const float* q, int64_t rows, const int64_t* kv_off, const int32_t* slots, int64_t n, const T* k_buf,
    const T* v_buf, int64_t slot_stride, float scale, float* scores) {
  static_assert(kD > 0 && kD % 8 == 0, "the tree takes whole vectors of a head");
  const __m256 vscale = _mm256_set1_ps(scale);
  static_assert(kAhead == 8, "the tree scores the keys kAhead at a time");
  const BlockPrefetch<T> fetch(k_buf, v_buf, slots, n, slot_stride, kv_off[0], kv_off[rows - 1] + kD);
  for (int64_t j8 = 0; j8 < n; j8 += 8) {
    fetch.before(j8);
    const T* keys[8];
    for (int jj = 0; jj < 8; ++jj) keys[jj] = k_buf + slots[j8 + jj < n ? j8 + jj : j8] * slot_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * kD;
      __m256 a[8];
      for (int jj = 0; jj < 8; ++jj) {
        const T* k = keys[jj] + kv_off[r];
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(qr), load8(k));
        for (int c = 8; c < kD; c += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(qr + c), load8(k + c), s);
        a[jj] = s;
      }
      // hadd(a0, a1) = [a0 01, a0 23, a1 01, a1 23 | a0 45, a0 67, a1 45, a1 67]; twice more and a swap of
      // the 128-bit halves leaves key jj's sum in lane jj.
      const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
      const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
      const __m256 h03 = _mm256_hadd_ps(h01, h23), h47 = _mm256_hadd_ps(h45, h67);
      const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20), _mm256_permute2f128_ps(h03, h47, 0x31));
      _mm256_storeu_ps(scores + r * kBlock + j8, _mm256_mul_ps(sum, vscale));
    }
  }
}

// acc[r] += sum_j scores[r * kBlock + j] * v_j for the block's n keys, with the accumulators of kR rows held
// in registers across the block (kR x kD / 8 <= 8 vectors). Accumulating in memory instead stores and reloads
// every accumulator vector for each key: at a head dim of 16 that was half the op's time.
template <typename T, int kD, int kR>
SGL_TARGET_AVX2 inline __attribute__((always_inline)) void rows_values_avx2(
    const float* scores, const int64_t* kv_off, const int32_t* slots, int64_t n, const T* v_buf,
    int64_t slot_stride, float* acc) {
  constexpr int kV = kD / 8;
  __m256 a[kR][kV];
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kV; ++c) a[r][c] = _mm256_loadu_ps(acc + r * kD + c * 8);
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = v_buf + slots[j] * slot_stride;
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const __m256 w = _mm256_set1_ps(scores[r * kBlock + j]);
      const T* v = vr + kv_off[r];
#pragma GCC unroll 8
      for (int c = 0; c < kV; ++c) a[r][c] = _mm256_fmadd_ps(w, load8(v + c * 8), a[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kV; ++c) _mm256_storeu_ps(acc + r * kD + c * 8, a[r][c]);
}

template <typename T, int kD>
constexpr bool kRegisterValues = kTreeDtype<T> && kD > 0 && kD % 8 == 0 && kD <= 64;

// The unit's rows in passes of 8 / (kD / 8) rows (4 at a head dim of 16, 1 at 64), the rest one by one.
template <typename T, int kD>
SGL_TARGET_AVX2 void block_values_avx2(const float* scores, int64_t rows, const int64_t* kv_off,
                                       const int32_t* slots, int64_t n, const T* v_buf, int64_t slot_stride,
                                       float* acc) {
  constexpr int kR = 64 / kD;
  int64_t r = 0;
  for (; r + kR <= rows; r += kR)
    rows_values_avx2<T, kD, kR>(scores + r * kBlock, kv_off + r, slots, n, v_buf, slot_stride, acc + r * kD);
  for (; r < rows; ++r)
    rows_values_avx2<T, kD, 1>(scores + r * kBlock, kv_off + r, slots, n, v_buf, slot_stride, acc + r * kD);
}
#endif

// ---- e4m3fn pools under GQA: each key and value row converted once per unit -------------------------------
// A unit's query heads of one KV head all read its key rows: converting in the score loop converts each
// row once per query head (8 times at Qwen3-Next-80B's 16 / 2 heads, where e4m3fn read in place measured
// 0.26-0.67x of a float32 pool's time; e4m3fn takes ~10 vector ops per 8 elements, see load8). Instead the
// block's rows of the unit's KV heads [h0, h0 + nh) go to float `dst` rows of nh * d first (row j of the
// block at j * nh * d), and the float path reads those (benchmark/README.md, KV cache dtypes).
template <typename T>
inline __attribute__((always_inline)) void convert_rows(const T* buf, const int32_t* slots, int64_t n,
                                                        int64_t slot_stride, int64_t h0, int64_t nh, int64_t d,
                                                        float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const T* src = buf + slots[j] * slot_stride + h0 * d;
    float* out = dst + j * nh * d;
#pragma omp simd
    for (int64_t i = 0; i < nh * d; ++i) out[i] = kv_float(src, i);
  }
}

#if SGL_ATTN_X86
template <typename T>
SGL_TARGET_AVX2 void convert_rows_avx2(const T* buf, const int32_t* slots, int64_t n, int64_t slot_stride,
                                       int64_t h0, int64_t nh, int64_t d, float* dst) {
  const int64_t width = nh * d, whole = width / 8 * 8;
  for (int64_t j = 0; j < n; ++j) {
    const T* src = buf + slots[j] * slot_stride + h0 * d;
    float* out = dst + j * width;
    for (int64_t i = 0; i < whole; i += 8) _mm256_storeu_ps(out + i, load8(src + i));
    for (int64_t i = whole; i < width; ++i) out[i] = kv_float(src, i);
  }
}
#endif

template <typename T, bool kAvx2>
void convert_block(const T* buf, const int32_t* slots, int64_t n, int64_t slot_stride, int64_t h0, int64_t nh,
                   int64_t d, float* dst) {
#if SGL_ATTN_X86
  if constexpr (kAvx2) return convert_rows_avx2<T>(buf, slots, n, slot_stride, h0, nh, d, dst);
#endif
  convert_rows<T>(buf, slots, n, slot_stride, h0, nh, d, dst);
}

// 0, 1, ..., kBlock - 1: the slot ids of a converted block's rows.
struct BlockRows {
  int32_t v[kBlock] = {};
  constexpr BlockRows() {
    for (int i = 0; i < kBlock; ++i) v[i] = i;
  }
};
constexpr BlockRows kBlockRows{};

template <typename T>
struct Problem {
  const float* q;  // [bs, hq, d]
  const T* k_buf;  // [slots, hk, d]
  const T* v_buf;
  const int32_t* req_to_token;  // [rows, row_stride]
  int64_t row_stride;
  const int64_t* rows;      // [bs] request rows of req_to_token
  const int64_t* seq_lens;  // [bs] keys after this forward (the new token's included)
  float* out;  // [bs, hq, d]
  int64_t hq, hk, d;
  float scale;
  // Shared prefixes (see `find_shared_prefixes`); null when none. Request b's keys [0, start[b]) were
  // attended by its group's prefix pass, which left each of its query rows' online-softmax state at rows
  // state_row[b] + head of the shared state arrays.
  const int64_t* start = nullptr;
  const int64_t* state_row = nullptr;
  float* shared_acc = nullptr;  // [state rows, d]
  float* shared_max = nullptr;  // [state rows]
  float* shared_sum = nullptr;
};

// The online-softmax state of a run of query rows: unnormalised outputs (rows x d, consecutive), running
// maxes and sums.
struct RowState {
  float* acc;
  float* run_max;
  float* run_sum;
};

// One task: request b's query heads [head0, head0 + rows) (at most kMaxRows, of whole KV-head groups or
// within one group), which all read each key row of their KV heads while it is in cache.
struct Unit {
  int64_t b, head0, rows;
};
constexpr int64_t kMaxRows = 32;

// KV heads a unit may span (see make_units): kMaxRows / group whole groups, or, where a group is larger
// than kMaxRows, a piece of kMaxRows rows that may cross one group boundary (groups of 48: rows 32-63
// read KV heads 0 and 1).
inline int64_t max_unit_kv_heads(int64_t hq, int64_t hk) {
  const int64_t group = hq / hk;
  return std::min(hk, group <= kMaxRows ? kMaxRows / group : int64_t{2});
}

// e4m3fn pools under GQA convert each block's rows once per unit (convert_block). e5m2's conversion is one
// shift, cheaper in place than the converted rows' round trip through memory at head dims of 128 and 256.
template <typename T>
constexpr bool kConvertsBlocks = std::is_same_v<T, c10::Float8_e4m3fn>;

template <typename T>
inline bool converts_blocks(int64_t hq, int64_t hk) {
  return kConvertsBlocks<T> && hq / hk > 1;
}

// One block of n keys (slot ids `slots[0, n)`) for `rows` query rows `q` (rows x d, consecutive), row r
// reading its KV head at kv_off[r]: the block's scores, the online-softmax update of `st`, then the weighted
// values. `scores` holds kMaxRows * kBlock floats. Always inlined, so each caller compiles it for its own
// instruction set.
template <typename T, int kD, bool kAvx2>
inline __attribute__((always_inline)) void attend_block(const Problem<T>& p, const float* q, int64_t rows,
                                                        const int64_t* kv_off, const int32_t* slots, int64_t n,
                                                        float* scores, const RowState& st) {
  const int64_t d = kD > 0 ? kD : p.d, slot_stride = p.hk * d;
  float *acc = st.acc, *run_max = st.run_max, *run_sum = st.run_sum;
#if SGL_ATTN_X86
  if constexpr (kAvx2 && kRegisterValues<T, kD>) {  // head dims 16, 32 and 64 (see block_scores_tree)
    block_scores_tree<T, kD>(q, rows, kv_off, slots, n, p.k_buf, p.v_buf, slot_stride, p.scale, scores);
  } else if constexpr (kAvx2 && kConverted<T> && kD > 0 && kD % 32 == 0) {  // 128 and 256
    block_scores_converted<T, kD>(q, rows, kv_off, slots, n, p.k_buf, p.v_buf, slot_stride, p.scale, scores);
  } else
#endif
  {
    const BlockPrefetch<T> fetch(p.k_buf, p.v_buf, slots, n, slot_stride, kv_off[0], kv_off[rows - 1] + d);
    for (int64_t j0 = 0; j0 < n; j0 += kAhead) {
      fetch.before(j0);
      for (int64_t j = j0, e = std::min(j0 + kAhead, n); j < e; ++j) {
        const T* kr = p.k_buf + slots[j] * slot_stride;
        for (int64_t r = 0; r < rows; ++r)
          scores[r * kBlock + j] = dot_qk<kD>(q + r * d, kr + kv_off[r], d) * p.scale;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * kBlock;
    float m = run_max[r];
    // A vector max (without the pragma GCC keeps the scalar order of comparisons: a chain of n
    // dependent maxes per row and block). NaN scores may or may not win it; the probe below makes
    // such a row NaN either way.
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) m = sr[j] > m ? sr[j] : m;
    if (m > run_max[r]) {
      // exp(-inf) on the first block: the accumulator and sum are still 0.
      const float c = fast_exp(run_max[r] - m);
      run_sum[r] *= c;
      float* ar = acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ar[i] *= c;
      run_max[r] = m;
    }
    // `probe` is NaN where a score is NaN or infinite (torch's softmax gives NaN for NaN and +inf; a -inf
    // score, which only an infinite key or query gives here, is taken as broken input too): it makes the
    // row's sum, and so its output, NaN, where the max above may skip NaNs and fast_exp maps them to ~0.
    float sum = 0.0f, probe = 0.0f;
#pragma omp simd reduction(+ : sum, probe)
    for (int64_t j = 0; j < n; ++j) {
      probe += sr[j] - sr[j];
      sr[j] = fast_exp(sr[j] - m);
      sum += sr[j];
    }
    run_sum[r] += sum + probe;
  }
#if SGL_ATTN_X86
  if constexpr (kAvx2 && kRegisterValues<T, kD>) {
    block_values_avx2<T, kD>(scores, rows, kv_off, slots, n, p.v_buf, slot_stride, acc);
    return;
  } else if constexpr (kAvx2 && kConverted<T> && kD > 0 && kD % 32 == 0) {
    block_values_converted<T, kD>(scores, rows, kv_off, slots, n, p.v_buf, slot_stride, acc);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = p.v_buf + slots[j] * slot_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const float w = scores[r * kBlock + j];
      const T* v = vr + kv_off[r];
      float* ar = acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ar[i] += w * kv_float(v, i);
    }
  }
}

// The units in `units`; `scratch` holds kMaxRows * (kBlock + d + 2) floats, then (where converts_blocks)
// 2 * kBlock * max_unit_kv_heads * d for the converted keys and values. kD > 0 is the head dim as a
// constant (the loops over it unroll: a head of 16 is two AVX2 vectors, no loop left), 0 reads it from the
// problem. A request whose first keys were attended by a shared-prefix pass starts from that pass's state.
template <typename T, int kD, bool kAvx2>
inline __attribute__((always_inline)) void attend_units(const Problem<T>& p, const Unit* units, int64_t count,
                                                        float* scratch) {
  const int64_t group = p.hq / p.hk, d = kD > 0 ? kD : p.d;
  float* scores = scratch;
  const RowState st{scores + kMaxRows * kBlock, scores + kMaxRows * (kBlock + d), scores + kMaxRows * (kBlock + d + 1)};
  int64_t kv_off[kMaxRows];  // each row's KV head, as an offset into a slot row
  for (int64_t ui = 0; ui < count; ++ui) {
    const Unit& un = units[ui];
    const int64_t rows = un.rows, len = p.seq_lens[un.b];
    const int64_t start = p.start != nullptr ? p.start[un.b] : 0;
    const float* q = p.q + (un.b * p.hq + un.head0) * d;  // the unit's rows, consecutive
    for (int64_t r = 0; r < rows; ++r) kv_off[r] = ((un.head0 + r) / group) * d;
    if (start > 0) {
      const int64_t s0 = p.state_row[un.b] + un.head0;
      std::memcpy(st.acc, p.shared_acc + s0 * d, rows * d * sizeof(float));
      std::memcpy(st.run_max, p.shared_max + s0, rows * sizeof(float));
      std::memcpy(st.run_sum, p.shared_sum + s0, rows * sizeof(float));
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        st.run_max[r] = -std::numeric_limits<float>::infinity();
        st.run_sum[r] = 0.0f;
      }
      for (int64_t i = 0; i < rows * d; ++i) st.acc[i] = 0.0f;
    }
    const int32_t* slots = p.req_to_token + p.rows[un.b] * p.row_stride;
    bool converted = false;  // compiled for e4m3fn pools only
    if constexpr (kConvertsBlocks<T>) {
      if (converts_blocks<T>(p.hq, p.hk)) {
        const int64_t h0 = kv_off[0] / d, nh = kv_off[rows - 1] / d - h0 + 1, room = max_unit_kv_heads(p.hq, p.hk);
        TORCH_CHECK(nh <= room, "decode_attention: a unit spans ", nh, " KV heads, its scratch ", room);
        float* conv_k = scratch + kMaxRows * (kBlock + d + 2);
        float* conv_v = conv_k + kBlock * room * d;
        // The float view of the converted block: nh KV heads per row, rows 0..n-1.
        Problem<float> pf{p.q, conv_k, conv_v, nullptr, 0, nullptr, nullptr, p.out, p.hq, nh, p.d, p.scale};
        int64_t off[kMaxRows];
        for (int64_t r = 0; r < rows; ++r) off[r] = kv_off[r] - h0 * d;
        const int64_t slot_stride = p.hk * d;
        for (int64_t j0 = start; j0 < len; j0 += kBlock) {
          const int64_t n = std::min(kBlock, len - j0);
          convert_block<T, kAvx2>(p.k_buf, slots + j0, n, slot_stride, h0, nh, d, conv_k);
          convert_block<T, kAvx2>(p.v_buf, slots + j0, n, slot_stride, h0, nh, d, conv_v);
          attend_block<float, kD, kAvx2>(pf, q, rows, off, kBlockRows.v, n, scores, st);
        }
        converted = true;
      }
    }
    if (!converted) {
      for (int64_t j0 = start; j0 < len; j0 += kBlock)
        attend_block<T, kD, kAvx2>(p, q, rows, kv_off, slots + j0, std::min(kBlock, len - j0), scores, st);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* o = p.out + (q - p.q) + r * d;
      const float inv = len > 0 ? 1.0f / st.run_sum[r] : 0.0f;
      const float* ar = st.acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] = ar[i] * inv;
    }
  }
}

// The build has no -march (the linear-attention loops measured slower with AVX-512), so the x86-64
// baseline is SSE2; the dot products and value sums here are 2-4x faster with AVX2 + FMA, taken where
// the CPU has them.
template <typename T, int kD>
SGL_TARGET_AVX2 void attend_units_avx2(const Problem<T>& p, const Unit* units, int64_t count,
                                                           float* scratch) {
  attend_units<T, kD, true>(p, units, count, scratch);
}

template <typename T, int kD>
void attend_units_baseline(const Problem<T>& p, const Unit* units, int64_t count, float* scratch) {
  attend_units<T, kD, false>(p, units, count, scratch);
}

template <typename T, int kD>
void run_units(bool avx2, const Problem<T>& p, const Unit* units, int64_t count, float* scratch) {
  if (avx2)
    attend_units_avx2<T, kD>(p, units, count, scratch);
  else
    attend_units_baseline<T, kD>(p, units, count, scratch);
}

// Units: a request's query heads in pieces of at most kMaxRows, of whole KV-head groups where a group fits
// (the tiny presets' 4 heads are one unit: both KV heads' keys, one 128-byte slot row, come in one pass).
// A row's KV head is its own, so a piece may also end inside a group larger than kMaxRows.
std::vector<Unit> make_units(int64_t bs, int64_t hq, int64_t hk) {
  const int64_t group = hq / hk, per = group <= kMaxRows ? kMaxRows / group * group : kMaxRows;
  std::vector<Unit> units;
  for (int64_t b = 0; b < bs; ++b)
    for (int64_t head0 = 0; head0 < hq; head0 += per) units.push_back({b, head0, std::min(per, hq - head0)});
  return units;
}

// Shared prefixes (cascade attention). Requests whose first keys are the same KV slots (a prefix the radix
// cache shares among them: a system prompt, a conversation's earlier turns) are found by sorting the
// requests' slot rows (lexicographically: requests with a common prefix end up next to each other, and a
// run's common prefix is the shortest one between neighbours) and cutting the order where neighbours share
// less than a block of keys or less than half of the run's prefix so far, so that a short head every
// request shares (a chat template's first tokens) does not join long prefixes that subsets share.
// A group whose prefix work (query rows x prefix keys x head dim) reaches `min_macs` attends to its prefix
// first, per KV head as two matrix products over all of its requests' query rows (torch's GEMMs: the keys
// are read once per group, and the products run at GEMM speed) with an exact softmax in between, leaving
// each row's (max, sum, unnormalised output) in the state rows; each request's own pass then continues
// the online softmax from there over its remaining keys. Below that work the products' fixed costs
// outweigh the saving (bench_decode_attention_cpu.py's shared-prefix table), and every request takes its
// own pass over all of its keys. The result equals the unshared one to float32 rounding (the order of
// the sums differs).
struct SharedPrefixes {
  std::vector<std::vector<int64_t>> members;  // per group, batch indices
  std::vector<int64_t> prefix;                // per group
  std::vector<int64_t> start, state_row;      // per request: keys already attended, its first state row
  int64_t state_rows = 0;
};

// How many leading entries two slot rows of n entries have in common: equal 64-byte chunks skipped by
// memcmp, then the first differing chunk element by element.
inline int64_t common_prefix_len(const int32_t* a, const int32_t* b, int64_t n) {
  constexpr int64_t kChunk = 16;
  int64_t i = 0;
  while (i + kChunk <= n && std::memcmp(a + i, b + i, kChunk * sizeof(int32_t)) == 0) i += kChunk;
  return std::mismatch(a + i, a + n, b + i).first - a;
}

SharedPrefixes find_shared_prefixes(const int32_t* table, int64_t row_stride, const int64_t* rows,
                                    const int64_t* lens, int64_t bs, int64_t hq, int64_t d, int64_t min_macs) {
  SharedPrefixes sp;
  // No group could reach the work (every request sharing all of the longest one's keys): nothing to look for.
  const int64_t longest = bs > 0 ? *std::max_element(lens, lens + bs) : 0;
  if (bs < 2 || bs * hq * longest * d < min_macs) return sp;
  std::vector<int64_t> cand;
  for (int64_t b = 0; b < bs; ++b)
    if (lens[b] > 0) cand.push_back(b);
  auto row = [&](int64_t b) { return table + rows[b] * row_stride; };
  // Any lexicographic order puts requests that share a prefix next to each other, so the rows are
  // compared as bytes (memcmp, vectorised; element by element a shared 1,024-slot prefix cost ~1 us per
  // comparison): the order of slot ids by their little-endian bytes, then the shorter row first.
  std::sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) {
    const int c = std::memcmp(row(a), row(b), std::min(lens[a], lens[b]) * sizeof(int32_t));
    return c != 0 ? c < 0 : lens[a] < lens[b];
  });
  auto close = [&](size_t i, size_t j, int64_t prefix) {  // the run cand[i, j) sharing `prefix` keys
    if (j - i >= 2 && static_cast<int64_t>(j - i) * hq * prefix * d >= min_macs) {
      sp.members.emplace_back(cand.begin() + i, cand.begin() + j);
      sp.prefix.push_back(prefix);
    }
  };
  size_t start = 0;
  int64_t prefix = 0;  // of the run cand[start, i)
  for (size_t i = 1; i <= cand.size(); ++i) {
    int64_t common = 0;  // with the previous request
    if (i < cand.size()) {
      const int64_t a = cand[i - 1], b = cand[i], n = std::min(lens[a], lens[b]);
      common = common_prefix_len(row(a), row(b), n);
    }
    const bool extends = i < cand.size() && common >= kBlock && (i - start == 1 || 2 * common >= prefix);
    if (extends) {
      prefix = i - start == 1 ? common : std::min(prefix, common);
      continue;
    }
    close(start, i, prefix);
    start = i;
    prefix = 0;
  }
  if (sp.members.empty()) return sp;
  sp.start.assign(bs, 0);
  sp.state_row.assign(bs, -1);
  for (size_t g = 0; g < sp.members.size(); ++g)
    for (const int64_t b : sp.members[g]) {
      sp.start[b] = sp.prefix[g];
      sp.state_row[b] = sp.state_rows;
      sp.state_rows += hq;
    }
  return sp;
}

// Each group's prefix pass (see SharedPrefixes): state rows state_row[b] + head get the (max, sum,
// unnormalised output) of request b's query head over the group's prefix keys.
void attend_shared_prefixes(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                            const int32_t* table, int64_t row_stride, const int64_t* rows, const SharedPrefixes& sp,
                            double scale, float* acc, float* run_max, float* run_sum) {
  const int64_t hq = q.size(1), hk = k_buffer.size(1), d = q.size(2), group = hq / hk;
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  for (size_t g = 0; g < sp.members.size(); ++g) {
    const std::vector<int64_t>& members = sp.members[g];
    const int64_t count = static_cast<int64_t>(members.size()), prefix = sp.prefix[g];
    const int32_t* lead = table + rows[members[0]] * row_stride;
    auto slots = at::empty({prefix}, long_opts);
    std::copy(lead, lead + prefix, slots.data_ptr<int64_t>());
    const auto keys = k_buffer.index_select(0, slots).to(at::kFloat);  // [prefix, hk, d]
    const auto values = v_buffer.index_select(0, slots).to(at::kFloat);
    const auto queries = q.index_select(0, at::tensor(members, long_opts));  // [count, hq, d]
    for (int64_t h = 0; h < hk; ++h) {
      const auto qh = queries.narrow(1, h * group, group).reshape({count * group, d});
      auto p = at::mm(qh, keys.select(1, h).t()).mul_(scale);  // [count * group, prefix]
      const auto probe = (p - p).sum(1);  // NaN where a score is NaN or infinite, as the blocks' probe
      const auto m = std::get<0>(p.max(1));
      p.sub_(m.unsqueeze(1)).exp_();
      const auto l = p.sum(1).add_(probe);
      const auto o = at::mm(p, values.select(1, h)).contiguous();  // [count * group, d]
      const float *mp = m.data_ptr<float>(), *lp = l.data_ptr<float>(), *op = o.data_ptr<float>();
      for (int64_t i = 0; i < count; ++i)
        for (int64_t r = 0; r < group; ++r) {
          const int64_t src = i * group + r, dst = sp.state_row[members[i]] + h * group + r;
          run_max[dst] = mp[src];
          run_sum[dst] = lp[src];
          std::memcpy(acc + dst * d, op + src * d, d * sizeof(float));
        }
    }
  }
}

template <typename T>
void attend(const Problem<T>& p, const std::vector<Unit>& units) {
  const bool avx2 = sgl_cpu::has_avx2();
  // One unit reads seq_len x d keys and values: worth its own task whatever the batch.
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    const int64_t converted = converts_blocks<T>(p.hq, p.hk) ? 2 * kBlock * max_unit_kv_heads(p.hq, p.hk) * p.d : 0;
    std::vector<float> scratch(kMaxRows * (kBlock + p.d + 2) + converted);
    const Unit* u = units.data() + begin;
    switch (p.d) {  // the head dims of the supported models
      case 16: return run_units<T, 16>(avx2, p, u, end - begin, scratch.data());
      case 32: return run_units<T, 32>(avx2, p, u, end - begin, scratch.data());
      case 64: return run_units<T, 64>(avx2, p, u, end - begin, scratch.data());
      case 128: return run_units<T, 128>(avx2, p, u, end - begin, scratch.data());
      case 256: return run_units<T, 256>(avx2, p, u, end - begin, scratch.data());
      default: return run_units<T, 0>(avx2, p, u, end - begin, scratch.data());
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale, int64_t shared_prefix_min_macs) {
  const char* what = "decode_attention";
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), what,
              ": q must be a contiguous float32 [bs, q_heads, head_dim] tensor");
  const int64_t bs = q.size(0), hq = q.size(1), d = q.size(2);
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.sizes() == v_buffer.sizes() && k_buffer.size(2) == d &&
                  k_buffer.scalar_type() == v_buffer.scalar_type() && k_buffer.is_contiguous() &&
                  v_buffer.is_contiguous(),
              what, ": k_buffer and v_buffer must be contiguous [slots, kv_heads, head_dim] tensors of one dtype");
  const int64_t hk = k_buffer.size(1), num_slots = k_buffer.size(0);
  TORCH_CHECK(hk > 0 && hq > 0 && hq % hk == 0, what, ": q_heads must be a positive multiple of kv_heads");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.is_contiguous(),
              what, ": req_to_token must be a contiguous int32 [rows, context] tensor");
  for (const at::Tensor* t : {&req_pool_indices, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == bs && t->is_contiguous(), what,
                ": req_pool_indices and seq_lens must be int64 vectors of one entry per request");
  const int64_t num_rows = req_to_token.size(0), context = req_to_token.size(1);
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  // Every slot the kernel will read is checked first (a bad table would read outside the pool).
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(rows[b] >= 0 && rows[b] < num_rows, what, ": request row ", rows[b], " is outside req_to_token");
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= context, what, ": seq_len ", lens[b], " is outside req_to_token");
    const int32_t* s = table + rows[b] * context;
    int32_t lo = 0, hi = 0;
    for (int64_t j = 0; j < lens[b]; ++j) {
      lo = std::min(lo, s[j]);
      hi = std::max(hi, s[j]);
    }
    TORCH_CHECK(lo >= 0 && hi < num_slots, what, ": request ", b, " reads a KV slot outside the pool");
  }
  auto out = at::empty_like(q);
  const std::vector<Unit> units = make_units(bs, hq, hk);
  const SharedPrefixes shared = find_shared_prefixes(table, context, rows, lens, bs, hq, d, shared_prefix_min_macs);
  std::vector<float> state(shared.state_rows * (d + 2));  // output rows, then maxes, then sums
  float* acc = state.data();
  float *run_max = acc + shared.state_rows * d, *run_sum = run_max + shared.state_rows;
  if (shared.state_rows > 0)
    attend_shared_prefixes(q, k_buffer, v_buffer, table, context, rows, shared, scale, acc, run_max, run_sum);
  AT_DISPATCH_FLOATING_TYPES_AND4(at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, at::kFloat8_e5m2, k_buffer.scalar_type(),
                                  "decode_attention", [&] {
    Problem<scalar_t> p{q.data_ptr<float>(), k_buffer.data_ptr<scalar_t>(), v_buffer.data_ptr<scalar_t>(),
                        table, context, rows, lens, out.data_ptr<float>(), hq, hk, d,
                        static_cast<float>(scale)};
    if (shared.state_rows > 0) {
      p.start = shared.start.data();
      p.state_row = shared.state_row.data();
      p.shared_acc = acc;
      p.shared_max = run_max;
      p.shared_sum = run_sum;
    }
    attend(p, units);
  });
  return out;
}

}  // namespace
}  // namespace sgl_attention

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, float scale, int shared_prefix_min_macs=8388608) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  m.impl("decode_attention", &sgl_attention::decode_attention);
}
