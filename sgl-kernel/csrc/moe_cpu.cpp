// CPU routed experts for decode-size batches, registered as torch.ops.sgl_kernel.moe_experts.
//
//   moe_experts(x, w13t, w2t, topk_weights, topk_ids, gated, activation,
//               shared_w13t=None, shared_w2t=None, shared_gate=None) -> out
//
// x [T, H] float32; w13t [E, H, R] and w2t [E, I, H]: the experts' w13 [E, R, H] (R = 2I: gate rows then
// up rows, gated; R = I: up, plain) and w2 [E, H, I] transposed, contiguous (on CPU `RoutedExperts` stores
// them so: its w13 / w2 are views of these); topk_weights [T, k] float32, topk_ids [T, k] int64.
// out[t] = sum over its k experts e of weight * w2[e] act(w13[e] x[t]) (gated: act(gate) * up),
// accumulated in float32, the k terms added in their top-k order. Activations: 0 silu, 1 relu2 (relu
// squared), 2 relu, 3 gelu (erf).
//
// The layer's shared expert, where given (shared_w13t [H, Rs] and shared_w2t [Is, H], the same layout for one
// expert with its own intermediate size, the same gating and activation), is one more expert serving every
// token (its tokens split into tasks of kSharedChunk): out[t] += g[t] * w2s act(w13s x[t]), added after the
// routed terms, with g[t] = sigmoid(shared_gate . x[t]) (shared_gate [H], Qwen3-Next's shared_expert_gate) or 1.
// In torch that is 6-8 more ops per layer.
//
// The torch path sorts the assignments by expert and runs two grouped GEMMs over them plus ~15 small ops
// (`RoutedExperts.forward_device`); torch's CPU grouped GEMM is a loop of one `mm` per expert through the
// dispatcher, ~60 us per layer at the tiny presets' decode sizes. Here: a counting sort by expert, then
// per expert its tokens in tiles of kWideTile (or kTile), each weight row read once per tile, units split
// over experts with at::parallel_for. The caller keeps prefill-size batches on the GEMM path.
// The torch twin is `RoutedExperts.forward_device` (test/unit/kernels/test_cpu_moe.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sgl_moe {
namespace {

constexpr int kTile = 4;   // tokens that share each pass over a weight row
// An expert with at least this many tokens left takes them in tiles of kWideTile x kWideCols accumulators:
// each weight vector then serves 8 tokens, not 4 (256 tokens x top-2 of 4 experts, 128 / 128 wide: 1.06
// -> 0.77 ms). Fewer tokens keep the tile of 4 (padding 5-7 tokens to 8 measured slower).
constexpr int kWideTile = 8;
constexpr int kWideCols = 16;
constexpr int64_t kSharedChunk = 16;  // the shared expert's tokens per task
constexpr int kCols = 32;  // output columns per register block (4 AVX2 vectors per token)
constexpr int64_t kRegisterWidth = 256;  // outputs up to this wide are computed in register blocks

inline float activate(float v, int64_t act) {
  switch (act) {
    case 0: return v / (1.0f + std::exp(-v));  // (activate_row runs silu in its own vector loop)
    case 1: return v > 0.0f ? v * v : 0.0f;
    case 2: return v > 0.0f ? v : 0.0f;
    default: return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
  }
}

// a[c] = act(h[c]) (gated: act(h[c]) * h[I + c]) for c < I. silu is the vectorised sgl_cpu::silu (libm's
// expf is a scalar call: at 256 tokens x top-2 of 128-wide experts, 65,536 of them per layer were a third
// of the op's time); the other activations stay scalar.
inline __attribute__((always_inline)) void activate_row(const float* h, int64_t I, bool gated, int64_t act,
                                                        float* a) {
  if (act == 0) {
#pragma omp simd
    for (int64_t c = 0; c < I; ++c) a[c] = sgl_cpu::silu(h[c]);
  } else {
    for (int64_t c = 0; c < I; ++c) a[c] = activate(h[c], act);
  }
  if (gated) {
#pragma omp simd
    for (int64_t c = 0; c < I; ++c) a[c] *= h[I + c];
  }
}

template <typename W>
struct Problem {
  const float* x;  // [T, H]
  const W* w13t;   // [E, H, R]
  const W* w2t;    // [E, I, H]
  const float* topk_weights;  // [T * k]
  const int64_t* by_expert;   // assignment ids (t * k + j) sorted by expert
  const int64_t* expert_start;  // [E + 1] into by_expert
  float* y;  // [T * k, H]: each assignment's weighted output
  int64_t k, H, I;
  bool gated;
  int64_t act;
};

// out[t][0:m] = sum_c in[t][c] * rows[c][0:m] for the kN tokens of a tile (rows of length `ld`). Narrow
// outputs go in blocks of kCols columns whose accumulators (kN x kCols floats, at most 16 AVX2 registers)
// stay in registers over the whole sum; wide ones stream each weight row once (a column block would
// walk the weights with a stride of a row, 2x slower where the weights come from memory).
template <int kN, typename W, int kCols = (kN > kTile ? kWideCols : sgl_moe::kCols)>
inline __attribute__((always_inline)) void tile_product(const float* const* in, int64_t len, const W* rows,
                                                        int64_t ld, int64_t m, float* const* out) {
  int64_t j = 0;
  if (m <= kRegisterWidth) {
    for (; j + kCols <= m; j += kCols) {
      float acc[kN][kCols] = {};
      for (int64_t c = 0; c < len; ++c) {
        const W* row = rows + c * ld + j;
        for (int t = 0; t < kN; ++t) {
          const float v = in[t][c];
#pragma omp simd
          for (int l = 0; l < kCols; ++l) acc[t][l] += v * static_cast<float>(row[l]);
        }
      }
      for (int t = 0; t < kN; ++t) std::copy(acc[t], acc[t] + kCols, out[t] + j);
    }
  }
  if (j < m) {  // wide outputs (whole rows streamed once, the outputs in L1), or the last partial block
    for (int t = 0; t < kN; ++t) std::fill(out[t] + j, out[t] + m, 0.0f);
    for (int64_t c = 0; c < len; ++c) {
      const W* row = rows + c * ld;
      for (int t = 0; t < kN; ++t) {
        const float v = in[t][c];
        float* o = out[t];
#pragma omp simd
        for (int64_t l = j; l < m; ++l) o[l] += v * static_cast<float>(row[l]);
      }
    }
  }
}

// tile_product for a tile of `width` tokens (1, 2, kTile or kWideTile), rows of length m.
template <typename W>
inline __attribute__((always_inline)) void product(int width, const float* const* in, int64_t len, const W* rows,
                                                   int64_t m, float* const* out) {
  if (width == 1)
    tile_product<1>(in, len, rows, m, m, out);
  else if (width == 2)
    tile_product<2>(in, len, rows, m, m, out);
  else if (width == kTile)
    tile_product<kTile>(in, len, rows, m, m, out);
  else if (width == kWideTile)
    tile_product<kWideTile>(in, len, rows, m, m, out);
  else
    TORCH_CHECK(false, "moe_experts: no tile of ", width, " tokens");
}

// Experts [begin, end). Always inlined, so each caller compiles it for its own instruction set. With the
// weights transposed, both products are sums of weight rows scaled by one input each (vectorised along
// the row, no horizontal sums). A tile of 3 is padded to 4 with a zero input row; tiles of 1 and 2 run
// as such (an expert that serves one token of a decode batch must not pay for four).
template <typename W>
inline __attribute__((always_inline)) void expert_units(const Problem<W>& p, int64_t begin, int64_t end) {
  const int64_t H = p.H, I = p.I, R = p.gated ? 2 * I : I;
  std::vector<float> h(kWideTile * R), a(kWideTile * I), zeros(std::max(H, I), 0.0f), spare(kWideTile * H);
  const float* xs[kWideTile];
  const float* as[kWideTile];
  float* hs[kWideTile];
  float* ys[kWideTile];
  for (int t = 0; t < kWideTile; ++t) {
    hs[t] = h.data() + t * R;
    as[t] = a.data() + t * I;
  }
  for (int64_t e = begin; e < end; ++e) {
    const W* w13t = p.w13t + e * H * R;
    const W* w2t = p.w2t + e * I * H;
    for (int64_t s = p.expert_start[e], n = 0; s < p.expert_start[e + 1]; s += n) {
      const int64_t left = p.expert_start[e + 1] - s;
      const int tile = left >= kWideTile ? kWideTile : kTile;
      n = std::min<int64_t>(tile, left);
      const int64_t* asg = p.by_expert + s;
      for (int64_t t = 0; t < tile; ++t) {
        xs[t] = t < n ? p.x + (asg[t] / p.k) * H : zeros.data();
        ys[t] = t < n ? p.y + asg[t] * H : spare.data() + t * H;
      }
      const int width = n == 1 ? 1 : n == 2 ? 2 : tile;
      product(width, xs, H, w13t, R, hs);
      for (int64_t t = 0; t < n; ++t) activate_row(h.data() + t * R, I, p.gated, p.act, a.data() + t * I);
      for (int64_t t = n; t < tile; ++t) std::fill(a.begin() + t * I, a.begin() + (t + 1) * I, 0.0f);
      product(width, as, I, w2t, H, ys);
      for (int64_t t = 0; t < n; ++t) {
        const float w = p.topk_weights[asg[t]];
#pragma omp simd
        for (int64_t o = 0; o < H; ++o) ys[t][o] *= w;
      }
    }
  }
}

// The build has no -march (x86-64 baseline, SSE2); AVX2 + FMA where the CPU has them.
template <typename W>
SGL_TARGET_AVX2 void expert_units_avx2(const Problem<W>& p, int64_t begin, int64_t end) {
  expert_units(p, begin, end);
}

template <typename W>
void expert_units_baseline(const Problem<W>& p, int64_t begin, int64_t end) {
  expert_units(p, begin, end);
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13t, const at::Tensor& w2t,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids, bool gated, int64_t activation,
                       const c10::optional<at::Tensor>& shared_w13t, const c10::optional<at::Tensor>& shared_w2t,
                       const c10::optional<at::Tensor>& shared_gate) {
  const char* what = "moe_experts";
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), what,
              ": x must be a contiguous float32 [tokens, hidden] tensor");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w13t.dim() == 3 && w2t.dim() == 3 && w13t.is_contiguous() && w2t.is_contiguous() &&
                  w13t.scalar_type() == w2t.scalar_type(),
              what, ": w13t and w2t must be contiguous [experts, rows, cols] tensors of one dtype");
  const int64_t E = w13t.size(0), I = w2t.size(1);
  TORCH_CHECK(w13t.size(1) == H && w13t.size(2) == (gated ? 2 * I : I) && w2t.size(0) == E && w2t.size(2) == H,
              what, ": w13t must be [experts, hidden, ", gated ? "2 x " : "",
              "intermediate] and w2t [experts, intermediate, hidden]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  topk_ids.is_contiguous(),
              what, ": topk_ids must be a contiguous int64 [tokens, k] tensor");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.is_contiguous(),
              what, ": topk_weights must be a contiguous float32 tensor shaped like topk_ids");
  TORCH_CHECK(activation >= 0 && activation <= 3, what, ": activation must be 0 (silu), 1 (relu2), 2 (relu) or 3 (gelu)");
  const int64_t k = topk_ids.size(1), A = T * k;
  TORCH_CHECK(k > 0, what, ": every token needs at least one expert (topk_ids has 0 columns)");
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  // Counting sort of the assignments by expert (stable), every id checked first.
  std::vector<int64_t> start(E + 1, 0), by_expert(A);
  for (int64_t i = 0; i < A; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, what, ": expert id ", ids[i], " is outside the ", E, " experts");
    ++start[ids[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < A; ++i) by_expert[fill[ids[i]]++] = i;

  // The shared expert: one more expert, every token assigned to it once (k = 1), weighted by its gate.
  const bool shared = shared_w13t.has_value();
  TORCH_CHECK(shared == shared_w2t.has_value(), what, ": shared_w13t and shared_w2t come together");
  TORCH_CHECK(shared || !shared_gate.has_value(), what, ": shared_gate needs the shared expert's weights");
  int64_t Is = 0;
  std::vector<int64_t> shared_order;
  at::Tensor shared_weights, shared_y;
  if (shared) {
    const at::Tensor &s13 = *shared_w13t, &s2 = *shared_w2t;
    TORCH_CHECK(s13.dim() == 2 && s2.dim() == 2 && s13.is_contiguous() && s2.is_contiguous() &&
                    s13.scalar_type() == w13t.scalar_type() && s2.scalar_type() == w13t.scalar_type(),
                what, ": shared_w13t and shared_w2t must be contiguous 2-d tensors of the experts' dtype");
    Is = s2.size(0);
    TORCH_CHECK(s13.size(0) == H && s13.size(1) == (gated ? 2 * Is : Is) && s2.size(1) == H, what,
                ": shared_w13t must be [hidden, ", gated ? "2 x " : "", "shared intermediate] and shared_w2t "
                "[shared intermediate, hidden]");
    shared_order.resize(T);
    for (int64_t t = 0; t < T; ++t) shared_order[t] = t;
    if (shared_gate.has_value()) {
      const at::Tensor& g = *shared_gate;
      TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() == 1 && g.size(0) == H && g.is_contiguous(), what,
                  ": shared_gate must be a contiguous float32 [hidden] vector");
      shared_weights = at::empty({T}, x.options());
      const float *gs = g.data_ptr<float>(), *xs = x.data_ptr<float>();
      float* ws = shared_weights.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        float dot = 0.0f;
        for (int64_t c = 0; c < H; ++c) dot += gs[c] * xs[t * H + c];
        ws[t] = 1.0f / (1.0f + std::exp(-dot));
      }
    } else {
      shared_weights = at::ones({T}, x.options());
    }
    shared_y = at::empty({T, H}, x.options());
  }

  auto y = at::empty({A, H}, x.options());
  const bool avx2 = sgl_cpu::has_avx2();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w13t.scalar_type(), "moe_experts", [&] {
    using P = Problem<scalar_t>;
    const P p{x.data_ptr<float>(), w13t.data_ptr<scalar_t>(), w2t.data_ptr<scalar_t>(),
              topk_weights.data_ptr<float>(), by_expert.data(), start.data(), y.data_ptr<float>(),
              k, H, I, gated, activation};
    const P ps = shared ? P{x.data_ptr<float>(), shared_w13t->data_ptr<scalar_t>(), shared_w2t->data_ptr<scalar_t>(),
                            shared_weights.data_ptr<float>(), shared_order.data(), nullptr,
                            shared_y.data_ptr<float>(), 1, H, Is, gated, activation}
                        : p;
    auto run = [&](const P& problem, int64_t begin, int64_t end) {
      if (avx2)
        expert_units_avx2(problem, begin, end);
      else
        expert_units_baseline(problem, begin, end);
    };
    // Units 0..E-1 the routed experts, then the shared one's tokens in chunks of kSharedChunk (so with
    // several threads it is not one long task beside the routed experts).
    const int64_t chunks = shared ? (T + kSharedChunk - 1) / kSharedChunk : 0;
    at::parallel_for(0, E + chunks, 1, [&](int64_t begin, int64_t end) {
      if (begin < E) run(p, begin, std::min(end, E));
      for (int64_t c = std::max(begin, E) - E; c < end - E; ++c) {
        const int64_t first = c * kSharedChunk;
        const int64_t range[2] = {0, std::min(kSharedChunk, T - first)};
        P chunk = ps;
        chunk.by_expert = shared_order.data() + first;
        chunk.expert_start = range;
        run(chunk, 0, 1);
      }
    });
  });
  // Each token's k outputs summed in top-k order, then its shared expert's.
  auto out = at::empty({T, H}, x.options());
  const float* ys = y.data_ptr<float>();
  const float* ss = shared ? shared_y.data_ptr<float>() : nullptr;
  float* os = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* o = os + t * H;
    std::copy(ys + t * k * H, ys + (t * k + 1) * H, o);
    for (int64_t j = 1; j < k; ++j) {
      const float* yj = ys + (t * k + j) * H;
#pragma omp simd
      for (int64_t c = 0; c < H; ++c) o[c] += yj[c];
    }
    if (ss != nullptr) {
      const float* st = ss + t * H;
#pragma omp simd
      for (int64_t c = 0; c < H; ++c) o[c] += st[c];
    }
  }
  return out;
}

}  // namespace
}  // namespace sgl_moe

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "moe_experts(Tensor x, Tensor w13t, Tensor w2t, Tensor topk_weights, Tensor topk_ids, bool gated, "
      "int activation, Tensor? shared_w13t=None, Tensor? shared_w2t=None, Tensor? shared_gate=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) { m.impl("moe_experts", &sgl_moe::moe_experts); }
