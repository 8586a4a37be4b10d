// Host reference of the multi-tensor AdamW: the device's fp32 formula in the
// same order, with the same explicit fused multiply-adds (adamw_update in
// adamw.cu; keep the two in step), so results agree to the last bit or two
// (only expm1 of the bias corrections comes from different libraries).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/adamw.h"

namespace stepgraph::kernels::host {

void adamw_flag_nonfinite_grads(const std::vector<AdamWTensor>& tensors, std::int32_t* flag) {
  SG_CHECK(flag != nullptr, "adamw_flag_nonfinite_grads (host): flag is null");
  for (const AdamWTensor& t : tensors) {
    for (std::int64_t i = 0; i < t.numel; ++i) {
      if (!std::isfinite(t.grad[i])) {
        *flag = 1;
        return;
      }
    }
  }
}

void adamw(const AdamWHyper& hyper, const std::vector<AdamWTensor>& tensors, std::int64_t* step, bool advance_step,
           const float* lr, const float* grad_unscale) {
  check_adamw_hyper(hyper);
  SG_CHECK(step != nullptr, "adamw (host): step is null; pass the counter of steps taken (0 before the first)");
  for (std::size_t i = 0; i < tensors.size(); ++i) {  // all checked before anything changes
    const AdamWTensor& t = tensors[i];
    SG_CHECK(t.numel >= 0, "adamw (host): tensor ", i, " has numel ", t.numel, "; numel must be >= 0");
    SG_CHECK(t.numel == 0 || (t.weight != nullptr && t.grad != nullptr && t.m != nullptr && t.v != nullptr),
             "adamw (host): tensor ", i, " (", t.numel, " elements) has a null weight, grad, m or v");
  }

  const float rate = lr != nullptr ? *lr : hyper.lr;
  const std::int64_t t_step = *step + 1;
  const float steps = static_cast<float>(t_step);
  const float one_minus_beta1 = 1.0f - hyper.beta1;
  const float one_minus_beta2 = 1.0f - hyper.beta2;
  const float bias_first = -std::expm1(steps * std::log1p(hyper.beta1 - 1.0f));
  const float bias_second = -std::expm1(steps * std::log1p(hyper.beta2 - 1.0f));

  for (const AdamWTensor& t : tensors) {
    auto* copy = static_cast<std::uint16_t*>(t.copy);
    for (std::int64_t i = 0; i < t.numel; ++i) {
      const float g = grad_unscale != nullptr ? t.grad[i] * *grad_unscale : t.grad[i];
      float w = t.weight[i];
      float m = std::fma(hyper.beta1, t.m[i], one_minus_beta1 * g);
      float v = std::fma(hyper.beta2, t.v[i], (one_minus_beta2 * g) * g);
      const float m_hat = m / bias_first;
      const float v_hat = v / bias_second;
      const float update = std::fma(hyper.weight_decay, w, m_hat / (std::sqrt(v_hat) + hyper.eps));
      w = std::fma(-rate, update, w);
      t.weight[i] = w;
      t.m[i] = m;
      t.v[i] = v;
      if (copy != nullptr) copy[i] = t.copy_is_fp16 ? float_to_fp16(w) : float_to_bf16(w);
    }
  }
  if (advance_step) *step = t_step;
}

}  // namespace stepgraph::kernels::host
