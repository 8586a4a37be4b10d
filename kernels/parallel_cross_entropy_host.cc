// Host references of the vocabulary-parallel cross-entropy's three steps
// (parallel_cross_entropy.h; the math in Note [Vocabulary-parallel
// cross-entropy], parallel_cross_entropy.cu): double accumulations within a
// step, fp32 values between the steps (what the all-reduces carry), gradients
// rounded to the logits' dtype through fp32 as the device stores them.
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/cross_entropy_parts.h"
#include "kernels/parallel_cross_entropy.h"

namespace stepgraph::kernels::host {
namespace {

bool counts(const ParallelCrossEntropyDesc& desc, std::int64_t label) {
  return label_counts(label, desc.vocab, desc.ignore_index);
}

// The label's column in this rank's slice, or -1 when another rank holds it.
std::int64_t local_column(const ParallelCrossEntropyDesc& desc, std::int64_t label) {
  const std::int64_t column = label - desc.vocab_offset;
  return column >= 0 && column < desc.vocab_local ? column : -1;
}

}  // namespace

void parallel_cross_entropy_stats(const ParallelCrossEntropyDesc& desc, const void* logits, const void* labels,
                                  float* local_max, float* partial) {
  check_parallel_cross_entropy(desc);
  SG_CHECK(logits != nullptr && labels != nullptr && local_max != nullptr && partial != nullptr,
           "parallel_cross_entropy stats (host): logits, labels, local_max and partial must not be null");
  const std::int64_t width = desc.vocab_local;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    const std::int64_t label = load_label(desc.label_type, labels, t);
    if (!counts(desc, label)) {
      local_max[t] = partial[2 * t] = partial[2 * t + 1] = 0.0f;
      continue;
    }
    const std::int64_t base = t * width;
    double max = -INFINITY;
    for (std::int64_t j = 0; j < width; ++j) max = std::fmax(max, load_as_float(desc.logits_type, logits, base + j));
    double sum = 0.0;
    if (max != -INFINITY) {  // an all -inf slice adds nothing
      for (std::int64_t j = 0; j < width; ++j) sum += std::exp(load_as_float(desc.logits_type, logits, base + j) - max);
    }
    const std::int64_t column = local_column(desc, label);
    local_max[t] = static_cast<float>(max);
    partial[2 * t] = static_cast<float>(sum);
    partial[2 * t + 1] = column >= 0 ? load_as_float(desc.logits_type, logits, base + column) : 0.0f;
  }
}

void parallel_cross_entropy_rescale(std::int64_t tokens, const float* local_max,
                                    const float* global_max, const float* partial, float* scaled) {
  SG_CHECK(tokens > 0, "parallel_cross_entropy rescale: tokens must be > 0, got ", tokens);
  SG_CHECK(local_max != nullptr && global_max != nullptr && partial != nullptr && scaled != nullptr,
           "parallel_cross_entropy rescale (host): local_max, global_max, partial and scaled must not be null");
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float m = local_max[t];
    const float g = global_max[t];
    const float s = partial[2 * t];
    const float target = partial[2 * t + 1];
    scaled[2 * t] = m == g ? s : static_cast<float>(static_cast<double>(s) * std::exp(static_cast<double>(m) - g));
    scaled[2 * t + 1] = target;
  }
}

void parallel_cross_entropy_finish(const ParallelCrossEntropyDesc& desc, const void* logits, const void* labels,
                                   const float* global_max, const float* totals, float* loss, void* dlogits,
                                   std::int32_t* error_flag) {
  check_parallel_cross_entropy(desc);
  SG_CHECK(logits != nullptr && labels != nullptr && global_max != nullptr && totals != nullptr && loss != nullptr &&
               dlogits != nullptr && error_flag != nullptr,
           "parallel_cross_entropy finish (host): no argument may be null");
  std::int64_t count = 0;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    const std::int64_t label = load_label(desc.label_type, labels, t);
    if (counts(desc, label)) {
      ++count;
    } else if (label != desc.ignore_index) {
      *error_flag = 1;  // sticky, as on the device
    }
  }
  const double scale = count > 0 ? static_cast<double>(desc.loss_scale) / static_cast<double>(count) : 0.0;
  const std::int64_t width = desc.vocab_local;
  double total = 0.0;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    const std::int64_t label = load_label(desc.label_type, labels, t);
    const std::int64_t base = t * width;
    if (!counts(desc, label)) {
      for (std::int64_t j = 0; j < width; ++j) store_from_float(desc.logits_type, dlogits, base + j, 0.0f);
      continue;
    }
    const double max = global_max[t];
    const double sum = totals[2 * t];
    total += max + std::log(sum) - static_cast<double>(totals[2 * t + 1]);
    const std::int64_t column = local_column(desc, label);
    for (std::int64_t j = 0; j < width; ++j) {
      const double softmax = std::exp(load_as_float(desc.logits_type, logits, base + j) - max) / sum;
      const double onehot = j == column ? 1.0 : 0.0;
      store_from_float(desc.logits_type, dlogits, base + j, static_cast<float>((softmax - onehot) * scale));
    }
  }
  *loss = count > 0 ? static_cast<float>(total / static_cast<double>(count)) : 0.0f;
}

}  // namespace stepgraph::kernels::host
