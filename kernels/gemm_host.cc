// The fp32 host reference of launch_gemm: the same checks, bf16/fp16 inputs
// widened, alpha * opA(A) opB(B) accumulated in fp32, then the epilogue in
// fp32 and one rounding to D's dtype per output.
#include "kernels/gemm_host.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "engine/error.h"
#include "engine/fp8.h"
#include "engine/half_precision.h"

namespace stepgraph::kernels::host {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

void check_pointer(const void* pointer, const char* role, const GemmDesc& desc) {
  SG_CHECK(pointer != nullptr, "host gemm: operand '", role, "' is null, but ", desc.to_string(), " needs it");
}

void check_operands(const GemmDesc& desc, const GemmOperands& operands) {
  check_pointer(operands.a, "a", desc);
  check_pointer(operands.b, "b", desc);
  check_pointer(operands.d, "d", desc);
  if (epilogue_reads_bias(desc.epilogue)) check_pointer(operands.bias, "bias", desc);
  if (epilogue_uses_aux(desc.epilogue)) check_pointer(operands.aux, "aux", desc);
  if (epilogue_writes_bias_grad(desc.epilogue)) check_pointer(operands.bias_grad, "bias_grad", desc);
  if (desc.a_blocks) check_pointer(operands.a_scale_inv, "a_scale_inv", desc);
  if (desc.b_blocks) check_pointer(operands.b_scale_inv, "b_scale_inv", desc);
}

// An FP8 operand's scale_inv: one scalar (null: 1), or its block scales.
struct ScaleInv {
  const float* data = nullptr;
  std::optional<BlockScaleLayout> blocks;
  float at(std::int64_t outer, std::int64_t k) const {
    if (data == nullptr) return 1.0f;
    return blocks ? data[blocks->index(outer, k)] : *data;
  }
};

// op(X) as a dense row-major [rows, cols] fp32 matrix; X is stored
// [rows, cols], or [cols, rows] when transposed. FP8 values are decoded and
// multiplied by their scale_inv; `k_is_rows` says which of op(X)'s
// dimensions is the reduced one (B's), the other being the operand's outer one.
std::vector<float> widen(DType dtype, const void* data, std::int64_t rows, std::int64_t cols, bool transposed,
                         const ScaleInv& scale_inv, bool k_is_rows) {
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  const Fp8Format format = dtype == DType::kFloat8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t i = transposed ? c * rows + r : r * cols + c;
      out[r * cols + c] = is_fp8(dtype) ? fp8_to_float(format, static_cast<const std::uint8_t*>(data)[i]) *
                                              (k_is_rows ? scale_inv.at(c, r) : scale_inv.at(r, c))
                                        : load_as_float(dtype, data, i);
    }
  }
  return out;
}

// alpha * a[m, k] b[k, n], row-major [m, n], accumulated in i-k-j order.
std::vector<float> scaled_product(const GemmDesc& desc, const std::vector<float>& a, const std::vector<float>& b) {
  const std::int64_t m = desc.m, n = desc.n, k = desc.k;
  std::vector<float> acc(static_cast<std::size_t>(m * n), 0.0f);
  for (std::int64_t i = 0; i < m; ++i) {
    float* acc_row = acc.data() + i * n;
    for (std::int64_t p = 0; p < k; ++p) {
      const float a_ip = a[i * k + p];
      const float* b_row = b.data() + p * n;
      for (std::int64_t j = 0; j < n; ++j) acc_row[j] += a_ip * b_row[j];
    }
  }
  for (float& value : acc) value *= desc.alpha;
  return acc;
}

// D = alpha AB + beta D; D is not read when beta is 0 (it may hold NaN).
void accumulate(const GemmDesc& desc, const std::vector<float>& ab, void* d) {
  for (std::int64_t i = 0; i < desc.m * desc.n; ++i) {
    const float old = desc.beta != 0.0f ? desc.beta * load_as_float(desc.d_type, d, i) : 0.0f;
    store_from_float(desc.d_type, d, i, ab[i] + old);
  }
}

void add_bias(const GemmDesc& desc, const std::vector<float>& ab, const void* bias, void* d) {
  for (std::int64_t i = 0; i < desc.m * desc.n; ++i) {
    store_from_float(desc.d_type, d, i, ab[i] + load_as_float(desc.d_type, bias, i % desc.n));
  }
}

// aux = alpha AB + bias; D = gelu_tanh(aux), from aux before its rounding.
void gelu_aux_bias(const GemmDesc& desc, const std::vector<float>& ab, const GemmOperands& operands) {
  for (std::int64_t i = 0; i < desc.m * desc.n; ++i) {
    const float pre = ab[i] + load_as_float(desc.d_type, operands.bias, i % desc.n);
    store_from_float(desc.d_type, operands.aux, i, pre);
    store_from_float(desc.d_type, operands.d, i, gelu_tanh(pre));
  }
}

// D = alpha AB * gelu_tanh'(aux); bias_grad[n] = the column sums of D
// before its rounding.
void dgelu_bgrad(const GemmDesc& desc, const std::vector<float>& ab, const GemmOperands& operands) {
  std::vector<float> sums(static_cast<std::size_t>(desc.n), 0.0f);
  for (std::int64_t i = 0; i < desc.m * desc.n; ++i) {
    const float grad = ab[i] * gelu_tanh_grad(load_as_float(desc.d_type, operands.aux, i));
    store_from_float(desc.d_type, operands.d, i, grad);
    sums[i % desc.n] += grad;
  }
  for (std::int64_t j = 0; j < desc.n; ++j) store_from_float(desc.d_type, operands.bias_grad, j, sums[j]);
}

// bias_grad[m] = the row sums of opA(A) over k, not scaled by alpha.
void bias_grad_of_a(const GemmDesc& desc, const std::vector<float>& a, void* bias_grad) {
  for (std::int64_t i = 0; i < desc.m; ++i) {
    float sum = 0.0f;
    for (std::int64_t p = 0; p < desc.k; ++p) sum += a[i * desc.k + p];
    store_from_float(desc.d_type, bias_grad, i, sum);
  }
}

}  // namespace

void gemm(const GemmDesc& desc, const GemmOperands& operands) {
  check_gemm(desc);
  check_operands(desc, operands);
  // Block layouts are of the TN operands FP8 takes: A [m, k], B [n, k].
  auto layout = [&](const std::optional<BlockShape>& shape, std::int64_t outer) {
    return shape ? std::optional<BlockScaleLayout>(BlockScaleLayout{*shape, outer, desc.k}) : std::nullopt;
  };
  const std::vector<float> a = widen(desc.a_type, operands.a, desc.m, desc.k, desc.trans_a,
                                     {operands.a_scale_inv, layout(desc.a_blocks, desc.m)}, false);
  const std::vector<float> b = widen(desc.b_type, operands.b, desc.k, desc.n, desc.trans_b,
                                     {operands.b_scale_inv, layout(desc.b_blocks, desc.n)}, true);
  const std::vector<float> ab = scaled_product(desc, a, b);
  switch (desc.epilogue) {
    case GemmEpilogue::kNone: accumulate(desc, ab, operands.d); return;
    case GemmEpilogue::kBias: add_bias(desc, ab, operands.bias, operands.d); return;
    case GemmEpilogue::kGeluAuxBias: gelu_aux_bias(desc, ab, operands); return;
    case GemmEpilogue::kDGeluBGrad: dgelu_bgrad(desc, ab, operands); return;
    case GemmEpilogue::kBiasGradOfA:
      accumulate(desc, ab, operands.d);
      bias_grad_of_a(desc, a, operands.bias_grad);
      return;
  }
}

float gelu_tanh(float x) {
  const float inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

float gelu_tanh_grad(float x) {
  const float t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
}

}  // namespace stepgraph::kernels::host
