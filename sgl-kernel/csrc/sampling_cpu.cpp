// CPU sampling op, registered as torch.ops.sgl_kernel.*:
//
//   sample_logits(logits [bs, vocab] float32, temperatures [bs] float32, uniforms [bs] float32) -> [bs] int64
//       Per row: temperature <= 0 takes the first maximum; otherwise inverse-CDF sampling from
//       softmax(logits / T): the first id at which the running sum of w(v) = exp((x(v) - max) / T) exceeds
//       u times the total. The sums run over blocks of 64 ids (each block's sum first, then the ids of the
//       block the target falls in), which keeps the total and the search consistent while the exp loop
//       vectorises. A row holding a NaN takes its first NaN (greedy or not), as torch's max reports it.
//
// One pass for the maximum and one for the weights, instead of the torch path's ~5 passes over [bs, vocab]
// (max, division, softmax, cumulative sum; `layers/sampler.py`, its twin: same rule, flat cumulative sum
// and libm's exp, so a draw can differ from the twin's only where u lands within rounding of a step of
// the cumulative sum). w(v) > 0 for every id (the polynomial exp clamps at exp(-87)), so no id is out of
// reach, as none is in softmax except by underflow.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace sgl_sampling {
namespace {

constexpr int64_t kBlock = 64;

struct Rows {
  const float *logits, *temperatures, *uniforms;
  int64_t* out;
  int64_t vocab;
};

// Rows [begin, end); `w` holds vocab floats, `sums` one float per block.
inline __attribute__((always_inline)) void sample_rows(const Rows& p, int64_t begin, int64_t end, float* w,
                                                       float* sums) {
  const int64_t vocab = p.vocab;
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
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
        continue;
      }
    }
    const float t = p.temperatures[r];
    if (!(t > 0.0f)) {
      int64_t i = 0;
      while (x[i] != m) ++i;
      p.out[r] = i;
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
    // Strictly below the total (u * total can round up to it), so the block search ends inside the row.
    const float target = std::min(p.uniforms[r] * total, std::nextafter(total, 0.0f));
    float before = 0.0f;
    int64_t b = 0;
    while (b < blocks - 1 && before + sums[b] <= target) before += sums[b++];
    const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
    int64_t id = hi - 1;  // the within-block sums may round below the block's sum: its last id then
    float run = before;
    for (int64_t i = lo; i < hi; ++i) {
      run += w[i];
      if (run > target) {
        id = i;
        break;
      }
    }
    p.out[r] = id;
  }
}

SGL_TARGET_AVX2 void sample_rows_avx2(const Rows& p, int64_t begin, int64_t end, float* w, float* sums) {
  sample_rows(p, begin, end, w, sums);
}

void sample_rows_baseline(const Rows& p, int64_t begin, int64_t end, float* w, float* sums) {
  sample_rows(p, begin, end, w, sums);
}

at::Tensor sample_logits(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "sample_logits: logits must be a contiguous float32 [bs, vocab] tensor");
  const int64_t bs = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_logits: the vocabulary is empty");
  for (const at::Tensor* t : {&temperatures, &uniforms})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == bs && t->is_contiguous(),
                "sample_logits: temperatures and uniforms must be contiguous float32 [bs] tensors");
  auto out = at::empty({bs}, logits.options().dtype(at::kLong));
  const Rows p{logits.data_ptr<float>(), temperatures.data_ptr<float>(), uniforms.data_ptr<float>(),
               out.data_ptr<int64_t>(), vocab};
  const bool avx2 = sgl_cpu::has_avx2();
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  at::parallel_for(0, bs, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(vocab), sums(blocks);
    if (avx2)
      sample_rows_avx2(p, begin, end, w.data(), sums.data());
    else
      sample_rows_baseline(p, begin, end, w.data(), sums.data());
  });
  return out;
}

}  // namespace
}  // namespace sgl_sampling

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("sample_logits(Tensor logits, Tensor temperatures, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) { m.impl("sample_logits", &sgl_sampling::sample_logits); }
