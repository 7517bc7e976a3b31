// CPU RMSNorm ops, registered as torch.ops.sgl_kernel.*:
//
//   rmsnorm(x, weight, eps, weight_offset) -> out
//       out = x / sqrt(mean(x^2) + eps) * (weight + weight_offset), over the last dim (Qwen3-Next stores
//       its weights centred on 0: offset 1; Nemotron-H: offset 0);
//   gated_rmsnorm(x, gate, weight, eps, group_size, gate_first) -> out
//       gate_first = false (Qwen3-Next's gated norm): weight * norm(x) * silu(gate);
//       gate_first = true (Nemotron-H's Mamba2 output norm): weight * norm(x * silu(gate)), the norm taken
//       within groups of group_size channels.
//
// All float32 (the modules take this path for float32 activations; other dtypes keep the torch form, whose
// rounding points they reproduce). A torch RMSNorm is ~7 small ops (~17-20 us per call at decode sizes on
// one thread); this is one. Rows are split with at::parallel_for. The torch twins are the modules in
// python/sglang/srt/layers/layernorm.py (test/unit/kernels/test_cpu_norm.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>

#include "cpu_math.h"

namespace sgl_norm {
namespace {

// With the polynomial exp (relative error < 1e-7) the gate loops vectorise; libm's expf is a scalar call,
// which made the gated norms slower than torch's from ~256 rows.
using sgl_cpu::silu;

// 1 / sqrt(mean(v^2) + eps) over n values.
inline __attribute__((always_inline)) float inv_rms(const float* v, int64_t n, float eps) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += v[i] * v[i];
  return 1.0f / std::sqrt(s / static_cast<float>(n) + eps);
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1, what,
              ": x must be a contiguous float32 tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(-1),
              what, ": weight must be a contiguous float32 vector of x's last dim");
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps, double weight_offset) {
  check_rows(x, weight, "rmsnorm");
  const int64_t h = x.size(-1), rows = h == 0 ? 0 : x.numel() / h;
  auto out = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float e = static_cast<float>(eps), off = static_cast<float>(weight_offset);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * h;
      float* o = os + r * h;
      const float k = inv_rms(xr, h, e);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = xr[i] * k * (w[i] + off);
    }
  });
  return out;
}

struct GatedRows {
  const float *x, *gate, *weight;
  float* out;
  int64_t h, group_size;
  float eps;
  bool gate_first;
};

// Rows [begin, end). Always inlined, so each caller compiles it for its own instruction set: the gate's
// exp is most of the work, 2x faster in AVX2 than in the build's SSE2 baseline.
inline __attribute__((always_inline)) void gated_rows(const GatedRows& p, int64_t begin, int64_t end) {
  const int64_t h = p.h, group_size = p.group_size;
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = p.x + r * h;
    const float* gr = p.gate + r * h;
    const float* w = p.weight;
    float* o = p.out + r * h;
    if (p.gate_first) {
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = xr[i] * silu(gr[i]);
      for (int64_t g0 = 0; g0 < h; g0 += group_size) {
        const float k = inv_rms(o + g0, group_size, p.eps);
#pragma omp simd
        for (int64_t i = g0; i < g0 + group_size; ++i) o[i] = w[i] * (o[i] * k);
      }
    } else {
      for (int64_t g0 = 0; g0 < h; g0 += group_size) {
        const float k = inv_rms(xr + g0, group_size, p.eps);
#pragma omp simd
        for (int64_t i = g0; i < g0 + group_size; ++i) o[i] = w[i] * (xr[i] * k) * silu(gr[i]);
      }
    }
  }
}

SGL_TARGET_AVX2 void gated_rows_avx2(const GatedRows& p, int64_t begin, int64_t end) {
  gated_rows(p, begin, end);
}

void gated_rows_baseline(const GatedRows& p, int64_t begin, int64_t end) { gated_rows(p, begin, end); }

at::Tensor gated_rmsnorm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps,
                         int64_t group_size, bool gate_first) {
  const char* what = "gated_rmsnorm";
  check_rows(x, weight, what);
  TORCH_CHECK(gate.scalar_type() == at::kFloat && gate.is_contiguous() && gate.sizes() == x.sizes(), what,
              ": gate must be a contiguous float32 tensor shaped like x");
  const int64_t h = x.size(-1), rows = h == 0 ? 0 : x.numel() / h;
  TORCH_CHECK(group_size > 0 && h % group_size == 0, what, ": group_size must divide the last dim");
  auto out = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* gs = gate.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const bool avx2 = sgl_cpu::has_avx2();
  const GatedRows p{xs, gs, w, os, h, group_size, e, gate_first};
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    if (avx2)
      gated_rows_avx2(p, begin, end);
    else
      gated_rows_baseline(p, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace sgl_norm

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps, float weight_offset) -> Tensor");
  m.def("gated_rmsnorm(Tensor x, Tensor gate, Tensor weight, float eps, int group_size, bool gate_first) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  m.impl("rmsnorm", &sgl_norm::rmsnorm);
  m.impl("gated_rmsnorm", &sgl_norm::gated_rmsnorm);
}
