// Host references of the fused FP8 kernels (contract in fp8_fused.h): the
// ops' host references, then quantize_host on their 16-bit output, and the
// argument checks the CUDA launchers share.
#include <cstdint>
#include <vector>

#include "engine/error.h"
#include "kernels/activation.h"
#include "kernels/fp8_fused.h"
#include "kernels/fp8_quantize.h"
#include "kernels/norm.h"

namespace stepgraph::kernels {

void check_fp8_fused(const char* op, DType dtype, std::int64_t rows, std::int64_t cols, const Fp8Copies& out) {
  SG_CHECK(dtype == DType::kBFloat16 || dtype == DType::kFloat16, op, ": dtype ", dtype_name(dtype),
           " is not supported; use bf16 or fp16");
  SG_CHECK(rows >= 0 && cols >= 0, op, ": rows and cols must be >= 0, got [", rows, ", ", cols, "]");
  SG_CHECK(cols % 16 == 0, op, ": cols must be a multiple of 16, got [", rows, ", ", cols,
           "]; pad the tensor or use the unfused op and launch_quantize");
  SG_CHECK(out.amax != nullptr, op, ": amax is null; pass the float it overwrites");
  SG_CHECK(out.scale != nullptr || (out.rowwise == nullptr && out.columnwise == nullptr), op,
           ": FP8 copies asked for without a scale; pass the scale, or null copies for amax alone");
}

void check_norm_fp8(const NormDesc& desc, const Fp8Copies& out) {
  const char* op = desc.kind == NormKind::kRMSNorm ? "rmsnorm_fp8" : "layernorm_fp8";
  check_fp8_fused(op, desc.dtype, desc.rows, desc.hidden, out);
  NormDesc some_rows = desc;  // the fused norm takes rows == 0, check_norm does not
  some_rows.rows = desc.rows == 0 ? 1 : desc.rows;
  check_norm(some_rows);
  SG_CHECK(out.columnwise == nullptr || out.rowwise != nullptr, op,
           ": the column-wise copy is transposed from the row-wise one; pass rowwise too");
}

namespace host {
namespace {

// out's copies and amax of v [rows, cols], as fp8_fused.h's contract says.
void quantize_output(DType dtype, std::int64_t rows, std::int64_t cols, const void* v, const Fp8Copies& out) {
  const QuantizeDesc desc{dtype, out.format, rows, cols, out.rowwise != nullptr, out.columnwise != nullptr};
  if (out.scale == nullptr || !(desc.rowwise || desc.columnwise)) {
    *out.amax = amax_host(dtype, rows, cols, v);
    return;
  }
  quantize_host(desc, v, *out.scale, out.rowwise, out.columnwise, out.amax);
}

// The caller's 16-bit output, or a buffer of ours when it passed null.
void* output_or_scratch(void* given, DType dtype, std::int64_t n, std::vector<std::uint8_t>& scratch) {
  if (given != nullptr) return given;
  scratch.resize(static_cast<std::size_t>(n) * dtype_size(dtype));
  return scratch.data();
}

}  // namespace

void norm_fp8(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y, float* mean,
              float* rstd, const Fp8Copies& out) {
  check_norm_fp8(desc, out);
  if (desc.rows == 0) {
    *out.amax = 0.0f;
    return;
  }
  std::vector<std::uint8_t> scratch;
  void* values = output_or_scratch(y, desc.dtype, desc.rows * desc.hidden, scratch);
  norm_forward(desc, x, gamma, beta, values, mean, rstd);
  quantize_output(desc.dtype, desc.rows, desc.hidden, values, out);
}

void gelu_fp8(DType dtype, std::int64_t rows, std::int64_t cols, const void* pre, void* act, const Fp8Copies& out) {
  check_fp8_fused("gelu_fp8", dtype, rows, cols, out);
  std::vector<std::uint8_t> scratch;
  void* values = output_or_scratch(act, dtype, rows * cols, scratch);
  gelu_forward(dtype, pre, values, rows * cols);
  quantize_output(dtype, rows, cols, values, out);
}

void dgelu_fp8(DType dtype, std::int64_t rows, std::int64_t cols, const void* dact, const void* pre, void* d_pre,
               const Fp8Copies& out) {
  check_fp8_fused("dgelu_fp8", dtype, rows, cols, out);
  std::vector<std::uint8_t> scratch;
  void* values = output_or_scratch(d_pre, dtype, rows * cols, scratch);
  gelu_backward(dtype, dact, pre, values, rows * cols);
  quantize_output(dtype, rows, cols, values, out);
}

}  // namespace host
}  // namespace stepgraph::kernels
