// CPU rotary position embedding, registered as torch.ops.sgl_kernel.rotary_embedding:
//
//   rotary_embedding(positions, q, k, inv_freq, rotary_dim) -> (q_out, k_out)
//
// Neox style (the halves of the first rotary_dim channels rotated, as transformers' `rotate_half`; the
// other channels pass through) at absolute positions: angle = float(position) * inv_freq[i], computed in
// float32 as the torch form does. q [T, Hq, D] and k [T, Hk, D] float32 with contiguous heads (rows and heads
// may be strided: q is a view of the projection that also holds the output gate); the outputs are new
// contiguous tensors. The torch form is ~20 small ops per layer (~70 us at a 16-request decode on one
// thread); this is one. The torch twin is RotaryEmbedding in python/sglang/srt/layers/rotary_embedding.py
// (test/unit/kernels/test_cpu_rope.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace sgl_rope {
namespace {

void rotate(const at::Tensor& x, at::Tensor& out, const std::vector<float>& cos, const std::vector<float>& sin,
            int64_t t, int64_t half, int64_t rotary_dim) {
  const int64_t heads = x.size(1), d = x.size(2), s0 = x.stride(0), s1 = x.stride(1);
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float* c = cos.data() + t * half;
  const float* s = sin.data() + t * half;
  for (int64_t h = 0; h < heads; ++h) {
    const float* xr = xs + t * s0 + h * s1;
    float* o = os + (t * heads + h) * d;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = xr[i], x2 = xr[half + i];
      o[i] = x1 * c[i] - x2 * s[i];
      o[half + i] = x2 * c[i] + x1 * s[i];
    }
    for (int64_t i = rotary_dim; i < d; ++i) o[i] = xr[i];
  }
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& inv_freq,
                                                    int64_t rotary_dim) {
  const char* what = "rotary_embedding";
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous(), what,
              ": positions must be a contiguous int64 vector");
  const int64_t tokens = positions.size(0);
  for (const at::Tensor* x : {&q, &k})
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->dim() == 3 && x->size(0) == tokens && x->stride(2) == 1, what,
                ": q and k must be float32 [tokens, heads, head_dim] tensors with contiguous heads");
  TORCH_CHECK(q.size(2) == k.size(2) && rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= q.size(2), what,
              ": rotary_dim must be even and at most the head dim of q and k");
  const int64_t half = rotary_dim / 2;
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous() && inv_freq.numel() == half, what,
              ": inv_freq must be a contiguous float32 vector of rotary_dim / 2");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* f = inv_freq.data_ptr<float>();
  std::vector<float> cos(tokens * half), sin(tokens * half);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos[t]) * f[i];
      cos[t * half + i] = std::cos(angle);
      sin[t * half + i] = std::sin(angle);
    }
  auto q_out = at::empty({tokens, q.size(1), q.size(2)}, q.options());
  auto k_out = at::empty({tokens, k.size(1), k.size(2)}, k.options());
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, q_out, cos, sin, t, half, rotary_dim);
      rotate(k, k_out, cos, sin, t, half, rotary_dim);
    }
  });
  return {q_out, k_out};
}

}  // namespace
}  // namespace sgl_rope

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor inv_freq, int rotary_dim) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) { m.impl("rotary_embedding", &sgl_rope::rotary_embedding); }
