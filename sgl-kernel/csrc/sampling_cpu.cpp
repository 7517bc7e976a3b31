// CPU sampling op, registered as torch.ops.sgl_kernel.*:
//
//   sample_logits(logits [bs, vocab] float32, temperatures [bs] float32, uniforms [bs] float32,
//                 top_ps [bs] float32?, top_ks [bs] int64?, min_ps [bs] float32?) -> [bs] int64
//       Per row: temperature <= 0 takes the first maximum; otherwise inverse-CDF sampling from
//       softmax(logits / T) cut as `layers/sampler.py` documents (top-k, then top-p of the whole
//       distribution, then min-p; tokens as likely as the cut all kept): the first id at which the running
//       sum of the kept weights w(v) = exp((x(v) - max) / T) exceeds u times their total. The sums run over
//       blocks of 64 ids (each block's sum first, then the ids of the block the target falls in), which
//       keeps the total and the search consistent while the exp loop vectorises. A row holding a NaN takes
//       its first NaN (greedy or not), as torch's max reports it; a row whose maximum is infinite, or whose
//       temperature's reciprocal overflows, its first maximum. With `logprobs` ([bs] float32), each row's
//       drawn id's log-probability is written there: of softmax(logits / T) before the cut, of the
//       unscaled softmax for greedy rows (`scaled_log_softmax`'s convention), NaN where a logit is NaN or
//       the maximum infinite.
//
// The cut needs the row's most likely weights in order only down to it: the weights of at least 1/1024
// of the largest (then 2^-20, then all) are gathered and sorted, enough as soon as they hold the top-k-th
// weight or reach the top-p mass, since every weight left out is smaller than every one taken. Peaked rows
// sort a few dozen values instead of the vocabulary.
//
// A few passes over [bs, vocab] instead of the torch path's ~5 (and its partial sort; `layers/sampler.py`,
// its twin: the same rule with libm's exp and flat float32 cumulative sums, so a draw can differ from the
// twin's only where u lands within rounding of a step of the cumulative sum, or a weight within rounding
// of the cut). w(v) > 0 for every id (the polynomial exp clamps at exp(-87)), so no id without a cut is
// out of reach, as none is in softmax except by underflow.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace sgl_sampling {
namespace {

constexpr int64_t kBlock = 64;

struct Rows {
  const float *logits, *temperatures, *uniforms;
  const float *top_ps, *min_ps;  // null: no such cut in the batch
  const int64_t* top_ks;
  int64_t* out;
  float* logprobs;  // null: not asked for
  int64_t vocab;
};

struct Scratch {
  std::vector<float> w, sums, taken;
};

// The weight below which a row's tokens are cut (0: none). `w` holds the row's weights, the largest 1.
inline float cut_weight(const float* w, int64_t vocab, float total, float top_p, int64_t top_k, float min_p,
                        std::vector<float>& taken) {
  const float min_p_cut = min_p > 0.0f ? min_p : 0.0f;  // of the largest weight, exp(0) = 1
  const bool by_k = top_k > 0 && top_k < vocab, by_p = top_p < 1.0f;
  if (!by_k && !by_p) return min_p_cut;
  const float mass = top_p * total;
  for (float floor : {0x1p-10f, 0x1p-20f, 0.0f}) {
    taken.clear();
    for (int64_t i = 0; i < vocab; ++i)
      if (w[i] >= floor) taken.push_back(w[i]);
    const int64_t n = static_cast<int64_t>(taken.size());
    if (n == 0) continue;  // (the largest weight is 1: only a non-finite row would take none)
    // The k-th largest weight, if the taken ones hold it (every weight left out is smaller).
    const bool k_known = by_k && n >= top_k;
    if (by_k && !k_known && !by_p) continue;
    if (k_known)
      std::nth_element(taken.begin(), taken.begin() + (top_k - 1), taken.end(), std::greater<float>());
    // In order from the largest: the first top_k when known (past them the top-k cut is the higher).
    const int64_t walk = k_known ? top_k : n;
    std::sort(taken.begin(), taken.begin() + walk, std::greater<float>());
    const float k_cut = k_known ? taken[top_k - 1] : 0.0f;
    if (!by_p) return std::max(min_p_cut, k_cut);
    // Top-p keeps a weight while the ones before it stay within the mass.
    float before = 0.0f, p_cut = taken[0];
    bool inside = false;
    for (int64_t i = 0; i < walk; ++i) {
      if (before > mass) {
        inside = true;
        break;
      }
      p_cut = taken[i];
      before += taken[i];
    }
    // Cut inside the taken weights: it is above every weight left out, the top-k-th included. Otherwise
    // it lies past the walk: below the known top-k cut, or (every weight taken) it keeps them all.
    if (inside || k_known || n == vocab) return std::max(min_p_cut, std::max(k_cut, p_cut));
  }
  return min_p_cut;  // not reached: the last floor takes every weight
}

// Rows [begin, end).
inline __attribute__((always_inline)) void sample_rows(const Rows& p, int64_t begin, int64_t end,
                                                       Scratch& scratch) {
  const int64_t vocab = p.vocab;
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  float* w = scratch.w.data();
  float* sums = scratch.sums.data();
  for (int64_t r = begin; r < end; ++r) {
    const float* x = p.logits + r * vocab;
    // The maximum, and a probe that is NaN when some logit is NaN or infinite (x - x), in one pass of
    // float reductions written so that GCC vectorises them (with std::max it did not: 2.3x slower than
    // torch's max).
    float m = -std::numeric_limits<float>::infinity(), probe = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : probe)
    for (int64_t i = 0; i < vocab; ++i) {
      m = m > x[i] ? m : x[i];
      probe += x[i] - x[i];
    }
    if (probe != probe) {
      int64_t i = 0;
      while (i < vocab && x[i] == x[i]) ++i;
      if (i < vocab) {
        p.out[r] = i;
        if (p.logprobs) p.logprobs[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
    }
    // Greedy: temperature 0, one so small that 1 / T overflows (SamplingParams makes those below 1e-6
    // greedy), or an infinite maximum (an all -inf row, or a +inf logit, which takes all the mass).
    const float t = p.temperatures[r];
    if (!(t > 0.0f) || !std::isfinite(1.0f / t) || !std::isfinite(m)) {
      int64_t i = 0;
      while (x[i] != m) ++i;
      p.out[r] = i;
      if (p.logprobs) {  // of the unscaled distribution (log_softmax has none for an infinite maximum)
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < vocab; ++j) sum += sgl_cpu::fast_exp(x[j] - m);
        p.logprobs[r] = std::isfinite(m) ? -std::log(sum) : std::numeric_limits<float>::quiet_NaN();
      }
      continue;
    }
    const float inv_t = 1.0f / t;
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = lo; i < hi; ++i) {
        w[i] = sgl_cpu::fast_exp((x[i] - m) * inv_t);
        s += w[i];
      }
      sums[b] = s;
      total += s;
    }
    const float log_total = std::log(total);  // before the cut: logprobs are of the whole distribution
    const float cut = cut_weight(w, vocab, total, p.top_ps ? p.top_ps[r] : 1.0f, p.top_ks ? p.top_ks[r] : 0,
                                 p.min_ps ? p.min_ps[r] : 0.0f, scratch.taken);
    if (cut > 0.0f) {  // the kept weights and their sums (the largest, 1, is always kept)
      total = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = lo; i < hi; ++i) {
          w[i] = w[i] >= cut ? w[i] : 0.0f;
          s += w[i];
        }
        sums[b] = s;
        total += s;
      }
    }
    // Strictly below the total (u * total can round up to it), so the block search ends inside the row,
    // on a kept id.
    const float target = std::min(p.uniforms[r] * total, std::nextafter(total, 0.0f));
    float before = 0.0f;
    int64_t b = 0;
    while (b < blocks - 1 && before + sums[b] <= target) before += sums[b++];
    const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
    // The within-block sums may round below the block's sum: its last kept id then.
    int64_t id = hi - 1;
    while (id > lo && w[id] == 0.0f) --id;
    float run = before;
    for (int64_t i = lo; i < hi; ++i) {
      run += w[i];
      if (run > target) {
        id = i;
        break;
      }
    }
    p.out[r] = id;
    if (p.logprobs) p.logprobs[r] = (x[id] - m) * inv_t - log_total;
  }
}

SGL_TARGET_AVX2 void sample_rows_avx2(const Rows& p, int64_t begin, int64_t end, Scratch& scratch) {
  sample_rows(p, begin, end, scratch);
}

void sample_rows_baseline(const Rows& p, int64_t begin, int64_t end, Scratch& scratch) {
  sample_rows(p, begin, end, scratch);
}

template <typename T>
const T* optional_rows(const std::optional<at::Tensor>& t, at::ScalarType type, int64_t bs, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == type && t->dim() == 1 && t->size(0) == bs && t->is_contiguous(),
              "sample_logits: ", name, " must be a contiguous [bs] tensor of ", c10::toString(type));
  return t->data_ptr<T>();
}

at::Tensor sample_logits(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms,
                         const std::optional<at::Tensor>& top_ps, const std::optional<at::Tensor>& top_ks,
                         const std::optional<at::Tensor>& min_ps, const std::optional<at::Tensor>& logprobs) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "sample_logits: logits must be a contiguous float32 [bs, vocab] tensor");
  const int64_t bs = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_logits: the vocabulary is empty");
  for (const at::Tensor* t : {&temperatures, &uniforms})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == bs && t->is_contiguous(),
                "sample_logits: temperatures and uniforms must be contiguous float32 [bs] tensors");
  auto out = at::empty({bs}, logits.options().dtype(at::kLong));
  const Rows p{logits.data_ptr<float>(),
               temperatures.data_ptr<float>(),
               uniforms.data_ptr<float>(),
               optional_rows<float>(top_ps, at::kFloat, bs, "top_ps"),
               optional_rows<float>(min_ps, at::kFloat, bs, "min_ps"),
               optional_rows<int64_t>(top_ks, at::kLong, bs, "top_ks"),
               out.data_ptr<int64_t>(),
               const_cast<float*>(optional_rows<float>(logprobs, at::kFloat, bs, "logprobs")),
               vocab};
  const bool avx2 = sgl_cpu::has_avx2();
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  at::parallel_for(0, bs, 16, [&](int64_t begin, int64_t end) {
    Scratch scratch{std::vector<float>(vocab), std::vector<float>(blocks), {}};
    if (avx2)
      sample_rows_avx2(p, begin, end, scratch);
    else
      sample_rows_baseline(p, begin, end, scratch);
  });
  return out;
}

}  // namespace
}  // namespace sgl_sampling

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "sample_logits(Tensor logits, Tensor temperatures, Tensor uniforms, Tensor? top_ps=None, Tensor? top_ks=None, "
      "Tensor? min_ps=None, Tensor(a!)? logprobs=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) { m.impl("sample_logits", &sgl_sampling::sample_logits); }
