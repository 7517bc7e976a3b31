// CPU ops of the linear-attention layers, registered as torch.ops.sgl_kernel.*. Decode (one token per
// request):
//
//   causal_conv1d_update  the depthwise conv of the linear-attention layers over the pool's conv state,
//                         read and shifted in place through the batch's slots; returns silu(conv).
//   gdn_decode            the Gated DeltaNet step on the pool's SSM state in place: q/k l2-norm, q scale,
//                         key heads shared by consecutive value heads, gated delta update, S q.
//   mamba2_decode         the Mamba2 selective state update on the pool's SSM state in place, D skip.
//   mamba2_mixer_decode   Mamba2's gating, conv update and state update in one call (Nemotron-H's mixer),
//                         straight from the input projection's slices.
// Extend (a variable-length batch in one call, with the snapshots the prefix cache asks for):
//   causal_conv1d_extend, gdn_extend, mamba2_extend (below).
//
// They replace ~30 small torch ops per layer (and the gather/scatter copies of whole states), or a
// Python loop over an extend's requests, with one call. The decode ops do the torch steps' arithmetic in
// float32; the extend ops run the same recurrence token by token where the torch path uses the chunked
// form; both agree with the torch path to float32 rounding. State pools may be float32, bfloat16 or float16 (a layer's view: slot-major,
// contiguous per slot); the other inputs are float32 (the backends pass them so). Work is split over
// (request, head) pairs with at::parallel_for, so torch's thread setting applies. The torch twins are
// in python/sglang/srt/layers/attention/ and test/unit/kernels/test_cpu_linear_ops.py compares them.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace sgl_linear {
namespace {

using sgl_cpu::fast_exp;
using sgl_cpu::silu;

// Serial below this many (request, head) units: waking another thread costs more than it saves.
constexpr int64_t kGrain = 16;

void check_slot_values(const int64_t* slots, int64_t n, int64_t num_slots, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, what, ": slot ", slots[i], " is outside the pool");
}

void check_slots(const at::Tensor& slots, int64_t bs, const at::Tensor& pool, const char* what) {
  TORCH_CHECK(slots.dtype() == at::kLong && slots.dim() == 1 && slots.size(0) == bs && slots.is_contiguous(),
              what, ": slots must be an int64 vector of one entry per request");
  TORCH_CHECK(pool.is_contiguous(), what, ": the pool's layer view must be contiguous");
  check_slot_values(slots.data_ptr<int64_t>(), bs, pool.size(0), what);
}

void check_f32(const at::Tensor& t, const char* what, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), what, ": ", name,
              " must be a contiguous float32 tensor");
}

// The inputs of a Mamba2 state update (decode or extend): xbc, dt, A and D as contiguous float32.
void check_mamba2_f32(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& D,
                      const char* what) {
  check_f32(xbc, what, "xbc");
  check_f32(dt, what, "dt");
  check_f32(A, what, "A");
  check_f32(D, what, "D");
}

// The conv weight [channels, width], an optional bias [channels] and the pool's conv state [slots, channels,
// width - 1] that `bs` rows of `channels` update through `slots`. Returns the bias data, or null.
const float* check_conv(const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const at::Tensor& conv_state,
                        const at::Tensor& slots, int64_t bs, int64_t channels, const char* what) {
  check_f32(weight, what, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == channels && weight.size(1) >= 1, what,
              ": weight must be [channels, width]");
  check_slots(slots, bs, conv_state, what);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == channels && conv_state.size(2) == weight.size(1) - 1,
              what, ": conv_state must be [slots, channels, width - 1]");
  if (!bias.has_value()) return nullptr;
  check_f32(*bias, what, "bias");
  TORCH_CHECK(bias->numel() == channels, what, ": bias needs one value per channel");
  return bias->data_ptr<float>();
}

// A Mamba2 state update's sizes: xbc rows of heads*head_dim + 2*groups*state_size, dt [bs, heads], D one
// value per head, the pool's SSM state [slots, heads, head_dim, state_size] through `slots`.
void check_mamba2_step(int64_t bs, int64_t xbc_width, const at::Tensor& dt, const at::Tensor& D, const at::Tensor& ssm,
                       const at::Tensor& slots, int64_t heads, int64_t head_dim, int64_t groups, int64_t state_size,
                       const char* what) {
  TORCH_CHECK(heads > 0 && groups > 0 && heads % groups == 0 &&
                  xbc_width == heads * head_dim + 2 * groups * state_size,
              what, ": xbc must be [bs, heads*head_dim + 2*groups*state_size]");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == bs && dt.size(1) == heads, what, ": dt must be [bs, heads]");
  TORCH_CHECK(D.numel() == heads, what, ": D needs one value per head");
  check_slots(slots, bs, ssm, what);
  TORCH_CHECK(ssm.dim() == 4 && ssm.size(1) == heads && ssm.size(2) == head_dim && ssm.size(3) == state_size,
              what, ": ssm must be [slots, heads, head_dim, state_size]");
}

// The decode steps read and write each request's (head's) state once, wherever its slot is: the next
// one is asked for while this one is updated (its first kStatePrefetchBytes; the hardware follows).
constexpr int64_t kStatePrefetchBytes = 1024;

template <typename S>
inline __attribute__((always_inline)) void prefetch_state(const S* st, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(st);
  const int64_t bytes = std::min<int64_t>(elements * static_cast<int64_t>(sizeof(S)), kStatePrefetchBytes);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 1, 3);
}

// Requests [begin, end) of the conv update. kKeep > 0 is the state's columns (width - 1) as a constant
// (the inner loops unroll and GCC vectorises across channels), 0 reads `keep`. Always inlined, so each
// caller below compiles it for its own instruction set.
template <typename S, int kKeep>
inline __attribute__((always_inline)) void conv_update_rows(const float* x, int64_t x_stride, S* state,
                                                            const int64_t* slots, const float* w,
                                                            const float* bias, float* out, int64_t begin,
                                                            int64_t end, int64_t channels, int64_t keep_arg) {
  const int64_t keep = kKeep > 0 ? kKeep : keep_arg, width = keep + 1;
  for (int64_t b = begin; b < end; ++b) {
    S* st = state + slots[b] * channels * keep;
    if (b + 1 < end) prefetch_state(state + slots[b + 1] * channels * keep, channels * keep);
    const float* xb = x + b * x_stride;
    float* ob = out + b * channels;
    for (int64_t c = 0; c < channels; ++c) {
      S* row = st + c * keep;
      const float* wc = w + c * width;
      float acc = 0.0f;
      for (int64_t j = 0; j < keep; ++j) acc += static_cast<float>(row[j]) * wc[j];
      acc += xb[c] * wc[keep];
      if (bias != nullptr) acc += bias[c];
      ob[c] = acc;
      for (int64_t j = 0; j + 1 < keep; ++j) row[j] = row[j + 1];
      if (keep > 0) row[keep - 1] = static_cast<S>(xb[c]);
    }
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) ob[c] = silu(ob[c]);
  }
}

// x: bs rows of `channels` floats, `x_stride` apart (a slice of the input projection is fine).
template <typename S>
void conv_update_impl(const float* x, int64_t x_stride, S* state, const int64_t* slots, const float* w,
                      const float* bias, float* out, int64_t bs, int64_t channels, int64_t width) {
  const int64_t keep = width - 1;  // state columns per channel
  const bool avx2 = sgl_cpu::has_avx2();
  at::parallel_for(0, bs, std::max<int64_t>(1, kGrain * 64 / std::max<int64_t>(channels, 1)),
                   [&](int64_t begin, int64_t end) {
    // Width 4 (both presets' and the released models' convs) as a constant; any other as a variable.
    if (keep == 3)
      sgl_cpu::run_twin<conv_update_rows<S, 3>>(avx2, x, x_stride, state, slots, w, bias, out, begin, end,
                                                channels, keep);
    else
      sgl_cpu::run_twin<conv_update_rows<S, 0>>(avx2, x, x_stride, state, slots, w, bias, out, begin, end,
                                                channels, keep);
  });
}

// The conv update for arguments `check_conv` passed: x's bs rows of `channels` floats, `x_stride` apart.
at::Tensor conv_update_checked(const at::Tensor& x, int64_t x_stride, at::Tensor& conv_state, const at::Tensor& slots,
                               const at::Tensor& weight, const float* bias) {
  const int64_t bs = x.size(0), channels = x.size(1), width = weight.size(1);
  auto out = at::empty({bs, channels}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, conv_state.scalar_type(), "sgl_kernel_decode", [&] {
    conv_update_impl<scalar_t>(x.data_ptr<float>(), x_stride, conv_state.data_ptr<scalar_t>(),
                               slots.data_ptr<int64_t>(), weight.data_ptr<float>(), bias, out.data_ptr<float>(), bs,
                               channels, width);
  });
  return out;
}

at::Tensor causal_conv1d_update(const at::Tensor& x, at::Tensor conv_state, const at::Tensor& slots,
                                const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const char* what = "causal_conv1d_update";
  check_f32(x, what, "x");
  TORCH_CHECK(x.dim() == 2, what, ": x must be [bs, channels]");
  const int64_t bs = x.size(0), channels = x.size(1);
  return conv_update_checked(x, channels, conv_state, slots, weight,
                             check_conv(weight, bias, conv_state, slots, bs, channels, what));
}

// Calls f(std::integral_constant<int, K>()) with K = n for the state rows the models use (16, 32 for the
// demo model, 64, 128), so loops over a row unroll and vectorise with a constant length, else with K = 0
// (the length read at run time).
template <typename F>
inline void with_row_length(int64_t n, F&& f) {
  switch (n) {
    case 16: return f(std::integral_constant<int, 16>());
    case 32: return f(std::integral_constant<int, 32>());
    case 64: return f(std::integral_constant<int, 64>());
    case 128: return f(std::integral_constant<int, 128>());
    default: return f(std::integral_constant<int, 0>());
  }
}

inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline __attribute__((always_inline)) void l2norm_into(const float* x, float* out, int64_t n, float scale) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) + 1e-6f) * scale;
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
}

template <typename S>
struct GdnStep {
  const float *qkv, *g, *beta;
  S* ssm;
  const int64_t* slots;
  float* out;
  int64_t hk, hv, dk, dv;
};

// (request, value head) units [begin, end); kDk > 0 is the key dim as a constant. `scratch`: 3 * dk floats.
// Always inlined, so each caller below compiles it for its own instruction set.
template <typename S, int kDk>
inline __attribute__((always_inline)) void gdn_units(const GdnStep<S>* step, int64_t begin, int64_t end,
                                                     float* scratch) {
  const GdnStep<S>& a = *step;
  const int64_t dk = kDk > 0 ? kDk : a.dk, hk = a.hk, hv = a.hv, dv = a.dv;
  const int64_t stride = 2 * hk * dk + hv * dv, ratio = hv / hk;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  float *q = scratch, *k = scratch + dk, *row = scratch + 2 * dk;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t b = u / hv, h = u % hv, kh = h / ratio;
    const float* base = a.qkv + b * stride;
    l2norm_into(base + kh * dk, q, dk, q_scale);
    l2norm_into(base + hk * dk + kh * dk, k, dk, 1.0f);
    const float* v = base + 2 * hk * dk + h * dv;
    const float decay = std::exp(a.g[u]), bt = a.beta[u];
    S* st = a.ssm + (a.slots[b] * hv + h) * dv * dk;
    if (u + 1 < end) prefetch_state(a.ssm + (a.slots[(u + 1) / hv] * hv + (u + 1) % hv) * dv * dk, dv * dk);
    float* o = a.out + u * dv;
    for (int64_t i = 0; i < dv; ++i) {
      S* srow = st + i * dk;
#pragma omp simd
      for (int64_t j = 0; j < dk; ++j) row[j] = static_cast<float>(srow[j]) * decay;
      const float delta = (v[i] - dot(row, k, dk)) * bt;
#pragma omp simd
      for (int64_t j = 0; j < dk; ++j) row[j] += delta * k[j];
      o[i] = dot(row, q, dk);
#pragma omp simd
      for (int64_t j = 0; j < dk; ++j) srow[j] = static_cast<S>(row[j]);
    }
  }
}

template <typename S>
void gdn_impl(const GdnStep<S>& a, int64_t bs) {
  const bool avx2 = sgl_cpu::has_avx2();
  at::parallel_for(0, bs * a.hv, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * a.dk);
    with_row_length(a.dk, [&](auto kDk) {
      sgl_cpu::run_twin<gdn_units<S, decltype(kDk)::value>>(avx2, &a, begin, end, scratch.data());
    });
  });
}

at::Tensor gdn_decode(const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta, at::Tensor ssm,
                      const at::Tensor& slots, int64_t hk, int64_t hv, int64_t dk, int64_t dv) {
  const char* what = "gdn_decode";
  check_f32(qkv, what, "qkv");
  check_f32(g, what, "g");
  check_f32(beta, what, "beta");
  const int64_t bs = qkv.size(0);
  check_slots(slots, bs, ssm, what);
  TORCH_CHECK(hv % hk == 0 && qkv.size(1) == 2 * hk * dk + hv * dv, what, ": qkv must be [bs, 2*hk*dk + hv*dv]");
  TORCH_CHECK(ssm.dim() == 4 && ssm.size(1) == hv && ssm.size(2) == dv && ssm.size(3) == dk, what,
              ": ssm must be [slots, hv, dv, dk]");
  auto out = at::empty({bs, hv, dv}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ssm.scalar_type(), "sgl_kernel_decode", [&] {
    const GdnStep<scalar_t> a{qkv.data_ptr<float>(), g.data_ptr<float>(), beta.data_ptr<float>(),
                              ssm.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), out.data_ptr<float>(),
                              hk, hv, dk, dv};
    gdn_impl(a, bs);
  });
  return out;
}

template <typename S>
struct Mamba2Step {
  const float *xbc, *dt, *A, *D;
  S* ssm;
  const int64_t* slots;
  float* y;
  int64_t heads, p, groups, n;
};

// (request, head) units [begin, end); kN > 0 is the state size as a constant. `row`: n floats. Always
// inlined, so each caller below compiles it for its own instruction set.
template <typename S, int kN>
inline __attribute__((always_inline)) void mamba2_units(const Mamba2Step<S>* step, int64_t begin,
                                                        int64_t end, float* row) {
  const Mamba2Step<S>& a = *step;
  const int64_t n = kN > 0 ? kN : a.n, heads = a.heads, p = a.p, groups = a.groups;
  const int64_t stride = heads * p + 2 * groups * n, per_group = heads / groups;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t b = u / heads, h = u % heads, grp = h / per_group;
    const float* base = a.xbc + b * stride;
    const float* x = base + h * p;
    const float* B = base + heads * p + grp * n;
    const float* C = base + heads * p + groups * n + grp * n;
    const float step = a.dt[u], decay = std::exp(step * a.A[h]);
    S* st = a.ssm + (a.slots[b] * heads + h) * p * n;
    if (u + 1 < end) prefetch_state(a.ssm + (a.slots[(u + 1) / heads] * heads + (u + 1) % heads) * p * n, p * n);
    float* yo = a.y + u * p;
    for (int64_t i = 0; i < p; ++i) {
      S* srow = st + i * n;
      const float dx = step * x[i];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] = static_cast<float>(srow[j]) * decay + dx * B[j];
      yo[i] = dot(row, C, n) + a.D[h] * x[i];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) srow[j] = static_cast<S>(row[j]);
    }
  }
}

template <typename S>
void mamba2_impl(const Mamba2Step<S>& a, int64_t bs) {
  const bool avx2 = sgl_cpu::has_avx2();
  at::parallel_for(0, bs * a.heads, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(a.n);
    with_row_length(a.n, [&](auto kN) {
      sgl_cpu::run_twin<mamba2_units<S, decltype(kN)::value>>(avx2, &a, begin, end, row.data());
    });
  });
}

// The Mamba2 state update for arguments `check_mamba2_step` passed (xbc, dt, A and D contiguous).
at::Tensor mamba2_decode_checked(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& D,
                                 at::Tensor& ssm, const at::Tensor& slots, int64_t heads, int64_t head_dim,
                                 int64_t groups, int64_t state_size) {
  const int64_t bs = xbc.size(0);
  auto y = at::empty({bs, heads, head_dim}, xbc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ssm.scalar_type(), "sgl_kernel_decode", [&] {
    const Mamba2Step<scalar_t> a{xbc.data_ptr<float>(), dt.data_ptr<float>(), A.data_ptr<float>(),
                                 D.data_ptr<float>(), ssm.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
                                 y.data_ptr<float>(), heads, head_dim, groups, state_size};
    mamba2_impl(a, bs);
  });
  return y;
}

at::Tensor mamba2_decode(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& D,
                         at::Tensor ssm, const at::Tensor& slots, int64_t heads, int64_t head_dim,
                         int64_t groups, int64_t state_size) {
  const char* what = "mamba2_decode";
  check_mamba2_f32(xbc, dt, A, D, what);
  TORCH_CHECK(xbc.dim() == 2, what, ": xbc must be [bs, heads*head_dim + 2*groups*state_size]");
  const int64_t bs = xbc.size(0);
  check_mamba2_step(bs, xbc.size(1), dt, D, ssm, slots, heads, head_dim, groups, state_size, what);
  TORCH_CHECK(A.numel() == heads, what, ": A needs one value per head");
  return mamba2_decode_checked(xbc, dt, A, D, ssm, slots, heads, head_dim, groups, state_size);
}


// ---- extend: a whole variable-length batch in one call ---------------------------------------------
//
// Sequence b covers tokens [cu_seqlens[b], cu_seqlens[b+1]) and starts from the state in slots[b], which
// receives its final state. Snapshots: entries [snap_ptr[b], snap_ptr[b+1]) of (snap_offset, snap_slot),
// sorted by offset, ask for the state after `offset` tokens of the sequence (1 <= offset <= length) in
// `snap_slot`. The recurrence runs token by token in float32 (the state is rounded to the pool's dtype
// only where stored), which for small heads does fewer operations than the chunked form: per token
// and head K*V against C*(K+V) (C = the chunk), so the backends take this path when K, V <= 64.

struct Extend {
  const int64_t* cu;         // [B + 1]
  const int64_t* slots;      // [B]
  const int64_t* snap_ptr;   // [B + 1]
  const int64_t* snap_off;   // [M]
  const int64_t* snap_slot;  // [M]
  int64_t batch;
};

// `rows`: the tokens of the inputs; `num_slots`: the pool's slots. Sequences must tile the rows in
// order, and snapshots sit inside their sequence (1 <= offset <= length, sorted).
Extend read_extend(const at::Tensor& cu, const at::Tensor& slots, const at::Tensor& snap_ptr,
                   const at::Tensor& snap_off, const at::Tensor& snap_slot, int64_t rows, int64_t num_slots,
                   const char* what) {
  for (const at::Tensor* t : {&cu, &slots, &snap_ptr, &snap_off, &snap_slot}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), what,
                ": cu_seqlens, slots and the snapshot tensors must be contiguous int64 vectors");
  }
  const int64_t batch = slots.size(0);
  TORCH_CHECK(cu.size(0) == batch + 1 && snap_ptr.size(0) == batch + 1 && snap_off.size(0) == snap_slot.size(0),
              what, ": cu_seqlens and snap_ptr need batch + 1 entries, the snapshot lists one length");
  const Extend e{cu.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), snap_ptr.data_ptr<int64_t>(),
                 snap_off.data_ptr<int64_t>(), snap_slot.data_ptr<int64_t>(), batch};
  const int64_t num_snaps = snap_off.size(0);
  TORCH_CHECK(e.cu[0] == 0 && e.cu[batch] == rows && e.snap_ptr[0] == 0 && e.snap_ptr[batch] == num_snaps, what,
              ": cu_seqlens must run from 0 to the number of tokens, snap_ptr from 0 to the number of snapshots");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = e.cu[b + 1] - e.cu[b];
    TORCH_CHECK(len >= 0 && e.snap_ptr[b + 1] >= e.snap_ptr[b], what, ": cu_seqlens and snap_ptr must not decrease");
    for (int64_t m = e.snap_ptr[b]; m < e.snap_ptr[b + 1]; ++m)
      TORCH_CHECK(e.snap_off[m] >= 1 && e.snap_off[m] <= len && (m == e.snap_ptr[b] || e.snap_off[m] >= e.snap_off[m - 1]),
                  what, ": snapshot offsets must lie in 1..length of their sequence, sorted");
  }
  check_slot_values(e.slots, batch, num_slots, what);
  check_slot_values(e.snap_slot, num_snaps, num_slots, what);
  return e;
}

// Sequences [begin, end) of a conv extend; `wt` is the weight transposed to [width, channels], so that every
// loop runs along channels; `head`: keep * channels floats. Always inlined, so each caller compiles it for
// its own instruction set.
template <typename S>
inline __attribute__((always_inline)) void conv_extend_rows(const float* x, S* state, const float* wt,
                                                            const float* bias, float* out, const Extend* extend,
                                                            int64_t channels, int64_t width, int64_t begin,
                                                            int64_t end, float* head) {
  const Extend& e = *extend;
  const int64_t keep = width - 1;
  for (int64_t b = begin; b < end; ++b) {
    const int64_t start = e.cu[b], len = e.cu[b + 1] - start;
    S* st = state + e.slots[b] * channels * keep;
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t j = 0; j < keep; ++j) head[j * channels + c] = static_cast<float>(st[c * keep + j]);
    // Row i of the window: the state's rows (the initial state as rows [keep, channels]), then the inputs.
    auto row = [&](int64_t i) { return i < keep ? head + i * channels : x + (start + i - keep) * channels; };
    for (int64_t t = 0; t < len; ++t) {
      float* o = out + (start + t) * channels;
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) o[c] = bias != nullptr ? bias[c] : 0.0f;
      for (int64_t j = 0; j < width; ++j) {
        const float* r = row(t + j);
        const float* wj = wt + j * channels;
#pragma omp simd
        for (int64_t c = 0; c < channels; ++c) o[c] += r[c] * wj[c];
      }
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) o[c] = silu(o[c]);
    }
    // Conv state after `off` tokens: window rows off .. off + keep - 1. The running slot last, since
    // the window's head rows were read from it.
    auto write = [&](S* dst, int64_t off) {
      for (int64_t j = 0; j < keep; ++j) {
        const float* r = row(off + j);
        for (int64_t c = 0; c < channels; ++c) dst[c * keep + j] = static_cast<S>(r[c]);
      }
    };
    for (int64_t m = e.snap_ptr[b]; m < e.snap_ptr[b + 1]; ++m)
      write(state + e.snap_slot[m] * channels * keep, e.snap_off[m]);
    write(st, len);
  }
}

template <typename S>
void conv_extend_impl(const float* x, S* state, const float* w, const float* bias, float* out, const Extend& e,
                      int64_t channels, int64_t width) {
  std::vector<float> wt(width * channels);
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < width; ++j) wt[j * channels + c] = w[c * width + j];
  const bool avx2 = sgl_cpu::has_avx2();
  at::parallel_for(0, e.batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> head((width - 1) * channels);
    sgl_cpu::run_twin<conv_extend_rows<S>>(avx2, x, state, wt.data(), bias, out, &e, channels, width, begin, end,
                                           head.data());
  });
}

at::Tensor causal_conv1d_extend(const at::Tensor& x, at::Tensor conv_state, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, const at::Tensor& cu, const at::Tensor& slots,
                                const at::Tensor& snap_ptr, const at::Tensor& snap_off, const at::Tensor& snap_slot) {
  const char* what = "causal_conv1d_extend";
  check_f32(x, what, "x");
  check_f32(weight, what, "weight");
  const Extend e = read_extend(cu, slots, snap_ptr, snap_off, snap_slot, x.size(0), conv_state.size(0), what);
  const int64_t channels = x.size(1), width = weight.size(1);
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.dim() == 3 && conv_state.size(1) == channels &&
                  conv_state.size(2) == width - 1,
              what, ": conv_state must be a contiguous [slots, channels, width - 1]");
  const float* b = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, what, "bias");
    b = bias->data_ptr<float>();
  }
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, conv_state.scalar_type(), "sgl_kernel_extend", [&] {
    conv_extend_impl<scalar_t>(x.data_ptr<float>(), conv_state.data_ptr<scalar_t>(), weight.data_ptr<float>(), b,
                               out.data_ptr<float>(), e, channels, width);
  });
  return out;
}

// The state of a head, [p, n] in the pool, as n rows of p in `st` (st[j * p + i] = state[i][j]) and back.
template <typename S>
inline __attribute__((always_inline)) void load_transposed(float* st, const S* src, int64_t p, int64_t n) {
  for (int64_t i = 0; i < p; ++i)
    for (int64_t j = 0; j < n; ++j) st[j * p + i] = static_cast<float>(src[i * n + j]);
}

template <typename S>
inline __attribute__((always_inline)) void store_transposed(S* dst, const float* st, int64_t p, int64_t n) {
  for (int64_t i = 0; i < p; ++i)
    for (int64_t j = 0; j < n; ++j) dst[i * n + j] = static_cast<S>(st[j * p + i]);
}

// The (sequence, head) units [begin, end) of an extend whose per-head state, [lanes, rows] in the pool, is held
// transposed in `st` (rows of lanes: load_transposed). Each unit loads it from its running slot, runs
// `token(h, tok)` over its tokens in order, stores it into each snapshot slot at its offset and last back into
// the running slot. Always inlined, as `token` must be, so each caller compiles both for its own instruction set.
template <typename S, typename Token>
inline __attribute__((always_inline)) void transposed_state_units(const Extend& e, S* ssm, int64_t heads,
                                                                  int64_t lanes, int64_t rows, int64_t begin,
                                                                  int64_t end, float* st, Token&& token) {
  const int64_t size = lanes * rows;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t b = u / heads, h = u % heads, start = e.cu[b], len = e.cu[b + 1] - start;
    S* running = ssm + (e.slots[b] * heads + h) * size;
    load_transposed(st, running, lanes, rows);
    int64_t m = e.snap_ptr[b];
    for (int64_t t = 0; t < len; ++t) {
      token(h, start + t);
      for (; m < e.snap_ptr[b + 1] && e.snap_off[m] == t + 1; ++m)
        store_transposed(ssm + (e.snap_slot[m] * heads + h) * size, st, lanes, rows);
    }
    store_transposed(running, st, lanes, rows);
  }
}

// block(kW, i0, w) over lanes [0, lanes): blocks of 16 with kW = 16 (a constant: the block's accumulators stay
// in registers), then the rest with kW = 0 and w < 16.
template <typename Block>
inline __attribute__((always_inline)) void for_lane_blocks(int64_t lanes, Block&& block) {
  constexpr int kLanes = 16;
  int64_t i0 = 0;
  for (; i0 + kLanes <= lanes; i0 += kLanes) block(std::integral_constant<int, kLanes>(), i0, kLanes);
  if (i0 < lanes) block(std::integral_constant<int, 0>(), i0, lanes - i0);
}

// One token of a GDN value head over value lanes [i0, i0 + w) of a transposed state (st[j * dv + i] =
// state[i][j]; kW > 0: w as a constant, whose accumulators stay in registers): the state decays, its read
// along k gives the delta of each value lane, the delta along k is added, and the read along q is the output.
// Both reads run along the value lanes with k[j] and q[j] broadcast: no horizontal sum per state row.
template <int kW>
inline __attribute__((always_inline)) void gdn_token_lanes(float* st, const float* q, const float* k, const float* v,
                                                           float decay, float bt, float* o, int64_t dv, int64_t dk,
                                                           int64_t i0, int64_t w_arg) {
  const int64_t w = kW > 0 ? kW : w_arg;
  float kv[kW > 0 ? kW : 16], delta[kW > 0 ? kW : 16], acc[kW > 0 ? kW : 16];
#pragma omp simd
  for (int64_t i = 0; i < w; ++i) kv[i] = 0.0f;
  for (int64_t j = 0; j < dk; ++j) {
    float* row = st + j * dv + i0;
    const float kj = k[j];
#pragma omp simd
    for (int64_t i = 0; i < w; ++i) {
      row[i] *= decay;
      kv[i] += row[i] * kj;
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < w; ++i) {
    delta[i] = (v[i0 + i] - kv[i]) * bt;
    acc[i] = 0.0f;
  }
  for (int64_t j = 0; j < dk; ++j) {
    float* row = st + j * dv + i0;
    const float kj = k[j], qj = q[j];
#pragma omp simd
    for (int64_t i = 0; i < w; ++i) {
      row[i] += kj * delta[i];
      acc[i] += row[i] * qj;
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < w; ++i) o[i0 + i] = acc[i];
}

// (sequence, value head) units [begin, end) of a GDN extend; kDk > 0 is the key dim as a constant (see
// with_row_length). `scratch`: 2 * dk + dv * dk floats, q, k and the state transposed (gdn_token_lanes: an
// extend of 16 x 256 tokens, 4 heads of 16 x 16, 2.0-2.4 -> 1.1-1.2 ms per layer). Always inlined, so each
// caller compiles it for its own instruction set.
template <typename S, int kDk>
inline __attribute__((always_inline)) void gdn_extend_units(const float* qkv, const float* g, const float* beta,
                                                            S* ssm, float* out, const Extend* extend, int64_t hk,
                                                            int64_t hv, int64_t dk_arg, int64_t dv, int64_t begin,
                                                            int64_t end, float* scratch) {
  const int64_t dk = kDk > 0 ? kDk : dk_arg;
  const int64_t stride = 2 * hk * dk + hv * dv, ratio = hv / hk;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  float *q = scratch, *k = scratch + dk, *st = scratch + 2 * dk;
  transposed_state_units(*extend, ssm, hv, dv, dk, begin, end, st,
                         [&](int64_t h, int64_t tok) __attribute__((always_inline)) {
    const int64_t kh = h / ratio;
    const float* base = qkv + tok * stride;
    l2norm_into(base + kh * dk, q, dk, q_scale);
    l2norm_into(base + hk * dk + kh * dk, k, dk, 1.0f);
    const float* v = base + 2 * hk * dk + h * dv;
    const float decay = std::exp(g[tok * hv + h]), bt = beta[tok * hv + h];
    float* o = out + (tok * hv + h) * dv;
    for_lane_blocks(dv, [&](auto kW, int64_t i0, int64_t w) __attribute__((always_inline)) {
      gdn_token_lanes<decltype(kW)::value>(st, q, k, v, decay, bt, o, dv, dk, i0, w);
    });
  });
}

template <typename S>
void gdn_extend_impl(const float* qkv, const float* g, const float* beta, S* ssm, float* out, const Extend& e,
                     int64_t hk, int64_t hv, int64_t dk, int64_t dv) {
  const bool avx2 = sgl_cpu::has_avx2();
  at::parallel_for(0, e.batch * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * dk + dv * dk);
    with_row_length(dk, [&](auto kDk) {
      constexpr int K = decltype(kDk)::value;
      sgl_cpu::run_twin<gdn_extend_units<S, K>>(avx2, qkv, g, beta, ssm, out, &e, hk, hv, dk, dv, begin, end,
                                                scratch.data());
    });
  });
}

at::Tensor gdn_extend(const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta, at::Tensor ssm,
                      const at::Tensor& cu, const at::Tensor& slots, const at::Tensor& snap_ptr,
                      const at::Tensor& snap_off, const at::Tensor& snap_slot, int64_t hk, int64_t hv, int64_t dk,
                      int64_t dv) {
  const char* what = "gdn_extend";
  check_f32(qkv, what, "qkv");
  check_f32(g, what, "g");
  check_f32(beta, what, "beta");
  const Extend e = read_extend(cu, slots, snap_ptr, snap_off, snap_slot, qkv.size(0), ssm.size(0), what);
  TORCH_CHECK(hv % hk == 0 && qkv.size(1) == 2 * hk * dk + hv * dv, what, ": qkv must be [T, 2*hk*dk + hv*dv]");
  TORCH_CHECK(ssm.is_contiguous() && ssm.dim() == 4 && ssm.size(1) == hv && ssm.size(2) == dv && ssm.size(3) == dk,
              what, ": ssm must be a contiguous [slots, hv, dv, dk]");
  auto out = at::empty({qkv.size(0), hv, dv}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ssm.scalar_type(), "sgl_kernel_extend", [&] {
    gdn_extend_impl<scalar_t>(qkv.data_ptr<float>(), g.data_ptr<float>(), beta.data_ptr<float>(),
                              ssm.data_ptr<scalar_t>(), out.data_ptr<float>(), e, hk, hv, dk, dv);
  });
  return out;
}

// One token of a head over head-dim lanes [i0, i0 + w) (kW > 0: w as a constant, whose accumulators stay in
// registers): state[i][j] = state[i][j] * decay + step * x[i] * B[j]; y[i] = sum_j state[i][j] * C[j] + D x[i].
template <int kW>
inline __attribute__((always_inline)) void mamba2_token_lanes(float* st, const float* x, const float* B,
                                                              const float* C, float step, float decay, float d,
                                                              float* yo, int64_t p, int64_t n, int64_t i0,
                                                              int64_t w_arg) {
  const int64_t w = kW > 0 ? kW : w_arg;
  float acc[kW > 0 ? kW : 16], dx[kW > 0 ? kW : 16];
#pragma omp simd
  for (int64_t i = 0; i < w; ++i) {
    dx[i] = step * x[i0 + i];
    acc[i] = d * x[i0 + i];
  }
  for (int64_t j = 0; j < n; ++j) {
    float* row = st + j * p + i0;
    const float bj = B[j], cj = C[j];
#pragma omp simd
    for (int64_t i = 0; i < w; ++i) {
      const float v = row[i] * decay + dx[i] * bj;
      row[i] = v;
      acc[i] += v * cj;
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < w; ++i) yo[i0 + i] = acc[i];
}

// (sequence, head) units [begin, end) of a Mamba2 extend; kN > 0 is the state size as a constant. `st`: p * n
// floats, the state transposed, so that the update and y both run along the head dim with B[j] and C[j]
// broadcast (mamba2_token_lanes: an extend of 16 x 256 tokens, 8 heads of 16 x 16, 4.2-4.5 -> 1.3-1.5 ms per
// layer). Always inlined, so each caller compiles it for its own instruction set.
template <typename S, int kN>
inline __attribute__((always_inline)) void mamba2_extend_units(const float* xbc, const float* dt, const float* A,
                                                               const float* D, S* ssm, float* y, const Extend* extend,
                                                               int64_t heads, int64_t p, int64_t groups,
                                                               int64_t n_arg, int64_t begin, int64_t end,
                                                               float* st) {
  const int64_t n = kN > 0 ? kN : n_arg;
  const int64_t stride = heads * p + 2 * groups * n, per_group = heads / groups;
  transposed_state_units(*extend, ssm, heads, p, n, begin, end, st,
                         [&](int64_t h, int64_t tok) __attribute__((always_inline)) {
    const int64_t grp = h / per_group;
    const float* base = xbc + tok * stride;
    const float* x = base + h * p;
    const float* B = base + heads * p + grp * n;
    const float* C = base + heads * p + groups * n + grp * n;
    const float step = dt[tok * heads + h], decay = std::exp(step * A[h]);
    float* yo = y + (tok * heads + h) * p;
    for_lane_blocks(p, [&](auto kW, int64_t i0, int64_t w) __attribute__((always_inline)) {
      mamba2_token_lanes<decltype(kW)::value>(st, x, B, C, step, decay, D[h], yo, p, n, i0, w);
    });
  });
}

template <typename S>
void mamba2_extend_impl(const float* xbc, const float* dt, const float* A, const float* D, S* ssm, float* y,
                        const Extend& e, int64_t heads, int64_t p, int64_t groups, int64_t n) {
  const bool avx2 = sgl_cpu::has_avx2();
  at::parallel_for(0, e.batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> st(p * n);
    with_row_length(n, [&](auto kN) {
      constexpr int K = decltype(kN)::value;
      sgl_cpu::run_twin<mamba2_extend_units<S, K>>(avx2, xbc, dt, A, D, ssm, y, &e, heads, p, groups, n, begin, end,
                                                   st.data());
    });
  });
}

at::Tensor mamba2_extend(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& D,
                         at::Tensor ssm, const at::Tensor& cu, const at::Tensor& slots, const at::Tensor& snap_ptr,
                         const at::Tensor& snap_off, const at::Tensor& snap_slot, int64_t heads, int64_t head_dim,
                         int64_t groups, int64_t state_size) {
  const char* what = "mamba2_extend";
  check_mamba2_f32(xbc, dt, A, D, what);
  const Extend e = read_extend(cu, slots, snap_ptr, snap_off, snap_slot, xbc.size(0), ssm.size(0), what);
  TORCH_CHECK(heads % groups == 0 && xbc.size(1) == heads * head_dim + 2 * groups * state_size, what,
              ": xbc must be [T, heads*head_dim + 2*groups*state_size]");
  TORCH_CHECK(ssm.is_contiguous() && ssm.dim() == 4 && ssm.size(1) == heads && ssm.size(2) == head_dim &&
                  ssm.size(3) == state_size,
              what, ": ssm must be a contiguous [slots, heads, head_dim, state_size]");
  auto y = at::empty({xbc.size(0), heads, head_dim}, xbc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ssm.scalar_type(), "sgl_kernel_extend", [&] {
    mamba2_extend_impl<scalar_t>(xbc.data_ptr<float>(), dt.data_ptr<float>(), A.data_ptr<float>(), D.data_ptr<float>(),
                                 ssm.data_ptr<scalar_t>(), y.data_ptr<float>(), e, heads, head_dim, groups, state_size);
  });
  return y;
}

// Gated DeltaNet's gates from the projections (Qwen3-Next), as the torch form computes them in float32:
// beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (softplus with torch's threshold of 20).
// a, b [T, Hv] (strided rows allowed: they are slices of one projection), A_log, dt_bias [Hv].
std::tuple<at::Tensor, at::Tensor> gdn_gating(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                                              const at::Tensor& dt_bias) {
  const char* what = "gdn_gating";
  for (const at::Tensor* t : {&a, &b})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->stride(1) == 1, what,
                ": a and b must be float32 [tokens, heads] tensors with contiguous rows");
  TORCH_CHECK(a.sizes() == b.sizes(), what, ": a and b must have one shape");
  const int64_t tokens = a.size(0), heads = a.size(1);
  check_f32(A_log, what, "A_log");
  check_f32(dt_bias, what, "dt_bias");
  TORCH_CHECK(A_log.numel() == heads && dt_bias.numel() == heads, what, ": A_log and dt_bias need one value per head");
  auto g = at::empty({tokens, heads}, a.options());
  auto beta = at::empty({tokens, heads}, a.options());
  const float *as = a.data_ptr<float>(), *bs = b.data_ptr<float>();
  const float *al = A_log.data_ptr<float>(), *dt = dt_bias.data_ptr<float>();
  float *gs = g.data_ptr<float>(), *betas = beta.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const float x = as[t * a.stride(0) + h] + dt[h];
      const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
      gs[t * heads + h] = -std::exp(al[h]) * softplus;
      betas[t * heads + h] = 1.0f / (1.0f + std::exp(-bs[t * b.stride(0) + h]));
    }
  return {g, beta};
}

void check_mamba2_gating(const at::Tensor& dt, const at::Tensor& dt_bias, const at::Tensor& A_log,
                         const char* what) {
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.dim() == 2 && dt.stride(1) == 1, what,
              ": dt must be a float32 [tokens, heads] tensor with contiguous rows");
  check_f32(dt_bias, what, "dt_bias");
  check_f32(A_log, what, "A_log");
  TORCH_CHECK(dt_bias.numel() == dt.size(1) && A_log.numel() == dt.size(1), what,
              ": dt_bias and A_log need one value per head");
}

// dt = max(softplus(dt + dt_bias), time_step_min) into os [tokens, heads] and A = -exp(A_log) into as
// [heads], for arguments `check_mamba2_gating` passed (see `mamba2_gating`).
void mamba2_gating_into(const at::Tensor& dt, const at::Tensor& dt_bias, const at::Tensor& A_log,
                        double time_step_min, float* os, float* as) {
  const int64_t tokens = dt.size(0), heads = dt.size(1);
  const float *ds = dt.data_ptr<float>(), *bias = dt_bias.data_ptr<float>(), *al = A_log.data_ptr<float>();
  const float floor = static_cast<float>(time_step_min);
  for (int64_t h = 0; h < heads; ++h) as[h] = -std::exp(al[h]);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const float x = ds[t * dt.stride(0) + h] + bias[h];
      const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
      os[t * heads + h] = std::max(softplus, floor);
    }
}

// Mamba2's time step and decay rate, as the torch form computes them in float32 (Nemotron-H):
// dt = max(softplus(dt + dt_bias), time_step_min) (softplus with torch's threshold of 20) and A = -exp(A_log).
// dt [T, H] (strided rows allowed: a slice of the input projection), dt_bias and A_log [H].
std::tuple<at::Tensor, at::Tensor> mamba2_gating(const at::Tensor& dt, const at::Tensor& dt_bias,
                                                 const at::Tensor& A_log, double time_step_min) {
  check_mamba2_gating(dt, dt_bias, A_log, "mamba2_gating");
  auto out = at::empty({dt.size(0), dt.size(1)}, dt.options());
  auto A = at::empty({dt.size(1)}, dt.options());
  mamba2_gating_into(dt, dt_bias, A_log, time_step_min, out.data_ptr<float>(), A.data_ptr<float>());
  return {out, A};
}

// Mamba2's whole decode step after the input projection in one call (Nemotron-H's mixer on CPU): the time
// step and decay (`mamba2_gating`), the conv update of the pooled conv state (`causal_conv1d_update`) and
// the selective state update (`mamba2_decode`), each computed as that op computes it, so the results are the
// three calls' bit for bit. xBC and dt may be slices of the input projection (rows apart, contiguous
// within); weight, bias and D are float32. Returns y [bs, heads, head_dim].
at::Tensor mamba2_mixer_decode(const at::Tensor& xBC, const at::Tensor& dt, const at::Tensor& dt_bias,
                               const at::Tensor& A_log, const at::Tensor& D, double time_step_min,
                               at::Tensor conv_state, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               at::Tensor ssm, const at::Tensor& slots, int64_t heads, int64_t head_dim,
                               int64_t groups, int64_t state_size) {
  const char* what = "mamba2_mixer_decode";
  TORCH_CHECK(xBC.scalar_type() == at::kFloat && xBC.dim() == 2 && xBC.stride(1) == 1, what,
              ": xBC must be a float32 [bs, channels] tensor with contiguous rows");
  check_f32(D, what, "D");
  check_mamba2_gating(dt, dt_bias, A_log, what);
  const int64_t bs = xBC.size(0), channels = xBC.size(1);
  check_mamba2_step(bs, channels, dt, D, ssm, slots, heads, head_dim, groups, state_size, what);
  const float* b = check_conv(weight, bias, conv_state, slots, bs, channels, what);
  auto step = at::empty({bs, heads}, xBC.options());
  auto A = at::empty({heads}, xBC.options());
  mamba2_gating_into(dt, dt_bias, A_log, time_step_min, step.data_ptr<float>(), A.data_ptr<float>());
  const auto xbc = conv_update_checked(xBC, xBC.stride(0), conv_state, slots, weight, b);
  return mamba2_decode_checked(xbc, step, A, D, ssm, slots, heads, head_dim, groups, state_size);
}

}  // namespace
}  // namespace sgl_linear

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor slots, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "gdn_decode(Tensor qkv, Tensor g, Tensor beta, Tensor(a!) ssm, Tensor slots, int hk, int hv, int dk, int dv) "
      "-> Tensor");
  m.def(
      "mamba2_decode(Tensor xbc, Tensor dt, Tensor A, Tensor D, Tensor(a!) ssm, Tensor slots, int heads, "
      "int head_dim, int groups, int state_size) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "causal_conv1d_extend(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor cu_seqlens, "
      "Tensor slots, Tensor snap_ptr, Tensor snap_offset, Tensor snap_slot) -> Tensor");
  m.def(
      "gdn_extend(Tensor qkv, Tensor g, Tensor beta, Tensor(a!) ssm, Tensor cu_seqlens, Tensor slots, "
      "Tensor snap_ptr, Tensor snap_offset, Tensor snap_slot, int hk, int hv, int dk, int dv) -> Tensor");
  m.def(
      "mamba2_extend(Tensor xbc, Tensor dt, Tensor A, Tensor D, Tensor(a!) ssm, Tensor cu_seqlens, Tensor slots, "
      "Tensor snap_ptr, Tensor snap_offset, Tensor snap_slot, int heads, int head_dim, int groups, "
      "int state_size) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("gdn_gating(Tensor a, Tensor b, Tensor A_log, Tensor dt_bias) -> (Tensor, Tensor)");
  m.def("mamba2_gating(Tensor dt, Tensor dt_bias, Tensor A_log, float time_step_min) -> (Tensor, Tensor)");
  m.def(
      "mamba2_mixer_decode(Tensor xBC, Tensor dt, Tensor dt_bias, Tensor A_log, Tensor D, float time_step_min, "
      "Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor(b!) ssm, Tensor slots, int heads, int head_dim, "
      "int groups, int state_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  m.impl("gdn_gating", &sgl_linear::gdn_gating);
  m.impl("mamba2_gating", &sgl_linear::mamba2_gating);
  m.impl("causal_conv1d_extend", &sgl_linear::causal_conv1d_extend);
  m.impl("gdn_extend", &sgl_linear::gdn_extend);
  m.impl("mamba2_extend", &sgl_linear::mamba2_extend);
  m.impl("causal_conv1d_update", &sgl_linear::causal_conv1d_update);
  m.impl("gdn_decode", &sgl_linear::gdn_decode);
  m.impl("mamba2_decode", &sgl_linear::mamba2_decode);
  m.impl("mamba2_mixer_decode", &sgl_linear::mamba2_mixer_decode);
}
