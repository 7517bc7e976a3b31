// Math shared by the CPU ops of sgl-kernel (header-only).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// AVX2 + FMA twins of the hot loops: the build has no -march (x86-64 baseline, SSE2), so a function marked
// SGL_TARGET_AVX2 that always-inlines a loop body compiles that body for AVX2 + FMA (and F16C, the
// half-to-float conversions every AVX2 CPU has), and has_avx2() picks it at run time. Elsewhere (aarch64)
// the mark is empty and has_avx2() false: the baseline twin runs.
#if defined(__x86_64__) || defined(_M_X64)
#define SGL_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define SGL_TARGET_AVX2
#endif

namespace sgl_cpu {

// The AVX2 + FMA twin and the baseline twin of `Body` (a function marked always_inline, so each twin
// compiles its body for its own instruction set), and the call that picks one at run time:
//   sgl_cpu::run_twin<my_loop<T, 16>>(has_avx2(), args...);
template <auto Body, typename... Args>
SGL_TARGET_AVX2 void avx2_twin(Args... args) {
  Body(args...);
}

template <auto Body, typename... Args>
void baseline_twin(Args... args) {
  Body(args...);
}

template <auto Body, typename... Args>
inline void run_twin(bool avx2, Args... args) {
  if (avx2)
    avx2_twin<Body>(args...);
  else
    baseline_twin<Body>(args...);
}

// SGLANG_TEST_CPU_OPS_BASELINE=1 runs the baseline twins on any CPU (tests of the code a CPU without AVX2
// runs); read at every call, so a test can switch it.
inline bool has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const char* baseline = std::getenv("SGLANG_TEST_CPU_OPS_BASELINE");
  return yes && !(baseline != nullptr && baseline[0] == '1');
#else
  return false;
#endif
}

// exp for vectorised loops: Cephes' expf polynomial after a reduction by ln 2 (max relative error
// 8e-8 against double-precision exp over [-87, 88], sampled every 7e-4), branch-free so that
// `omp simd` loops vectorise it; libm's expf is a scalar call. Inputs are clamped to [-87, 88]: exp of
// anything below is ~1e-38 instead of 0, harmless for silu.
inline __attribute__((always_inline)) float fast_exp(float v) {
  // max(-87, NaN) is -87 (the comparison is false): a NaN gives exp(-87), never an undefined int conversion.
  // (Returning the NaN itself takes a select that stops GCC vectorising the loops; callers that must
  // propagate NaN check their inputs, as the attention op does.)
  const float x = std::min(88.0f, std::max(-87.0f, v));
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

// silu(v) = v / (1 + exp(-v)) through fast_exp, for vectorised loops (the conv update, the gated norms, the
// routed experts). Below v = -88 fast_exp's clamp would give v / 1.6e38 (-0.6 at v = -1e38) instead of ~0:
// the factor is 0 there, by a 0 / 1 mask GCC vectorises (a NaN-keeping max or select stopped it: the
// experts' silu 125 -> 173 us at 256 tokens). NaN and -inf give NaN, as torch's silu.
inline __attribute__((always_inline)) float silu(float v) {
  return v * (static_cast<float>(v >= -88.0f) / (1.0f + fast_exp(-v)));
}

}  // namespace sgl_cpu
