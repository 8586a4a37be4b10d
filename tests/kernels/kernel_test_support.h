// Shared by the kernel tests: device buffers, random inputs in any float
// dtype, NaN poisoning, host <-> device copies, and the relative error norm
// ||got - want|| / ||want|| that tolerances are written against.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/half_precision.h"

namespace stepgraph::testing {

// Raw element bytes on the host, in `dtype`.
struct HostArray {
  DType dtype = DType::kFloat32;
  std::int64_t numel = 0;
  std::vector<std::uint8_t> bytes;

  HostArray() = default;
  HostArray(DType d, std::int64_t n) : dtype(d), numel(n), bytes(static_cast<std::size_t>(n) * dtype_size(d)) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }

  float get(std::int64_t i) const {
    switch (dtype) {
      case DType::kInt32: {
        std::int32_t v;
        std::memcpy(&v, bytes.data() + i * 4, 4);
        return static_cast<float>(v);
      }
      case DType::kInt64: {
        std::int64_t v;
        std::memcpy(&v, bytes.data() + i * 8, 8);
        return static_cast<float>(v);
      }
      default:
        return load_as_float(dtype, bytes.data(), i);
    }
  }
  // Floats are rounded to the dtype (nearest even); integers are truncated.
  void set(std::int64_t i, float value) {
    switch (dtype) {
      case DType::kInt32: {
        const auto v = static_cast<std::int32_t>(value);
        std::memcpy(bytes.data() + i * 4, &v, 4);
        return;
      }
      case DType::kInt64: {
        const auto v = static_cast<std::int64_t>(value);
        std::memcpy(bytes.data() + i * 8, &v, 8);
        return;
      }
      default:
        store_from_float(dtype, bytes.data(), i, value);
    }
  }
  std::vector<float> to_floats() const {
    std::vector<float> out(static_cast<std::size_t>(numel));
    for (std::int64_t i = 0; i < numel; ++i) out[i] = get(i);
    return out;
  }
};

// Uniform in [low, high), rounded to the dtype. `rng` is the caller's
// testing::SeededRng (tests/support/seed.h): fresh inputs every run, and a failure prints the seed.
inline HostArray random_array(DType dtype, std::int64_t n, std::mt19937& rng, float low = -1.0f, float high = 1.0f) {
  HostArray out(dtype, n);
  std::uniform_real_distribution<float> uniform(low, high);
  for (std::int64_t i = 0; i < n; ++i) out.set(i, uniform(rng));
  return out;
}

// A device allocation freed with the test (at least 256 bytes, 256-aligned).
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t bytes) {
    SG_CUDA_CHECK(cudaMalloc(&data_, bytes == 0 ? 256 : bytes));
    bytes_ = bytes;
  }
  explicit DeviceArray(const HostArray& host) : DeviceArray(host.bytes.size()) { upload(host); }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

  // Pageable copies synchronize the device: our kernels run on non-blocking
  // streams that do not wait for the legacy stream's copies.
  void upload(const HostArray& host) {
    SG_CUDA_CHECK(cudaMemcpy(data_, host.data(), host.bytes.size(), cudaMemcpyHostToDevice));
    SG_CUDA_CHECK(cudaDeviceSynchronize());
  }
  HostArray download(DType dtype, std::int64_t n) const {
    SG_CUDA_CHECK(cudaDeviceSynchronize());
    HostArray host(dtype, n);
    SG_CUDA_CHECK(cudaMemcpy(host.data(), data_, host.bytes.size(), cudaMemcpyDeviceToHost));
    return host;
  }
  // Every byte 0xFF: NaN in fp32, bf16 and fp16, -1 in integers.
  void poison() {
    SG_CUDA_CHECK(cudaMemset(data_, 0xFF, bytes_ == 0 ? 256 : bytes_));
    SG_CUDA_CHECK(cudaDeviceSynchronize());
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// ||got - want|| / ||want||; infinity if any value is NaN or the sizes differ.
inline double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double diff = 0.0;
  double norm = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return std::numeric_limits<double>::infinity();
    diff += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

// ||got - want|| / ||scale||, for results whose rounding error grows with
// `scale` (e.g. the sum of |terms| of a dot product) rather than with |want|.
// An empty `scale` means `want`.
inline double relative_error(const std::vector<float>& got, const std::vector<float>& want,
                             const std::vector<float>& scale) {
  if (scale.empty()) return relative_error(got, want);
  const double error = relative_error(got, want);
  double want_norm = 0.0;
  double scale_norm = 0.0;
  for (std::size_t i = 0; i < want.size() && i < scale.size(); ++i) {
    want_norm += static_cast<double>(want[i]) * want[i];
    scale_norm += static_cast<double>(scale[i]) * scale[i];
  }
  if (!std::isfinite(error) || scale_norm == 0.0) return error;
  // relative_error divides by ||want|| (or returns the absolute norm when
  // want is all zeros); rescale to ||scale||.
  const double absolute = want_norm == 0.0 ? error : error * std::sqrt(want_norm);
  return absolute / std::sqrt(scale_norm);
}

// Tolerances on the relative error norm, by the dtype results are stored in.
inline double tolerance_for(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 1e-5;
    case DType::kFloat16: return 2e-3;
    case DType::kBFloat16: return 1e-2;
    default: return 0.0;
  }
}

// `call` throws Error(kInvalidArgument) whose message contains `needle`: the
// launcher refused the input itself, before any launch (so these checks run
// without a GPU too).
template <typename Call>
void expect_invalid_argument(Call&& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no Error; expected one mentioning '" << needle << "'";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.what();
    EXPECT_NE(error.message().find(needle), std::string::npos) << error.what();
  }
}

// An fp32 HostArray holding `values`.
// Labels as int32 or int64 values (the cross-entropies take either).
inline HostArray labels_of(DType dtype, const std::vector<std::int64_t>& values) {
  HostArray out(dtype, static_cast<std::int64_t>(values.size()));
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kInt32) {
      const auto v = static_cast<std::int32_t>(values[i]);
      std::memcpy(out.bytes.data() + i * 4, &v, 4);
    } else {
      std::memcpy(out.bytes.data() + i * 8, &values[i], 8);
    }
  }
  return out;
}

inline HostArray floats(const std::vector<float>& values) {
  HostArray out(DType::kFloat32, static_cast<std::int64_t>(values.size()));
  std::memcpy(out.data(), values.data(), values.size() * sizeof(float));
  return out;
}

// An int32 HostArray holding `values` (cu_seqlens, positions, segment tables).
inline HostArray int32s(const std::vector<std::int32_t>& values) {
  HostArray out(DType::kInt32, static_cast<std::int64_t>(values.size()));
  std::memcpy(out.data(), values.data(), values.size() * sizeof(std::int32_t));
  return out;
}

// The relative error attention's GPU kernels may have against the fp32 host
// reference (max_relative): the 16-bit inputs and outputs round at each
// product, fp32 only sums in another order.
inline double attention_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return 2e-2;
    case DType::kFloat16: return 4e-3;
    default: return 1e-4;
  }
}

// max |got - want| / max |want| (the absolute difference where want is all 0);
// infinite where got is not finite. An infinite want (the -inf lse of a query
// that sees no key) must be matched exactly.
inline double max_relative(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0;
  double scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i])) {
      if (got[i] != want[i]) return INFINITY;
      continue;
    }
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, static_cast<double>(std::fabs(got[i] - want[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
  }
  return scale == 0.0 ? diff : diff / scale;
}

// An attention test's inputs and what its forward and backward return.
struct AttentionInputs {
  HostArray q, k, v, dout;
};
struct AttentionResults {
  HostArray out, lse, dq, dk, dv;
};

// Every result within attention_tolerance(dtype) of `want` (max_relative).
inline void expect_attention_close(const AttentionResults& got, const AttentionResults& want, DType dtype) {
  const double tol = attention_tolerance(dtype);
  EXPECT_LE(max_relative(got.out.to_floats(), want.out.to_floats()), tol) << "out";
  // lse is fp32 on both sides; its error is the scores' (inputs rounded the same way).
  EXPECT_LE(max_relative(got.lse.to_floats(), want.lse.to_floats()), tol) << "lse";
  EXPECT_LE(max_relative(got.dq.to_floats(), want.dq.to_floats()), tol) << "dq";
  EXPECT_LE(max_relative(got.dk.to_floats(), want.dk.to_floats()), tol) << "dk";
  EXPECT_LE(max_relative(got.dv.to_floats(), want.dv.to_floats()), tol) << "dv";
}

// GeLU (tanh approximation) and its derivative in double precision: the
// references the kernels' fp32 versions are held to.
inline double gelu_double(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

inline double gelu_grad_double(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

// An amax from a kernel against its host reference: equal bits, or both NaN
// (a NaN's payload is not part of the contract: the device's max gives the
// canonical 0x7fffffff, the host keeps the input's).
inline bool same_amax(float got, float want) {
  if (std::isnan(got) || std::isnan(want)) return std::isnan(got) && std::isnan(want);
  return std::memcmp(&got, &want, sizeof(float)) == 0;
}

}  // namespace stepgraph::testing
