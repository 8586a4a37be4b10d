// Host references of FP8 quantization (contract in fp8_quantize.h).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/fp8_quantize.h"

namespace stepgraph::kernels {
namespace {

constexpr std::int64_t kBlock = kScaleBlock;

float max_abs(float a, float x) {
  if (std::isnan(a) || std::isnan(x)) return NAN;
  return std::max(a, std::fabs(x));
}

}  // namespace

float fp8_scale(float amax, Fp8Format format, int margin, bool power_of_two) {
  if (amax == 0.0f) return 1.0f;
  float scale = std::ldexp(fp8_max(format) / amax, -margin);
  if (!(scale <= FLT_MAX)) scale = FLT_MAX;  // the quotient overflowed
  if (power_of_two) {
    int exponent = 0;
    std::frexp(scale, &exponent);  // scale = f * 2^exponent, f in [0.5, 1)
    scale = std::ldexp(1.0f, exponent - 1);
  }
  return scale;
}

void check_quantize(const QuantizeDesc& desc) {
  SG_CHECK(desc.in_dtype == DType::kFloat32 || desc.in_dtype == DType::kBFloat16 || desc.in_dtype == DType::kFloat16,
           "quantize: input dtype must be fp32, bf16 or fp16, got ", dtype_name(desc.in_dtype));
  SG_CHECK(desc.rows >= 0 && desc.cols >= 0, "quantize: rows and cols must be >= 0, got [", desc.rows, ", ",
           desc.cols, "]");
  SG_CHECK(desc.rowwise || desc.columnwise, "quantize: ask for the row-wise copy, the column-wise copy or both");
}

void quantize_host(const QuantizeDesc& desc, const void* x, float scale, std::uint8_t* rowwise,
                   std::uint8_t* columnwise, float* amax) {
  check_quantize(desc);
  const bool empty = desc.rows * desc.cols == 0;  // an empty vector's data() may be null
  SG_CHECK((!desc.rowwise || rowwise != nullptr || empty) && (!desc.columnwise || columnwise != nullptr || empty) &&
               amax != nullptr,
           "quantize: an output asked for is null");
  float running = 0.0f;
  for (std::int64_t r = 0; r < desc.rows; ++r) {
    for (std::int64_t c = 0; c < desc.cols; ++c) {
      const float value = load_as_float(desc.in_dtype, x, r * desc.cols + c);
      running = max_abs(running, value);
      const std::uint8_t q = float_to_fp8(desc.format, value * scale);
      if (desc.rowwise) rowwise[r * desc.cols + c] = q;
      if (desc.columnwise) columnwise[c * desc.rows + r] = q;
    }
  }
  *amax = running;
}

float amax_host(DType dtype, std::int64_t rows, std::int64_t cols, const void* x) {
  check_quantize({dtype, Fp8Format::kE4M3, rows, cols, true, false});
  float running = 0.0f;
  for (std::int64_t i = 0; i < rows * cols; ++i) running = max_abs(running, load_as_float(dtype, x, i));
  return running;
}

void check_block_quantize(const QuantizeDesc& desc, BlockShape shape) {
  check_quantize(desc);
  const bool rows_blocked = shape == BlockShape::k128x128 || desc.columnwise;
  SG_CHECK(desc.cols % kBlock == 0 && (!rows_blocked || desc.rows % kBlock == 0), "block quantize (",
           shape == BlockShape::k1x128 ? "1 x 128" : "128 x 128", desc.columnwise ? ", with the column-wise copy" : "",
           "): [", desc.rows, ", ", desc.cols, "] must have cols", rows_blocked ? " and rows" : "",
           " divisible by 128");
}

bool quantize_blocks_host(const QuantizeDesc& desc, BlockShape shape, bool power_of_two, const void* x,
                          const BlockOutputs& out) {
  check_block_quantize(desc, shape);
  SG_CHECK((!desc.rowwise || (out.rowwise != nullptr && out.rowwise_scale_inv != nullptr)) &&
               (!desc.columnwise || (out.columnwise != nullptr && out.columnwise_scale_inv != nullptr)),
           "block quantize: an output asked for is null");
  const std::int64_t rows = desc.rows;
  const std::int64_t cols = desc.cols;
  std::vector<float> values(static_cast<std::size_t>(rows * cols));
  for (std::int64_t i = 0; i < rows * cols; ++i) values[i] = load_as_float(desc.in_dtype, x, i);
  auto at = [&](std::int64_t r, std::int64_t c) { return values[r * cols + c]; };

  // One block: rows [r0, r1) x cols [c0, c1); its scale quantizes it into
  // q (row-major with leading dimension ld, or transposed).
  auto block_scale = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, float* scale) {
    float amax = 0.0f;
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::int64_t c = c0; c < c1; ++c) amax = max_abs(amax, at(r, c));
    if (!amax_is_usable(amax)) return false;
    *scale = fp8_scale(amax, desc.format, 0, power_of_two);
    return true;
  };
  auto store = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, float scale, bool transposed) {
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::int64_t c = c0; c < c1; ++c) {
        const std::uint8_t q = float_to_fp8(desc.format, at(r, c) * scale);
        if (transposed) {
          out.columnwise[c * rows + r] = q;
        } else {
          out.rowwise[r * cols + c] = q;
        }
      }
  };

  const BlockScaleLayout row_layout{shape, rows, cols};     // q [rows, cols]
  const BlockScaleLayout column_layout{shape, cols, rows};  // q^T [cols, rows]
  if (desc.rowwise) std::fill_n(out.rowwise_scale_inv, row_layout.count(), 0.0f);  // 128 x 128's padding
  if (desc.columnwise) std::fill_n(out.columnwise_scale_inv, column_layout.count(), 0.0f);
  // Quantizes the block rows [r0, r1) x cols [c0, c1) with its own scale.
  auto quantize_block = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, bool rowwise,
                            bool columnwise) {
    float scale = 1.0f;
    if (!block_scale(r0, r1, c0, c1, &scale)) return false;
    if (rowwise) {
      store(r0, r1, c0, c1, scale, false);
      out.rowwise_scale_inv[row_layout.index(r0, c0)] = 1.0f / scale;
    }
    if (columnwise) {
      store(r0, r1, c0, c1, scale, true);
      out.columnwise_scale_inv[column_layout.index(c0, r0)] = 1.0f / scale;
    }
    return true;
  };
  if (shape == BlockShape::k1x128) {
    if (desc.rowwise) {
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < cols; c += kBlock)
          if (!quantize_block(r, r + 1, c, c + kBlock, true, false)) return false;
    }
    if (desc.columnwise) {
      for (std::int64_t c = 0; c < cols; ++c)
        for (std::int64_t r = 0; r < rows; r += kBlock)
          if (!quantize_block(r, r + kBlock, c, c + 1, false, true)) return false;
    }
    return true;
  }
  for (std::int64_t r = 0; r < rows; r += kBlock)
    for (std::int64_t c = 0; c < cols; c += kBlock)
      if (!quantize_block(r, r + kBlock, c, c + kBlock, desc.rowwise, desc.columnwise)) return false;
  return true;
}

bool delayed_scaling_update_host(const Fp8Recipe& recipe, Fp8Format format, float amax, const DelayedScale& state) {
  recipe.check();
  SG_CHECK(recipe.scaling == Fp8Scaling::kDelayed, "delayed scaling update: the recipe's scaling is ",
           fp8_scaling_name(recipe.scaling), ", not delayed");
  SG_CHECK(state.history != nullptr && state.scale != nullptr && state.scale_inv != nullptr,
           "delayed scaling update: history, scale and scale_inv must be given");
  if (!amax_is_usable(amax)) return false;
  const int length = recipe.amax_history_len;
  for (int i = length - 1; i > 0; --i) state.history[i] = state.history[i - 1];
  state.history[0] = amax;
  float reduced = state.history[0];
  if (recipe.amax_reduction == AmaxReduction::kMax) {
    for (int i = 1; i < length; ++i) reduced = std::max(reduced, state.history[i]);
  }
  if (reduced > 0.0f) {
    *state.scale = fp8_scale(reduced, format, recipe.margin, false);
    *state.scale_inv = 1.0f / *state.scale;
  }
  return true;
}

}  // namespace stepgraph::kernels
