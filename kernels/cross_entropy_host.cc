// Host reference of the fused cross-entropy: double accumulations, the same
// outputs as launch_cross_entropy (gradients rounded to the logits' dtype
// through fp32, as the device stores them), and an Error for a bad label.
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_parts.h"

namespace stepgraph::kernels::host {
void cross_entropy(const CrossEntropyDesc& desc, const void* logits, const void* labels, float* loss, void* dlogits) {
  check_cross_entropy(desc);
  SG_CHECK(logits != nullptr && labels != nullptr && loss != nullptr && dlogits != nullptr,
           "cross_entropy (host): logits, labels, loss and dlogits must not be null");
  const std::int64_t vocab = desc.vocab;

  // Labels first, so a bad one throws before any output is written.
  std::int64_t count = 0;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    const std::int64_t label = load_label(desc.label_type, labels, t);
    if (label == desc.ignore_index) continue;
    SG_CHECK(label >= 0 && label < vocab, "cross_entropy (host): label ", label, " of token ", t, " is outside [0, ",
             vocab, ") and is not ignore_index (", desc.ignore_index, "); fix the labels or set ignore_index");
    ++count;
  }
  const double scale = count > 0 ? static_cast<double>(desc.loss_scale) / static_cast<double>(count) : 0.0;

  double total = 0.0;
  std::vector<double> row(static_cast<std::size_t>(vocab));
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    const std::int64_t label = load_label(desc.label_type, labels, t);
    const std::int64_t base = t * vocab;
    if (label == desc.ignore_index) {
      for (std::int64_t j = 0; j < vocab; ++j) store_from_float(desc.logits_type, dlogits, base + j, 0.0f);
      continue;
    }
    double max = -INFINITY;
    for (std::int64_t j = 0; j < vocab; ++j) {
      row[j] = load_as_float(desc.logits_type, logits, base + j);
      max = std::fmax(max, row[j]);
    }
    double sum = 0.0;
    for (std::int64_t j = 0; j < vocab; ++j) {
      row[j] = std::exp(row[j] - max);  // the row now holds exp(x - max)
      sum += row[j];
    }
    total += max + std::log(sum) - load_as_float(desc.logits_type, logits, base + label);
    for (std::int64_t j = 0; j < vocab; ++j) {
      const double onehot = j == label ? 1.0 : 0.0;
      store_from_float(desc.logits_type, dlogits, base + j, static_cast<float>((row[j] / sum - onehot) * scale));
    }
  }
  *loss = count > 0 ? static_cast<float>(total / static_cast<double>(count)) : 0.0f;
}

}  // namespace stepgraph::kernels::host
