// Reading and writing float tensors of any float dtype from tests, through
// fp32 values on the host (bf16/fp16 rounded to nearest even).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/context.h"
#include "engine/half_precision.h"

namespace stepgraph::testing {

inline std::vector<float> read_floats(Context& ctx, const Tensor& t) {
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(t.bytes()));
  ctx.copy_to_host(t, bytes.data(), bytes.size());
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) out[i] = load_as_float(t.dtype(), bytes.data(), i);
  return out;
}

inline void write_floats(Context& ctx, const Tensor& t, const std::vector<float>& values) {
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(t.bytes()));
  for (std::int64_t i = 0; i < t.numel(); ++i) store_from_float(t.dtype(), bytes.data(), i, values[i]);
  ctx.copy_from_host(t, bytes.data(), bytes.size());
}

template <typename T>
void write_values(Context& ctx, const Tensor& t, const std::vector<T>& values) {
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(T));
}

}  // namespace stepgraph::testing
