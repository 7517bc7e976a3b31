// CPU top-k routing of MoE layers, registered as torch.ops.sgl_kernel.topk_softmax and
// torch.ops.sgl_kernel.biased_grouped_topk (upstream sgl-kernel's names for the same two routings).
//
//   topk_softmax(logits, top_k, renormalize) -> (weights, ids)
//     Qwen3-Next: softmax over all experts, the top_k probabilities (renormalised to sum to 1).
//   biased_grouped_topk(logits, correction_bias, top_k, num_groups, topk_groups, renormalize, scaling)
//     -> (weights, ids)
//     Nemotron-H (DeepSeek-V3 style): s = sigmoid(logits); experts are chosen by s + correction_bias, among
//     the topk_groups groups whose two best biased scores sum highest; each is weighted by its s
//     (renormalised, + 1e-20 in the sum, then times `scaling`).
//
// logits [T, E] float32, contiguous; weights [T, top_k] float32 and ids [T, top_k] int64, best first. Ties go
// to the lower expert id. The torch twins are `softmax_topk` / `grouped_sigmoid_topk` in
// python/sglang/srt/layers/moe/router.py: 5 and ~12 small ops per layer there, one call here
// (test/unit/kernels/test_cpu_moe_routing.py).
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace sgl_moe_routing {
namespace {

// The index of the largest of values[0..n) not yet taken (ties: the lowest index). A NaN never wins
// unless everything left is NaN: some free index is always returned, so a NaN logit gives NaN weights,
// never an id outside the experts.
inline int64_t best_free(const float* values, const char* taken, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (taken[i]) continue;
    if (best < 0 || values[i] > values[best] || std::isnan(values[best])) best = i;
  }
  return best;
}

// Takes the top_k experts of `rank` among those not yet taken (best first, marking them taken): their ids
// into `ids`, their `weight`s into `ws`. Returns the sum of those weights.
float pick_top_k(const float* rank, const float* weight, char* taken, int64_t E, int64_t top_k, int64_t* ids,
                 float* ws) {
  float kept = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t e = best_free(rank, taken, E);
    taken[e] = 1;
    ids[j] = e;
    kept += ws[j] = weight[e];
  }
  return kept;
}

void check_logits(const at::Tensor& logits, int64_t top_k, const char* what) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(), what,
              ": logits must be a contiguous float32 [tokens, experts] tensor");
  TORCH_CHECK(top_k > 0 && top_k <= logits.size(1), what, ": top_k must be between 1 and the ", logits.size(1),
              " experts; got ", top_k);
}

std::tuple<at::Tensor, at::Tensor> topk_softmax(const at::Tensor& logits, int64_t top_k, bool renormalize) {
  check_logits(logits, top_k, "topk_softmax");
  const int64_t T = logits.size(0), E = logits.size(1);
  auto weights = at::empty({T, top_k}, logits.options());
  auto ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  const float* ls = logits.data_ptr<float>();
  float* ws = weights.data_ptr<float>();
  int64_t* is = ids.data_ptr<int64_t>();
  std::vector<float> probs(E);
  std::vector<char> taken(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = ls + t * E;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(l[e] - m);
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    const float kept = pick_top_k(probs.data(), probs.data(), taken.data(), E, top_k, is + t * top_k, ws + t * top_k);
    if (renormalize)
      for (int64_t j = 0; j < top_k; ++j) ws[t * top_k + j] /= kept;
  }
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk(const at::Tensor& logits, const at::Tensor& correction_bias,
                                                       int64_t top_k, int64_t num_groups, int64_t topk_groups,
                                                       bool renormalize, double scaling) {
  const char* what = "biased_grouped_topk";
  check_logits(logits, top_k, what);
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(correction_bias.scalar_type() == at::kFloat && correction_bias.dim() == 1 &&
                  correction_bias.size(0) == E && correction_bias.is_contiguous(),
              what, ": correction_bias must be a contiguous float32 vector of one entry per expert");
  TORCH_CHECK(num_groups > 0 && E % num_groups == 0, what, ": num_groups must divide the ", E, " experts");
  const int64_t group_size = E / num_groups;
  TORCH_CHECK(topk_groups > 0 && topk_groups <= num_groups && top_k <= topk_groups * group_size, what,
              ": topk_groups must be between 1 and num_groups, with top_k experts in the groups it keeps");
  auto weights = at::empty({T, top_k}, logits.options());
  auto ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  const float *ls = logits.data_ptr<float>(), *bias = correction_bias.data_ptr<float>();
  float* ws = weights.data_ptr<float>();
  int64_t* is = ids.data_ptr<int64_t>();
  std::vector<float> scores(E), biased(E), group_scores(num_groups);
  std::vector<char> taken(E), group_taken(num_groups);
  const int64_t per_group = std::min<int64_t>(2, group_size);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = ls + t * E;
    for (int64_t e = 0; e < E; ++e) {
      scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
      biased[e] = scores[e] + bias[e];
    }
    // A group's score: the sum of its best two biased scores (its best one in groups of one).
    for (int64_t g = 0; g < num_groups; ++g) {
      const float* b = biased.data() + g * group_size;
      std::fill(taken.begin(), taken.begin() + group_size, 0);
      float s = 0.0f;
      for (int64_t j = 0; j < per_group; ++j) {
        const int64_t e = best_free(b, taken.data(), group_size);
        taken[e] = 1;
        s += b[e];
      }
      group_scores[g] = s;
    }
    // The kept groups' experts are free, the others taken.
    std::fill(group_taken.begin(), group_taken.end(), 0);
    std::fill(taken.begin(), taken.end(), 1);
    for (int64_t j = 0; j < topk_groups; ++j) {
      const int64_t g = best_free(group_scores.data(), group_taken.data(), num_groups);
      group_taken[g] = 1;
      std::fill(taken.begin() + g * group_size, taken.begin() + (g + 1) * group_size, 0);
    }
    const float kept =
        pick_top_k(biased.data(), scores.data(), taken.data(), E, top_k, is + t * top_k, ws + t * top_k);
    const float factor = static_cast<float>(scaling);
    for (int64_t j = 0; j < top_k; ++j) {
      float& w = ws[t * top_k + j];
      if (renormalize) w /= kept + 1e-20f;
      w *= factor;
    }
  }
  return {weights, ids};
}

}  // namespace
}  // namespace sgl_moe_routing

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  m.def("topk_softmax(Tensor logits, int top_k, bool renormalize) -> (Tensor, Tensor)");
  m.def(
      "biased_grouped_topk(Tensor logits, Tensor correction_bias, int top_k, int num_groups, int topk_groups, "
      "bool renormalize, float scaling) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sgl_kernel, CPU, m) {
  m.impl("topk_softmax", &sgl_moe_routing::topk_softmax);
  m.impl("biased_grouped_topk", &sgl_moe_routing::biased_grouped_topk);
}
