// The checks of kernels/grouped_gemm.h (shared by the CUDA launchers and the
// host references) and the host references: plain loops in fp32 over the
// same clamped offsets the kernels use.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "engine/fp8.h"
#include "engine/half_precision.h"
#include "kernels/grouped_gemm.h"

namespace stepgraph::kernels {
namespace {

// Bounded by the shared memory the kernels keep the offsets and tile starts in.
constexpr std::int64_t kMaxExperts = 4096;
// Element offsets fit int32 index math inside one group in the kernels.
constexpr std::int64_t kMaxExtent = (std::int64_t{1} << 31) - 1;

bool float_input(DType d) { return d == DType::kBFloat16 || d == DType::kFloat32; }
bool fp8(DType d) { return d == DType::kFloat8E4M3 || d == DType::kFloat8E5M2; }

// An element as fp32: FP8 bytes decoded, others as load_as_float.
float element(DType dtype, const void* base, std::int64_t i) {
  if (fp8(dtype)) {
    const Fp8Format format = dtype == DType::kFloat8E4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
    return fp8_to_float(format, static_cast<const std::uint8_t*>(base)[i]);
  }
  return load_as_float(dtype, base, i);
}

}  // namespace

std::string grouped_gemm_kind_name(GroupedGemmKind kind) {
  switch (kind) {
    case GroupedGemmKind::kForward: return "forward";
    case GroupedGemmKind::kDgrad: return "dgrad";
    case GroupedGemmKind::kWgrad: return "wgrad";
  }
  return "unknown";
}

std::string GroupedGemmDesc::to_string() const {
  char text[240];
  const std::string dy = is_fp8_grouped(*this) ? " dy=" + std::string(dtype_name(dy_type)) : std::string();
  std::snprintf(text, sizeof(text), "%s T=%lld E=%lld N=%lld K=%lld in=%s%s out=%s%s%s%s",
                grouped_gemm_kind_name(kind).c_str(), static_cast<long long>(tokens), static_cast<long long>(experts),
                static_cast<long long>(n), static_cast<long long>(k), std::string(dtype_name(in_type)).c_str(),
                dy.c_str(), std::string(dtype_name(out_type)).c_str(), bias ? " bias" : "",
                accumulate ? " accumulate" : "", split_accumulation ? " split_accumulation" : "");
  return text;
}

void check_grouped_gemm(const GroupedGemmDesc& d) {
  const std::string kind = grouped_gemm_kind_name(d.kind);
  SG_CHECK(d.experts >= 1 && d.experts <= kMaxExperts, "grouped_gemm ", kind, ": expert count must be in [1, ",
           kMaxExperts, "], got ", d.experts);
  SG_CHECK(d.tokens >= 0 && d.n >= 1 && d.k >= 1, "grouped_gemm ", kind,
           ": sizes must be T >= 0, N >= 1, K >= 1, got T=", d.tokens, " N=", d.n, " K=", d.k);
  SG_CHECK(d.tokens * std::max(d.n, d.k) <= kMaxExtent && d.n * d.k <= kMaxExtent, "grouped_gemm ", kind,
           ": T * max(N, K) and N * K must stay below 2^31 elements, got T=", d.tokens, " N=", d.n, " K=", d.k);
  SG_CHECK_CODE(float_input(d.in_type) || is_fp8_grouped(d), ErrorCode::kUnsupported, "grouped_gemm ", kind,
                ": input dtype ", dtype_name(d.in_type),
                " is not supported; use bf16 (tensor cores), fp32, or FP8 with x and w in e4m3");
  SG_CHECK(!d.split_accumulation || is_fp8_grouped(d), "grouped_gemm ", kind,
           ": split_accumulation is for FP8 inputs (16-bit and fp32 inputs accumulate in fp32 already)");
  if (is_fp8_grouped(d)) {
    SG_CHECK(fp8(d.dy_type), "grouped_gemm ", kind, ": FP8 dy must be e4m3 or e5m2, got ", dtype_name(d.dy_type));
    SG_CHECK(d.n % 16 == 0 && d.k % 16 == 0, "grouped_gemm ", kind,
             ": FP8 needs N and K multiples of 16 (16-byte rows), got N=", d.n, " K=", d.k);
    SG_CHECK(d.kind != GroupedGemmKind::kWgrad || d.tokens % 16 == 0, "grouped_gemm wgrad: FP8 reads the "
             "transposed copies [N, T] and [K, T], whose rows need T a multiple of 16, got T=", d.tokens);
  }
  if (d.in_type == DType::kBFloat16) {
    SG_CHECK(d.n % 8 == 0 && d.k % 8 == 0, "grouped_gemm ", kind,
             ": bf16 needs N and K multiples of 8 (16-byte rows), got N=", d.n, " K=", d.k);
  }
  if (d.kind == GroupedGemmKind::kWgrad) {
    SG_CHECK(d.out_type == DType::kFloat32 || (d.out_type == DType::kBFloat16 && d.in_type == DType::kBFloat16),
             "grouped_gemm wgrad: dw must be fp32 (or bf16, from bf16 inputs), got ", dtype_name(d.out_type),
             " from ", dtype_name(d.in_type));
  } else {
    SG_CHECK(d.out_type == DType::kBFloat16 || d.out_type == DType::kFloat32, "grouped_gemm ", kind,
             ": output dtype must be bf16 or fp32, got ", dtype_name(d.out_type));
    SG_CHECK(!d.accumulate, "grouped_gemm ", kind, ": accumulate is for wgrad only");
  }
  SG_CHECK(!d.bias || d.kind == GroupedGemmKind::kForward, "grouped_gemm ", kind, ": bias is for forward only");
}

void check_grouped_bias_grad(const GroupedBiasGradDesc& d) {
  SG_CHECK(d.experts >= 1 && d.experts <= kMaxExperts, "grouped_bias_grad: expert count must be in [1, ", kMaxExperts,
           "], got ", d.experts);
  SG_CHECK(d.tokens >= 0 && d.n >= 1 && d.tokens * d.n <= kMaxExtent,
           "grouped_bias_grad: sizes must be T >= 0, N >= 1, T * N < 2^31, got T=", d.tokens, " N=", d.n);
  SG_CHECK_CODE(float_input(d.dy_type), ErrorCode::kUnsupported, "grouped_bias_grad: dy dtype ", dtype_name(d.dy_type),
                " is not supported; use bf16 or fp32");
}

namespace host {
namespace {

// The kernels' view of the offsets: clamped into [0, T], nondecreasing.
std::vector<std::int64_t> clamped_offsets(const std::int32_t* offsets, std::int64_t experts, std::int64_t tokens) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(experts + 1));
  for (std::int64_t e = 0; e <= experts; ++e) {
    out[e] = std::clamp<std::int64_t>(offsets[e], 0, tokens);
    if (e > 0) out[e] = std::max(out[e], out[e - 1]);
  }
  return out;
}

}  // namespace

void grouped_gemm(const GroupedGemmDesc& d, const GroupedGemmOperands& o) {
  check_grouped_gemm(d);
  SG_CHECK(o.offsets != nullptr && o.out != nullptr, "host grouped_gemm: null offsets or out");
  const std::vector<std::int64_t> offs = clamped_offsets(o.offsets, d.experts, d.tokens);
  const bool fp8_in = is_fp8_grouped(d);
  const DType in = d.in_type;
  const DType dy_type = fp8_in ? d.dy_type : in;
  const std::int64_t n = d.n;
  const std::int64_t k = d.k;
  if (fp8_in) {
    SG_CHECK(o.x_scale_inv != nullptr || d.kind == GroupedGemmKind::kDgrad, "host grouped_gemm: null x_scale_inv");
    SG_CHECK(o.w_scale_inv != nullptr || d.kind == GroupedGemmKind::kWgrad, "host grouped_gemm: null w_scale_inv");
    SG_CHECK(o.dy_scale_inv != nullptr || d.kind == GroupedGemmKind::kForward, "host grouped_gemm: null dy_scale_inv");
  }
  // FP8: the product of the operands' scale_inv; 1 otherwise.
  auto scale_of = [&](const float* a, const float* b) { return fp8_in ? *a * *b : 1.0f; };
  // Each operand the kind reads, decoded once (the loops below index fp32 values).
  auto decoded = [](DType dtype, const void* base, std::int64_t count) {
    std::vector<float> out(static_cast<std::size_t>(base != nullptr ? count : 0));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = element(dtype, base, static_cast<std::int64_t>(i));
    return out;
  };
  const std::vector<float> xs = decoded(in, d.kind != GroupedGemmKind::kDgrad ? o.x : nullptr, d.tokens * k);
  const std::vector<float> ws = decoded(in, d.kind != GroupedGemmKind::kWgrad ? o.w : nullptr, d.experts * n * k);
  const std::vector<float> dys = decoded(dy_type, d.kind != GroupedGemmKind::kForward ? o.dy : nullptr, d.tokens * n);
  if (d.kind == GroupedGemmKind::kWgrad) {
    const float scale = scale_of(o.dy_scale_inv, o.x_scale_inv);
    // FP8 reads the column-wise copies dy^T [N, T] and x^T [K, T].
    auto dy_at = [&](std::int64_t t, std::int64_t i) { return dys[fp8_in ? i * d.tokens + t : t * n + i]; };
    auto x_at = [&](std::int64_t t, std::int64_t j) { return xs[fp8_in ? j * d.tokens + t : t * k + j]; };
    for (std::int64_t e = 0; e < d.experts; ++e) {
      for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t j = 0; j < k; ++j) {
          float sum = 0.0f;
          for (std::int64_t t = offs[e]; t < offs[e + 1]; ++t) {
            sum += dy_at(t, i) * x_at(t, j);
          }
          sum *= scale;
          const std::int64_t index = (e * n + i) * k + j;
          const float old = d.accumulate ? load_as_float(d.out_type, o.out, index) : 0.0f;
          store_from_float(d.out_type, o.out, index, d.accumulate ? old + sum : sum);
        }
      }
    }
    return;
  }
  const bool forward = d.kind == GroupedGemmKind::kForward;
  const std::int64_t cols = forward ? n : k;
  const std::int64_t depth = forward ? k : n;
  const std::vector<float>& a = forward ? xs : dys;
  const float scale = forward ? scale_of(o.x_scale_inv, o.w_scale_inv) : scale_of(o.dy_scale_inv, o.w_scale_inv);
  // w_e[c, j] (forward) or w_e[j, c] (dgrad) of w [E, N, K]; FP8 dgrad reads
  // w's column-wise copy [K, E * N].
  auto w_at = [&](std::int64_t e, std::int64_t c, std::int64_t j) {
    if (forward) return ws[e * n * k + c * k + j];
    return ws[fp8_in ? c * d.experts * n + e * n + j : e * n * k + j * k + c];
  };
  const DType bias_type = fp8_in ? DType::kBFloat16 : in;
  for (std::int64_t t = 0; t < d.tokens; ++t) {
    const auto after = std::upper_bound(offs.begin(), offs.end(), t);
    const bool in_group = t >= offs.front() && t < offs.back();
    const std::int64_t e = in_group ? (after - offs.begin()) - 1 : -1;
    for (std::int64_t c = 0; c < cols; ++c) {
      float sum = 0.0f;
      if (in_group) {
        for (std::int64_t j = 0; j < depth; ++j) sum += a[t * depth + j] * w_at(e, c, j);
        sum *= scale;
        if (forward && d.bias) sum += load_as_float(bias_type, o.bias, e * n + c);
      }
      store_from_float(d.out_type, o.out, t * cols + c, sum);
    }
  }
}

void grouped_bias_grad(const GroupedBiasGradDesc& d, const void* dy, const std::int32_t* offsets, float* db) {
  check_grouped_bias_grad(d);
  SG_CHECK(offsets != nullptr && db != nullptr, "host grouped_bias_grad: null offsets or db");
  const std::vector<std::int64_t> offs = clamped_offsets(offsets, d.experts, d.tokens);
  for (std::int64_t e = 0; e < d.experts; ++e) {
    for (std::int64_t c = 0; c < d.n; ++c) {
      float sum = 0.0f;
      for (std::int64_t t = offs[e]; t < offs[e + 1]; ++t) sum += load_as_float(d.dy_type, dy, t * d.n + c);
      db[e * d.n + c] = d.accumulate ? db[e * d.n + c] + sum : sum;
    }
  }
}

}  // namespace host
}  // namespace stepgraph::kernels
