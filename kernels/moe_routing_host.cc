// Argument checks of the routing kernels and their host references: the same
// expert choice (kernels/moe_routing.cuh), the same stable order and the same
// error word as the CUDA kernels; float results in fp32 with double sums.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/moe_routing.cuh"
#include "kernels/moe_routing.h"

namespace stepgraph::kernels {
namespace {

constexpr std::int64_t kMaxRows = std::numeric_limits<std::int32_t>::max();

bool float_type(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32;
}

}  // namespace

void check_router(const RouterDesc& desc) {
  SG_CHECK(float_type(desc.logits_type), "router_topk: logits must be bf16, fp16 or fp32, got ",
           dtype_name(desc.logits_type));
  SG_CHECK(desc.topk >= 1 && desc.topk <= kMaxTopk, "router_topk: topk must be in [1, ", kMaxTopk, "], got ", desc.topk);
  SG_CHECK(desc.experts >= desc.topk && desc.experts <= kMaxExperts,
           "router_topk: experts must be in [topk = ", desc.topk, ", ", kMaxExperts, "], got ", desc.experts);
  SG_CHECK(desc.tokens > 0 && desc.tokens * desc.topk <= kMaxRows,
           "router_topk: tokens * topk must be in [1, 2^31), got ", desc.tokens, " tokens");
}

void check_plan(const PlanDesc& desc) {
  SG_CHECK(desc.topk >= 1 && desc.topk <= kMaxTopk, "moe_plan: topk must be in [1, ", kMaxTopk, "], got ", desc.topk);
  SG_CHECK(desc.experts >= 1 && desc.experts <= kMaxExperts, "moe_plan: experts must be in [1, ", kMaxExperts,
           "], got ", desc.experts);
  SG_CHECK(desc.tokens > 0 && desc.entries() <= kMaxRows, "moe_plan: tokens * topk must be in [1, 2^31), got ",
           desc.tokens, " tokens");
}

void check_permute(const PermuteDesc& desc) {
  SG_CHECK(float_type(desc.dtype), "moe_permute: rows must be bf16, fp16 or fp32, got ", dtype_name(desc.dtype));
  SG_CHECK(desc.topk >= 1 && desc.topk <= kMaxTopk, "moe_permute: topk must be in [1, ", kMaxTopk, "], got ", desc.topk);
  SG_CHECK(desc.tokens > 0 && desc.entries() <= kMaxRows, "moe_permute: tokens * topk must be in [1, 2^31), got ",
           desc.tokens, " tokens");
  SG_CHECK(desc.hidden > 0 && desc.hidden <= kMaxRows, "moe_permute: hidden must be in [1, 2^31), got ", desc.hidden);
}

namespace host {
namespace {

float load(DType dtype, const void* base, std::int64_t i) { return load_as_float(dtype, base, i); }

}  // namespace

void router_topk(const RouterDesc& desc, const void* logits, std::int32_t* experts, float* gates,
                 const float* bias) {
  check_router(desc);
  const std::int64_t E = desc.experts;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    std::int32_t best[2] = {-1, -1};
    float value[2] = {0.0f, 0.0f};
    for (int slot = 0; slot < desc.topk; ++slot) {
      for (std::int64_t e = 0; e < E; ++e) {
        if (slot == 1 && e == best[0]) continue;
        const float l = load(desc.logits_type, logits, t * E + e);
        const float v = moe::rank_value(bias != nullptr ? l + bias[e] : l);
        if (moe::ranks_before(v, static_cast<std::int32_t>(e), value[slot], best[slot])) {
          best[slot] = static_cast<std::int32_t>(e);
          value[slot] = v;
        }
      }
    }
    const float l1 = load(desc.logits_type, logits, t * E + best[0]);
    if (desc.topk == 1) {
      // Shifted by the largest logit, which is l1 unless a bias chose.
      float max = l1;
      if (bias != nullptr) {
        for (std::int64_t e = 0; e < E; ++e) max = std::fmax(max, load(desc.logits_type, logits, t * E + e));
      }
      double sum = 0.0;
      for (std::int64_t e = 0; e < E; ++e)
        sum += std::exp(static_cast<double>(load(desc.logits_type, logits, t * E + e)) - max);
      experts[t] = best[0];
      gates[t] = static_cast<float>(std::exp(static_cast<double>(l1) - max) / sum);
    } else {
      const float l2 = load(desc.logits_type, logits, t * E + best[1]);
      experts[2 * t] = best[0];
      experts[2 * t + 1] = best[1];
      moe::top2_gates(l1, l2, gates[2 * t], gates[2 * t + 1]);
    }
  }
}

void router_backward(const RouterDesc& desc, const float* dgates, const void* logits, const std::int32_t* experts,
                     const float* gates, void* dlogits) {
  check_router(desc);
  const std::int64_t E = desc.experts;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    std::vector<float> row(static_cast<std::size_t>(E), 0.0f);
    if (desc.topk == 1) {
      // dl_m = dg g (delta_im - p_m), p_m = exp(l_m - l_i) g.
      const std::int32_t i = experts[t];
      const float g = gates[t];
      const float scale = dgates[t] * g;
      const float li = load(desc.logits_type, logits, t * E + i);
      for (std::int64_t m = 0; m < E; ++m) {
        const float p = std::exp(load(desc.logits_type, logits, t * E + m) - li) * g;
        row[m] = scale * ((m == i ? 1.0f : 0.0f) - p);
      }
    } else {
      float dl1, dl2;
      moe::top2_backward(gates[2 * t], gates[2 * t + 1], dgates[2 * t], dgates[2 * t + 1], dl1, dl2);
      row[experts[2 * t]] = dl1;
      row[experts[2 * t + 1]] = dl2;
    }
    for (std::int64_t m = 0; m < E; ++m) store_from_float(desc.logits_type, dlogits, t * E + m, row[m]);
  }
}

void moe_plan(const PlanDesc& desc, const std::int32_t* experts, std::int32_t* splits, std::int32_t* offsets,
              std::int32_t* positions, std::int32_t* sources, std::int32_t* error_word) {
  check_plan(desc);
  const std::int64_t n = desc.entries();
  std::vector<std::int32_t> expert(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t e = experts[i];
    if (e < 0 || e >= desc.experts) *error_word |= kExpertOutOfRange;
    expert[i] = e < 0 || e >= desc.experts ? 0 : e;
  }
  std::fill(splits, splits + desc.experts, 0);
  for (std::int32_t e : expert) ++splits[e];
  offsets[0] = 0;
  for (std::int64_t e = 0; e < desc.experts; ++e) offsets[e + 1] = offsets[e] + splits[e];
  std::vector<std::int32_t> next(offsets, offsets + desc.experts);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t row = next[expert[i]]++;
    positions[i] = row;
    sources[row] = static_cast<std::int32_t>(i / desc.topk);
  }
}

void split_offsets(std::int64_t experts, std::int64_t tokens, const std::int32_t* splits, std::int32_t* offsets,
                   std::int32_t* error_word, SplitSum split_sum) {
  SG_CHECK(experts >= 1 && experts <= kMaxExperts, "split_offsets: experts must be in [1, ", kMaxExperts, "], got ",
           experts);
  SG_CHECK(tokens >= 0 && tokens <= kMaxRows, "split_offsets: tokens must be in [0, 2^31), got ", tokens);
  std::int64_t sum = 0;
  std::int32_t error = 0;
  offsets[0] = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    if (splits[e] < 0) error |= kSplitNegative;
    sum += splits[e];
    offsets[e + 1] = static_cast<std::int32_t>(std::min<std::int64_t>(offsets[e] + std::max(splits[e], 0), tokens));
  }
  if (split_sum == SplitSum::kEqualsRows ? sum != tokens : sum > tokens) error |= kSplitSumMismatch;
  *error_word |= error;
}

void moe_permute(const PermuteDesc& desc, const void* x, const std::int32_t* sources, void* x_perm) {
  check_permute(desc);
  const std::size_t row_bytes = static_cast<std::size_t>(desc.hidden) * dtype_size(desc.dtype);
  for (std::int64_t r = 0; r < desc.entries(); ++r) {
    std::memcpy(static_cast<std::uint8_t*>(x_perm) + r * row_bytes,
                static_cast<const std::uint8_t*>(x) + sources[r] * row_bytes, row_bytes);
  }
}

void moe_unpermute(const PermuteDesc& desc, const void* y_perm, const std::int32_t* positions, const float* gates,
                   void* y) {
  check_permute(desc);
  const std::int64_t H = desc.hidden;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      float sum = 0.0f;  // fp32 in slot order, like the kernel
      for (int j = 0; j < desc.topk; ++j) {
        const std::int64_t i = t * desc.topk + j;
        const float g = gates != nullptr ? gates[i] : 1.0f;
        sum += g * load(desc.dtype, y_perm, positions[i] * H + h);
      }
      store_from_float(desc.dtype, y, t * H + h, sum);
    }
  }
}

void moe_unpermute_backward(const PermuteDesc& desc, const void* dy, const void* y_perm, const std::int32_t* positions,
                            const float* gates, void* dy_perm, float* dgates) {
  check_permute(desc);
  const std::int64_t H = desc.hidden;
  for (std::int64_t i = 0; i < desc.entries(); ++i) {
    const std::int64_t t = i / desc.topk;
    const std::int64_t row = positions[i];
    double dot = 0.0;
    for (std::int64_t h = 0; h < H; ++h) {
      const float d = load(desc.dtype, dy, t * H + h);
      dot += static_cast<double>(d) * load(desc.dtype, y_perm, row * H + h);
      store_from_float(desc.dtype, dy_perm, row * H + h, gates[i] * d);
    }
    dgates[i] = static_cast<float>(dot);
  }
}

}  // namespace host
}  // namespace stepgraph::kernels
