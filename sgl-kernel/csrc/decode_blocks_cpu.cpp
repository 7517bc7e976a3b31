// Whole decoder blocks of the hybrid models for a CPU decode step, each `hidden + f(rmsnorm(hidden))` in one
// call, registered as torch.ops.sgl_kernel.*:
//
//   gdn_block_decode(hidden, norm_w, norm_eps, norm_offset, w_qkvz, w_ba, conv_state, conv_w, ssm, slots,
//                    A_log, dt_bias, out_norm_w, out_norm_eps, w_out, hk, hv, dk, dv) -> hidden'
//       Qwen3-Next's Gated DeltaNet block: the input norm, the two input projections (rows grouped as
//       [q | k | v | z] and [b | a]), the conv update of the pooled conv state, the gates, the state update
//       in place on the pool, the gated output norm, the output projection and the residual add;
//   mamba2_block_decode(hidden, norm_w, norm_eps, w_in, b_in, conv_state, conv_w, conv_b, ssm, slots, dt_bias,
//                       A_log, D, time_step_min, out_norm_w, out_norm_eps, group_size, w_out, b_out, heads,
//                       head_dim, groups, state_size) -> hidden'
//       Nemotron-H's Mamba2 block: the norm, the input projection ([gate | xBC | dt]), `mamba2_mixer_decode`,
//       the grouped gated norm, the output projection and the residual add;
//   moe_block_decode(hidden, norm_w, norm_eps, norm_offset, router_w, correction_bias, top_k, renormalize,
//                    num_groups, topk_groups, scaling, w13t, w2t, gated, activation, shared_w13t, shared_w2t,
//                    shared_gate) -> hidden'
//       a MoE block: the norm, the router GEMM, the top-k (`topk_softmax`, or `biased_grouped_topk` where a
//       correction bias is given), the routed experts with the shared expert (`moe_experts`) and the residual
//       add.
//   attention_block_decode(hidden, norm_w, norm_eps, norm_offset, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b,
//                          q_norm_w, k_norm_w, qk_eps, qk_offset, positions, inv_freq, rotary_dim, k_buffer,
//                          v_buffer, loc, req_to_token, req_pool_indices, seq_lens, scale, heads, kv_heads,
//                          head_dim, output_gate) -> hidden'
//       a full-attention block: the norm, the q/k/v projections, Qwen3-Next's q/k norms, rotary embedding
//       and per-head output gate where given, the new token's K and V into the pool at `loc`,
//       `decode_attention` over the pool in place, the output projection and the residual add;
//   mlp_block_decode(hidden, norm_w, norm_eps, norm_offset, gate_w, gate_b, up_w, up_b, down_w, down_b,
//                    activation) -> hidden'
//       a dense MLP block (gated where gate_w is given; Nemotron-H's relu2 MLP is not).
//
// Each is the composition of the per-op path, called from C++: the same sgl-kernel ops (through the
// dispatcher, typed as their kernels are declared: the pool states they write by value), at::linear for the projections (what torch.nn.functional.linear runs) and at::add for the
// residual, on the same tensors, so a block's result equals the one-by-one path's bit for bit. What it
// saves is the Python between those ~15-25 calls per block: at the tiny presets' decode sizes (16 requests,
// hidden 64) each call from Python costs 10-30 us in place, several times its own work. float32 only (the
// dtype of the C++ ops); the Python side (`python/sglang/srt/layers/decode_blocks.py`) calls a block only
// where every part would take its C++ op. Tests: test/unit/kernels/test_cpu_decode_blocks.py.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <tuple>
#include <utility>

namespace sgl_blocks {
namespace {

using T = at::Tensor;
using OptT = c10::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

T rmsnorm(const T& x, const T& w, double eps, double offset) {
  static const auto op = find_op<T(const T&, const T&, double, double)>("sgl_kernel::rmsnorm");
  return op.call(x, w, eps, offset);
}

T gated_rmsnorm(const T& x, const T& gate, const T& w, double eps, int64_t group_size, bool gate_first) {
  static const auto op =
      find_op<T(const T&, const T&, const T&, double, int64_t, bool)>("sgl_kernel::gated_rmsnorm");
  return op.call(x, gate, w, eps, group_size, gate_first);
}

void check_hidden(const T& hidden, const char* what) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(), what,
              ": hidden must be a contiguous float32 [bs, hidden_size] tensor");
}

T gdn_block_decode(const T& hidden, const T& norm_w, double norm_eps, double norm_offset, const T& w_qkvz,
                   const T& w_ba, const T& conv_state, const T& conv_w, const T& ssm, const T& slots, const T& A_log,
                   const T& dt_bias, const T& out_norm_w, double out_norm_eps, const T& w_out, int64_t hk, int64_t hv,
                   int64_t dk, int64_t dv) {
  const char* what = "gdn_block_decode";
  check_hidden(hidden, what);
  const int64_t bs = hidden.size(0), qkv_dim = 2 * hk * dk + hv * dv;
  TORCH_CHECK(w_qkvz.dim() == 2 && w_qkvz.size(0) == qkv_dim + hv * dv && w_ba.dim() == 2 && w_ba.size(0) == 2 * hv,
              what, ": w_qkvz must have 2*hk*dk + 2*hv*dv rows and w_ba 2*hv");
  static const auto conv_op = find_op<T(const T&, T, const T&, const T&, const OptT&)>(
      "sgl_kernel::causal_conv1d_update");
  static const auto gating_op =
      find_op<std::tuple<T, T>(const T&, const T&, const T&, const T&)>("sgl_kernel::gdn_gating");
  static const auto gdn_op =
      find_op<T(const T&, const T&, const T&, T, const T&, int64_t, int64_t, int64_t, int64_t)>("sgl_kernel::gdn_decode");
  const T x = rmsnorm(hidden, norm_w, norm_eps, norm_offset);
  const T qkvz = at::linear(x, w_qkvz), ba = at::linear(x, w_ba);
  const T conv = conv_op.call(qkvz.narrow(1, 0, qkv_dim).contiguous(), conv_state, slots, conv_w, c10::nullopt);
  const auto [g, beta] = gating_op.call(ba.narrow(1, hv, hv), ba.narrow(1, 0, hv), A_log, dt_bias);
  const T core = gdn_op.call(conv, g, beta, ssm, slots, hk, hv, dk, dv);
  const T z = qkvz.narrow(1, qkv_dim, hv * dv).contiguous().view({bs, hv, dv});
  const T normed = gated_rmsnorm(core, z, out_norm_w, out_norm_eps, dv, false);
  return at::add(hidden, at::linear(normed.view({bs, hv * dv}), w_out));
}

T mamba2_block_decode(const T& hidden, const T& norm_w, double norm_eps, const T& w_in, const OptT& b_in,
                      const T& conv_state, const T& conv_w, const OptT& conv_b, const T& ssm, const T& slots,
                      const T& dt_bias, const T& A_log, const T& D, double time_step_min, const T& out_norm_w,
                      double out_norm_eps, int64_t group_size, const T& w_out, const OptT& b_out, int64_t heads,
                      int64_t head_dim, int64_t groups, int64_t state_size) {
  const char* what = "mamba2_block_decode";
  check_hidden(hidden, what);
  const int64_t bs = hidden.size(0), inner = heads * head_dim, conv_dim = inner + 2 * groups * state_size;
  TORCH_CHECK(w_in.dim() == 2 && w_in.size(0) == inner + conv_dim + heads, what,
              ": w_in must have heads*head_dim + conv channels + heads rows");
  static const auto mixer_op =
      find_op<T(const T&, const T&, const T&, const T&, const T&, double, T, const T&, const OptT&, T, const T&, int64_t,
                int64_t, int64_t, int64_t)>("sgl_kernel::mamba2_mixer_decode");
  const T proj = at::linear(rmsnorm(hidden, norm_w, norm_eps, 0.0), w_in, b_in);
  const T y = mixer_op.call(proj.narrow(1, inner, conv_dim), proj.narrow(1, inner + conv_dim, heads), dt_bias, A_log,
                            D, time_step_min, conv_state, conv_w, conv_b, ssm, slots, heads, head_dim, groups,
                            state_size);
  const T gate = proj.narrow(1, 0, inner).contiguous();
  const T normed = gated_rmsnorm(y.view({bs, inner}), gate, out_norm_w, out_norm_eps, group_size, true);
  return at::add(hidden, at::linear(normed, w_out, b_out));
}

T moe_block_decode(const T& hidden, const T& norm_w, double norm_eps, double norm_offset, const T& router_w,
                   const OptT& correction_bias, int64_t top_k, bool renormalize, int64_t num_groups,
                   int64_t topk_groups, double scaling, const T& w13t, const T& w2t, bool gated, int64_t activation,
                   const OptT& shared_w13t, const OptT& shared_w2t, const OptT& shared_gate) {
  check_hidden(hidden, "moe_block_decode");
  static const auto softmax_op =
      find_op<std::tuple<T, T>(const T&, int64_t, bool)>("sgl_kernel::topk_softmax");
  static const auto grouped_op = find_op<std::tuple<T, T>(const T&, const T&, int64_t, int64_t, int64_t, bool,
                                                          double)>("sgl_kernel::biased_grouped_topk");
  static const auto experts_op = find_op<T(const T&, const T&, const T&, const T&, const T&, bool, int64_t,
                                           const OptT&, const OptT&, const OptT&)>("sgl_kernel::moe_experts");
  const T x = rmsnorm(hidden, norm_w, norm_eps, norm_offset);
  const T logits = at::linear(x, router_w);
  const auto [weights, ids] =
      correction_bias.has_value()
          ? grouped_op.call(logits, *correction_bias, top_k, num_groups, topk_groups, renormalize, scaling)
          : softmax_op.call(logits, top_k, renormalize);
  const T out = experts_op.call(x, w13t, w2t, weights, ids, gated, activation, shared_w13t, shared_w2t, shared_gate);
  return at::add(hidden, out);
}

T attention_block_decode(const T& hidden, const T& norm_w, double norm_eps, double norm_offset, const T& q_w,
                         const OptT& q_b, const T& k_w, const OptT& k_b, const T& v_w, const OptT& v_b, const T& o_w,
                         const OptT& o_b, const OptT& q_norm_w, const OptT& k_norm_w, double qk_eps, double qk_offset,
                         const T& positions, const OptT& inv_freq, int64_t rotary_dim, T k_buffer, T v_buffer,
                         const T& loc, const T& req_to_token, const T& req_pool_indices, const T& seq_lens,
                         double scale, int64_t heads, int64_t kv_heads, int64_t head_dim, bool output_gate) {
  const char* what = "attention_block_decode";
  check_hidden(hidden, what);
  TORCH_CHECK(q_norm_w.has_value() == k_norm_w.has_value(), what, ": q and k are normalised both or neither");
  TORCH_CHECK(k_buffer.element_size() > 1, what, ": a float8 KV pool takes the per-op path (a byte view)");
  static const auto rope_op = find_op<std::tuple<T, T>(const T&, const T&, const T&, const T&, int64_t)>(
      "sgl_kernel::rotary_embedding");
  static const auto attn_op = find_op<T(const T&, const T&, const T&, const T&, const T&, const T&, double, int64_t)>(
      "sgl_kernel::decode_attention");
  const int64_t bs = hidden.size(0), d = head_dim;
  const T x = rmsnorm(hidden, norm_w, norm_eps, norm_offset);
  // With an output gate each head's projection is [query | gate] (Qwen3-Next).
  const T qg = at::linear(x, q_w, q_b).view({bs, heads, output_gate ? 2 * d : d});
  T q = output_gate ? qg.narrow(2, 0, d) : qg;
  T k = at::linear(x, k_w, k_b).view({bs, kv_heads, d});
  if (q_norm_w.has_value()) {
    q = rmsnorm(q.contiguous(), *q_norm_w, qk_eps, qk_offset);
    k = rmsnorm(k.contiguous(), *k_norm_w, qk_eps, qk_offset);
  }
  if (inv_freq.has_value()) std::tie(q, k) = rope_op.call(positions, q, k, *inv_freq, rotary_dim);
  const T v = at::linear(x, v_w, v_b);
  // The new token's K and V into the pool (as the backend's set_kv_buffer: `buf[loc] = new`), then the
  // paged decode attention over the pool in place.
  k_buffer.index_put_({loc}, k.reshape({-1, kv_heads, d}).to(k_buffer.scalar_type()));
  v_buffer.index_put_({loc}, v.view({-1, kv_heads, d}).to(v_buffer.scalar_type()));
  const int64_t min_macs = 8388608;  // the op's default (its schema's)
  T out = attn_op.call(q.reshape({bs, heads, d}).contiguous(), k_buffer, v_buffer, req_to_token, req_pool_indices,
                       seq_lens, scale, min_macs).view({bs, heads * d});
  if (output_gate) out = at::mul(out, at::sigmoid(qg.narrow(2, d, d).reshape({bs, heads * d})));
  return at::add(hidden, at::linear(out, o_w, o_b));
}

// The activations by the codes of `moe_experts` (CPU_OP_ACTIVATIONS), as torch computes them
// (python/sglang/srt/layers/activation.py).
T activate(const T& h, int64_t activation) {
  switch (activation) {
    case 0: return at::silu(h);
    case 1: return at::square(at::relu(h));
    case 2: return at::relu(h);
    case 3: return at::gelu(h);
    default: TORCH_CHECK(false, "mlp_block_decode: unknown activation code ", activation);
  }
}

T mlp_block_decode(const T& hidden, const T& norm_w, double norm_eps, double norm_offset, const OptT& gate_w,
                   const OptT& gate_b, const T& up_w, const OptT& up_b, const T& down_w, const OptT& down_b,
                   int64_t activation) {
  check_hidden(hidden, "mlp_block_decode");
  const T x = rmsnorm(hidden, norm_w, norm_eps, norm_offset);
  const T h = gate_w.has_value() ? at::mul(activate(at::linear(x, *gate_w, gate_b), activation), at::linear(x, up_w, up_b))
                                 : activate(at::linear(x, up_w, up_b), activation);
  return at::add(hidden, at::linear(h, down_w, down_b));
}

}  // namespace
}  // namespace sgl_blocks

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "gdn_block_decode(Tensor hidden, Tensor norm_w, float norm_eps, float norm_offset, Tensor w_qkvz, Tensor w_ba, "
      "Tensor(a!) conv_state, Tensor conv_w, Tensor(b!) ssm, Tensor slots, Tensor A_log, Tensor dt_bias, "
      "Tensor out_norm_w, float out_norm_eps, Tensor w_out, int hk, int hv, int dk, int dv) -> Tensor");
  m.def(
      "mamba2_block_decode(Tensor hidden, Tensor norm_w, float norm_eps, Tensor w_in, Tensor? b_in, "
      "Tensor(a!) conv_state, Tensor conv_w, Tensor? conv_b, Tensor(b!) ssm, Tensor slots, Tensor dt_bias, "
      "Tensor A_log, Tensor D, float time_step_min, Tensor out_norm_w, float out_norm_eps, int group_size, "
      "Tensor w_out, Tensor? b_out, int heads, int head_dim, int groups, int state_size) -> Tensor");
  m.def(
      "moe_block_decode(Tensor hidden, Tensor norm_w, float norm_eps, float norm_offset, Tensor router_w, "
      "Tensor? correction_bias, int top_k, bool renormalize, int num_groups, int topk_groups, float scaling, "
      "Tensor w13t, Tensor w2t, bool gated, int activation, Tensor? shared_w13t=None, Tensor? shared_w2t=None, "
      "Tensor? shared_gate=None) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "attention_block_decode(Tensor hidden, Tensor norm_w, float norm_eps, float norm_offset, Tensor q_w, "
      "Tensor? q_b, Tensor k_w, Tensor? k_b, Tensor v_w, Tensor? v_b, Tensor o_w, Tensor? o_b, Tensor? q_norm_w, "
      "Tensor? k_norm_w, float qk_eps, float qk_offset, Tensor positions, Tensor? inv_freq, int rotary_dim, "
      "Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, float scale, int heads, int kv_heads, int head_dim, bool output_gate) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def(
      "mlp_block_decode(Tensor hidden, Tensor norm_w, float norm_eps, float norm_offset, Tensor? gate_w, "
      "Tensor? gate_b, Tensor up_w, Tensor? up_b, Tensor down_w, Tensor? down_b, int activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  m.impl("mlp_block_decode", &sgl_blocks::mlp_block_decode);
  m.impl("attention_block_decode", &sgl_blocks::attention_block_decode);
  m.impl("gdn_block_decode", &sgl_blocks::gdn_block_decode);
  m.impl("mamba2_block_decode", &sgl_blocks::mamba2_block_decode);
  m.impl("moe_block_decode", &sgl_blocks::moe_block_decode);
}
