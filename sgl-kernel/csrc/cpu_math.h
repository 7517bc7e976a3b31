// Math shared by the CPU ops of sgl-kernel (header-only).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace sgl_cpu {

// exp for vectorised loops: Cephes' expf polynomial after a reduction by ln 2 (max relative error
// 8e-8 against double-precision exp over [-87, 88], sampled every 7e-4), branch-free so that
// `omp simd` loops vectorise it; libm's expf is a scalar call. Inputs are clamped to [-87, 88]: exp of
// anything below is ~1e-38 instead of 0, harmless for silu.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;
  const int32_t k = static_cast<int32_t>(t + (t >= 0.0f ? 0.5f : -0.5f));
  const float kf = static_cast<float>(k);
  const float r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace sgl_cpu
