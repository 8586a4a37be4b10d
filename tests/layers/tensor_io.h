// Reading and writing float tensors of any float dtype from tests, through
// fp32 values on the host (bf16/fp16 rounded to nearest even), and the
// values and error norm the FP8 layer tests share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
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

// A tensor's bytes, for bit-for-bit comparisons.
inline std::vector<std::uint8_t> raw_bytes(Context& ctx, const Tensor& t) {
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(t.bytes()));
  ctx.copy_to_host(t, bytes.data(), bytes.size());
  return bytes;
}

// The bytes of each parameter's gradient of `layer` (any layer with
// parameters()), in parameters() order.
template <typename LayerT>
std::vector<std::vector<std::uint8_t>> grad_bytes(Context& ctx, LayerT& layer) {
  std::vector<std::vector<std::uint8_t>> out;
  for (const auto* p : layer.parameters()) out.push_back(raw_bytes(ctx, p->grad));
  return out;
}

// The bit patterns of fp32 values, for bit-for-bit comparisons that print usefully.
inline std::vector<std::uint32_t> bits(const std::vector<float>& values) {
  std::vector<std::uint32_t> out(values.size());
  std::memcpy(out.data(), values.data(), values.size() * sizeof(float));
  return out;
}

// max |got - want| over max |want|.
inline double relative(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  return diff / scale;
}

// `count` normal values of standard deviation `sigma`.
inline std::vector<float> random_values(std::int64_t count, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> out(static_cast<std::size_t>(count));
  for (float& v : out) v = normal(rng);
  return out;
}

// `count` values uniform in [low, high).
inline std::vector<float> uniform_values(std::int64_t count, std::mt19937& rng, float low, float high) {
  std::uniform_real_distribution<float> uniform(low, high);
  std::vector<float> out(static_cast<std::size_t>(count));
  for (float& v : out) v = uniform(rng);
  return out;
}

}  // namespace stepgraph::testing
