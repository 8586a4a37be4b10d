// Argument checks of the load-balancing kernels and their host references
// (See kernels/moe_balance.h): fp32 softmax, double sums.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/moe_balance.h"
#include "kernels/moe_routing.h"

namespace stepgraph::kernels {

void check_aux_loss(const AuxLossDesc& desc) {
  SG_CHECK(desc.logits_type == DType::kBFloat16 || desc.logits_type == DType::kFloat16 ||
               desc.logits_type == DType::kFloat32,
           "router_aux_loss: logits must be bf16, fp16 or fp32, got ", dtype_name(desc.logits_type));
  SG_CHECK(desc.topk >= 1 && desc.topk <= kMaxTopk, "router_aux_loss: topk must be in [1, ", kMaxTopk, "], got ",
           desc.topk);
  SG_CHECK(desc.experts >= desc.topk && desc.experts <= kMaxExperts, "router_aux_loss: experts must be in [topk = ",
           desc.topk, ", ", kMaxExperts, "], got ", desc.experts);
  SG_CHECK(desc.tokens > 0 && desc.tokens * desc.topk <= std::numeric_limits<std::int32_t>::max(),
           "router_aux_loss: tokens * topk must be in [1, 2^31), got ", desc.tokens, " tokens");
  SG_CHECK(std::isfinite(desc.coef) && desc.coef >= 0.0f,
           "router_aux_loss: the coefficient must be finite and >= 0, got ", desc.coef);
}

namespace host {
namespace {

// Token t's softmax over the experts, fp32 (the max subtracted first).
std::vector<float> softmax_row(const AuxLossDesc& desc, const void* logits, std::int64_t t) {
  const std::int64_t E = desc.experts;
  std::vector<float> p(static_cast<std::size_t>(E));
  float max = -INFINITY;
  for (std::int64_t e = 0; e < E; ++e) max = std::fmax(max, load_as_float(desc.logits_type, logits, t * E + e));
  double sum = 0.0;
  for (std::int64_t e = 0; e < E; ++e) {
    p[e] = std::exp(load_as_float(desc.logits_type, logits, t * E + e) - max);
    sum += p[e];
  }
  for (float& v : p) v = static_cast<float>(v / sum);
  return p;
}

}  // namespace

void router_aux_loss(const AuxLossDesc& desc, const void* logits, const std::int32_t* splits, float* aux) {
  check_aux_loss(desc);
  double sum = 0.0;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    const std::vector<float> p = softmax_row(desc, logits, t);
    for (std::int64_t e = 0; e < desc.experts; ++e) sum += static_cast<double>(splits[e]) * p[e];
  }
  const double T = static_cast<double>(desc.tokens);
  aux[0] = static_cast<float>(desc.coef * static_cast<double>(desc.experts) / (T * T * desc.topk) * sum);
}

void router_aux_loss_backward(const AuxLossDesc& desc, float grad_factor, const void* logits,
                              const std::int32_t* splits, const float* loss_scale, const void* dlogits_in,
                              void* dlogits_out) {
  check_aux_loss(desc);
  const std::int64_t E = desc.experts;
  const float T = static_cast<float>(desc.tokens);
  // g_e = coef E f_e / T, times the loss's factors.
  const float scale = grad_factor * (loss_scale != nullptr ? loss_scale[0] : 1.0f) * desc.coef *
                      static_cast<float>(E) / (T * T * static_cast<float>(desc.topk));
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    const std::vector<float> p = softmax_row(desc, logits, t);
    double mean = 0.0;
    for (std::int64_t e = 0; e < E; ++e) mean += static_cast<double>(splits[e]) * p[e];
    for (std::int64_t m = 0; m < E; ++m) {
      const float d = scale * p[m] * static_cast<float>(static_cast<double>(splits[m]) - mean);
      store_from_float(desc.logits_type, dlogits_out, t * E + m,
                       load_as_float(desc.logits_type, dlogits_in, t * E + m) + d);
    }
  }
}

void expert_bias_update(std::int64_t experts, float rate, const std::int32_t* counts, float* bias) {
  std::int64_t sum = 0;
  for (std::int64_t e = 0; e < experts; ++e) sum += counts[e];
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t diff = sum - experts * static_cast<std::int64_t>(counts[e]);
    bias[e] += diff > 0 ? rate : (diff < 0 ? -rate : 0.0f);
  }
}

}  // namespace host
}  // namespace stepgraph::kernels
